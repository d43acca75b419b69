"""Capturing one variant of a signature's graph: the step run once under the capture, with every watch
on its Python (writes, host random draws, reads, optimizer steps), its guard built, and on failure
everything put back as eager would have left it.

`capture_variant` is what `Lifecycle` calls for a first capture, a variant, a re-capture or a switch.
When an optimizer's step stopped the capture (a host sync, a Python value it changes) and now runs
as an eager segment, the capture is tried again (`optim/modes.py`, `after_failed_capture`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from . import effects
from . import signature as sig
from .backends import autograd_segments, library_segments, output_ring, segments
from .backends.base import PartsRecording, Recording
from .backends.cuda import CudaGraphBackend
from .diagnostics import capture_error
from .effects import host_random
from .errors import GraphStepError, WarmUpAgain
from .guards.reads import ReadWatch
from .guards.state_guard import StateGuard
from .profiling import ranged
from .state import Snapshot
from .step_context import StepContext


@dataclasses.dataclass(eq=False)
class Variant:
    """One captured graph of a signature, valid while its guard holds."""

    recording: Recording
    guard: StateGuard | None
    output_spec: Any
    output_tensors: list[torch.Tensor]
    optimizer_layout: tuple
    """`OptimizerAdapter.state_layout()` at capture: which parameters had which optimizer state."""
    modes_epoch: int
    last_used: int = 0


def capture_variant(
    ctx: StepContext, args: tuple, kwargs: dict, segment_results: list, warm_outputs: list | None
) -> Variant:
    """Capture the step for a call with these (static) arguments; every rank agrees it succeeded.
    On failure the model, optimizer and RNG are put back as they were and the error raised.
    `warm_outputs`: the output tensors of the last warm-up, described (the output ring is made like them)."""
    backend = ctx.backend
    start = time.perf_counter()
    ctx.modes.choose_before_capture(ctx.state.optimizers)
    snapshot = Snapshot.take(ctx.state, backend.cuda_devices)
    captured: dict[str, Any] = {}
    params = ctx.state.parameters()
    # Python effects of the step's own code (writes to state that outlives the call): refused at
    # capture, after the step ran (so that a backend undoes its tensor writes too), and undone.
    python = effects.watch_writes(
        ctx.name, allow_writes=ctx.config.allow_python_writes, graphs=backend.static_buffers
    )
    # The output ring's memory, made outside the capture (see output_ring.py).
    device = torch.device("cuda", backend.index) if isinstance(backend, CudaGraphBackend) else "cpu"
    ring = (
        output_ring.prepare(warm_outputs, device)
        if backend.static_buffers and ctx.config.outputs == "clone"
        else None
    )

    def body(splitter: segments.Splitter, *a: Any, **k: Any) -> Any:
        with (
            # Host random draws are refused, the generators put back (eager segments may draw).
            host_random.refusing(ctx.name, backend, ctx.fn, splitter, a, k, captured) as splitter,
            segments.capturing(splitter, params, segment_results) as session,
            segments.optimizer_steps_as_segments(ctx.modes.eager, ctx.modes.fresh_grads()),
            ctx.modes.observing(ctx.state.optimizers, capturing=True),
            library_segments.calls_as_segments(
                ctx.name, capturing=True, log_at_capture=backend.static_buffers
            ),
            python,
        ):
            outputs = ctx.fn(*a, **k)
            # Inside the capture, so that a refused output also undoes what the step did.
            captured["spec"], captured["tensors"] = sig.replayable_outputs(
                outputs, ctx.name, device_only=isinstance(backend, CudaGraphBackend)
            )
        autograd_segments.finish(session.segments)
        captured["segments"] = session.segments
        captured["ring"] = output_ring.record(ring, captured["tensors"], written=backend.capture_executes)
        return outputs

    recording, error, guard = None, None, None
    try:
        # What the step's Python reads, its non-tensor arguments' contents included.
        with ranged("graphstep.capture"), ReadWatch(sig.non_tensor_arguments(args, kwargs)) as watch:
            recording = backend.capture(
                body,
                args,
                kwargs,
                ctx.generators,
                split_in_backward=any(seen.reach is not None for seen in segment_results),
            )
        if ctx.config.check != "off" and backend.static_buffers:  # the eager backend bakes nothing
            guard = StateGuard(
                ctx.state,
                ctx.fn,
                strict=ctx.config.check == "strict",
                grads_before=snapshot.grads,
                reads=watch.reads,
                eager_optimizers=ctx.modes.eager,
                unbaked=ctx.optim.can_stay_in_graph,
            )
            # Before the ranks agree: a read strict_reads refuses fails the capture on every rank.
            guard.reads.report_unwatched(ctx.name, strict=ctx.config.strict_reads)
    except BaseException as exc:
        error = exc
    if ctx.ranks is not None:  # before any rank replays a new graph, every capture succeeded
        failed = ctx.ranks.capture_failure(ctx.name, error)
        if failed is not None and error is None:
            error = failed
    if error is not None:
        if recording is not None:  # the backend captured, then a read or another rank failed it
            undo = getattr(recording, "undo", None)
            recording.release()
            if undo is not None:
                undo()
        snapshot.restore()
        python.roll_back()
        if not isinstance(error, Exception):
            raise error
        converted = (
            error
            if isinstance(error, GraphStepError)
            else capture_error(ctx.name, error, ctx.state.named_modules_roots())
        )
        if ctx.ranks is None and ctx.modes.after_failed_capture(converted, ctx.state.optimizers):
            # An optimizer's step stopped the capture and now runs as an eager segment: again.
            return capture_variant(ctx, args, kwargs, segment_results, warm_outputs)
        if ctx.ranks is None and ctx.breaks.after_failed_capture(error):
            # A module around the failing line runs eagerly from now on: it needs a warm-up's notes.
            ctx.stats.graph_breaks = len(ctx.breaks.made)
            raise WarmUpAgain(f"a graph break was made in {ctx.name}", after_break=True) from error
        if converted is error:
            raise error
        raise converted from error
    if isinstance(recording, PartsRecording):
        recording.undo = None  # accepted: the writes it could take back are the step's
        recording.segments = captured["segments"]
        # A grad the step drops (`zero_grad()`, set_to_none) after one that existed before it (an
        # accumulating micro-batch's) is dropped after every replay too: the next call starts from None.
        had = {id(p) for p, g in snapshot.grads if g is not None}
        recording.grads_after = [
            (p, p.grad) for p in params if recording.segments or p.grad is not None or id(p) in had
        ]
        recording.host_draws = captured.get("host_draws", [])
        recording.ring = captured["ring"]
    recording.outputs = sig.unflatten(captured["spec"], captured["tensors"])
    if isinstance(backend, CudaGraphBackend):
        torch.cuda.synchronize(backend.index)
    ctx.stats.captures += 1
    ctx.stats.capture_s += time.perf_counter() - start
    return Variant(
        recording, guard, captured["spec"], captured["tensors"], ctx.optim.state_layout(), ctx.modes.epoch
    )
