"""Capturing one variant of a signature's graph: the step run once under the capture, with every watch
on its Python (writes, host random draws, reads, optimizer steps), its guard built, and on failure
everything put back as eager would have left it.

`capture_variant` is what `Lifecycle` calls for a first capture, a variant, a re-capture or a switch.
When an optimizer's step stopped the capture (a host sync, a Python value it changes) and now runs
as an eager segment, the capture is tried again (`optim/modes.py`, `after_failed_capture`). When it
stopped inside a module, that module becomes a graph break and the call one more warm-up; with ranks,
every rank makes the same breaks, agreed after the capture failed (`distributed/breaks.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any

import torch

from . import effects
from . import signature as sig
from .backends import autograd_segments, library_segments, output_ring, segments, stranded
from .backends.base import PartsRecording, Recording
from .backends.cuda import CudaGraphBackend
from .backends.loose import LooseArgumentRead
from .diagnostics import capture_error, is_out_of_memory
from .distributed import fsdp_parts
from .distributed.breaks import agree_on_breaks, split_capture_hint
from .effects import host_random
from .errors import CaptureError, GraphStepError, OutOfMemoryAtCapture, WarmUpAgain
from .guards.module_inputs import ModuleInputs
from .guards.reads import ReadWatch
from .guards.state_guard import StateGuard, named_modules
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
    inputs: ModuleInputs | None = None
    """Input-like attributes of modules (a BlockMask set per batch): loaded before every replay."""
    ddp_resets: int = 0
    """`Ranks.ddp_resets` at capture: the DDP buckets this graph copies gradients into."""


def let_go(error: BaseException, backend: Any, handled: BaseException | None) -> None:
    """Clear the local variables of the failed capture's finished frames on `error`'s traceback (the
    step's, the model's: its activations) before this call warms up again or captures again, and hand
    back the segments that frees in the pool the capture abandoned. The error lives on until then (the
    warm-up runs while it is handled), and with it every tensor those frames held: a break at the end of
    the forward (the MoE auxiliary loss) held all its activations through the next warm-up (issue 42:
    the batched_mm row peaked at 14.9 GiB against eager's 8.8). Its message and lines stay. `handled`: the
    error the caller was handling when the capture began (left alone, with what it was raised from)."""
    seen: set[int] = {id(handled)} if handled is not None else set()
    while error is not None and id(error) not in seen:  # and the errors it was raised from, or during
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            with contextlib.suppress(RuntimeError):  # a frame still running: its locals are in use
                tb.tb_frame.clear()
                # Python 3.11/3.12: a dict of the locals made before (the break's search read `self`
                # in each frame) keeps them until `f_locals` is read again, which empties it.
                tb.tb_frame.f_locals  # noqa: B018
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    if isinstance(backend, CudaGraphBackend):
        torch.cuda.empty_cache()


def capture_variant(
    ctx: StepContext, args: tuple, kwargs: dict, segment_results: list, warm_outputs: list | None
) -> Variant:
    """Capture the step for a call with these (static) arguments; every rank agrees it succeeded.
    On failure the model, optimizer and RNG are put back as they were and the error raised.
    `warm_outputs`: the output tensors of the last warm-up, described (the output ring is made like them)."""
    backend = ctx.backend
    start = time.perf_counter()
    handled = sys.exc_info()[1]  # the caller's, if the step is called while it handles an error
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

    # FSDP2's side streams and events kept inside each part of a capture split by breaks (fsdp_parts.py).
    fsdp = fsdp_parts.fsdp_states(ctx.state.modules)
    stream = backend.stream if isinstance(backend, CudaGraphBackend) else None

    def body(splitter: segments.Splitter, *a: Any, **k: Any) -> Any:
        with (
            fsdp_parts.across_parts(splitter, fsdp, stream) as splitter,
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
            # Called from a local: the read watch finds the step function (and its closure's cells)
            # in its caller's names, not by a pass over the heap (guards/reads.py, _caller_function).
            step = ctx.fn
            outputs = step(*a, **k)
            # Inside the capture, so that a refused output also undoes what the step did.
            captured["spec"], captured["tensors"] = sig.replayable_outputs(
                outputs, ctx.name, device_only=isinstance(backend, CudaGraphBackend)
            )
        autograd_segments.finish(session.segments)
        captured["segments"] = session.segments
        captured["ring"] = output_ring.record(ring, captured["tensors"], written=backend.capture_executes)
        return outputs

    inputs = None
    if backend.static_buffers:  # a BlockMask set on a module: the graph reads a copy of it, loaded per call
        roots = ctx.state.named_modules_roots()
        inputs = ModuleInputs.found([nm for p, r in roots for nm in named_modules(p, r)], backend.new_buffer)
        if inputs is not None:
            inputs.fit()
            inputs.load()
    recording, error, guard = None, None, None
    loose_reads, ctx.loose.capturing = ctx.loose.reads, True
    try:
        # What the step's Python reads, its non-tensor arguments' contents included.
        with (
            inputs.swapped_in() if inputs is not None else contextlib.nullcontext(),
            ranged("graphstep.capture"),
            ReadWatch(sig.non_tensor_arguments(args, kwargs)) as watch,
        ):
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
                inputs=inputs,
            )
            # Before the ranks agree: a read strict_reads refuses fails the capture on every rank.
            guard.reads.report_unwatched(ctx.name, strict=ctx.config.strict_reads)
    except BaseException as exc:
        error = exc
    ctx.loose.capturing = False
    if error is None and ctx.loose.reads != loose_reads:  # the step swallowed a placeholder's error
        error = LooseArgumentRead("the step used an argument passed to eager segments only outside them")
    own = error if ctx.ranks is not None and error is not None and not ctx.ranks.relayed(error) else None
    voted = False
    if ctx.ranks is not None:  # before any rank replays a new graph, every capture succeeded
        try:
            failed = ctx.ranks.capture_failure(ctx.name, error)
            voted = True
        except BaseException as exc:  # the vote itself failed (a rank exited): put everything back first
            failed = exc if error is None else None
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
        if isinstance(backend, CudaGraphBackend):  # a pool a host sync abandoned: its tensors move out
            stranded.move_out(backend, ctx.state.tensors_kept())
        if voted and ctx.ranks.out_of_memory_at_capture() is None:
            # Every rank knows the capture failed: all make the same graph breaks (those any rank's
            # failure calls for) and warm up again together, or none does (distributed/breaks.py).
            again = agree_on_breaks(ctx.ranks, ctx.breaks, own)
            if isinstance(again, WarmUpAgain):
                ctx.ranks.step_eagerly_instead()  # this call's warm-up: its collectives checked afresh
                ctx.stats.graph_breaks = len(ctx.breaks.made)
                let_go(error, backend, handled)
            if again is not None:  # (or no rank breaks, for a reason every rank raises)
                raise again from error
            if isinstance(error, WarmUpAgain):  # another rank refuses: no rank warms up alone
                raise CaptureError(str(error)) from error
        if not isinstance(error, Exception):
            raise error
        converted = (
            error
            if isinstance(error, GraphStepError)
            else capture_error(ctx.name, error, ctx.state.named_modules_roots())
        )
        hint = split_capture_hint(error, ctx.state.modules) if ctx.breaks.made else None
        if hint is not None:
            converted = CaptureError(f"{converted}\n{hint}")
        if ctx.ranks is None and backend.static_buffers and is_out_of_memory(error):
            # Not a graph break or an optimizer to move: the same step fits once memory is free. (The
            # eager backend's capture is an eager step, run under no undo log: its error stands, as eager's.)
            raise OutOfMemoryAtCapture(str(converted)) from error
        short_rank = ctx.ranks.out_of_memory_at_capture() if ctx.ranks is not None else None
        if short_rank is not None and backend.static_buffers:
            # Some rank ran out of memory: every rank knows it from the same vote, and every rank
            # runs this call as an eager step, together, and captures on the next (each rank has the
            # same backend; on the eager backend the error stands on every rank, as above).
            ctx.ranks.step_eagerly_instead()
            raise OutOfMemoryAtCapture(str(converted), rank=short_rank) from error
        if ctx.ranks is None and ctx.modes.after_failed_capture(converted, ctx.state.optimizers):
            # An optimizer's step stopped the capture and now runs as an eager segment: again.
            let_go(error, backend, handled)
            return capture_variant(ctx, args, kwargs, segment_results, warm_outputs)
        if ctx.ranks is None and ctx.breaks.after_failed_capture(error):
            # A module around the failing line runs eagerly from now on: it needs a warm-up's notes.
            ctx.stats.graph_breaks = len(ctx.breaks.made)
            let_go(error, backend, handled)
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
        recording,
        guard,
        captured["spec"],
        captured["tensors"],
        ctx.optim.state_layout(),
        ctx.modes.epoch,
        inputs=inputs,
        ddp_resets=ctx.ranks.ddp_resets if ctx.ranks is not None else 0,
    )
