"""`Config(verify_every=N)`: check a replay against a reference run of the same step.

The reference is eager execution (`verify_against="eager"`), or a graph captured afresh for this
very call (`"capture"`: it catches a stale baked value without being fooled by libraries that
take another code path while a stream captures). Every N-th replay: copy the state, run the
reference, keep its results, put the state back
(values and Python references, RNG included), replay the graph, and compare outputs and every
state tensor, bitwise or within `Config.verify_tolerance`. A mismatch raises a
`VerificationError` naming the first differing tensor; the state is then the replay's.
`verified_replay` is such a replay of a lifecycle's current graph.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from . import signature as sig
from .errors import VerificationError
from .guards.state_guard import named_state_tensors
from .state import Snapshot, TrainingState
from .step_context import StepContext


class Life(Protocol):
    """What `verified_replay` needs of one signature's lifecycle (`lifecycle.Lifecycle`, which calls it):
    named here, so that this module does not import the one that imports it."""

    ctx: StepContext
    inputs: Any
    """The static input buffers (`backends.buffers`): `.tensors`, empty where the backend has none."""
    signature: sig.Signature
    current: Any
    """The variant replays use: `.recording.replay(args, kwargs)`."""
    variants: list

    def capture(self, leaves: list, args: tuple, kwargs: dict, *, replaced: list) -> Any:
        """Capture a graph for the current state and perform this call's step with it."""
        ...


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if tolerance == 0:
        return torch.equal(a, b)
    a64, b64 = a.double(), b.double()
    scale = b64.abs().clamp_min(1e-12)
    return bool(((a64 - b64).abs() / scale).max() <= tolerance) if a.numel() else True


def verify(
    state: TrainingState,
    fn: Callable,
    cuda_devices: tuple[int, ...],
    run_reference: Callable[[], Any],
    replay: Callable[[], Any],
    tolerance: float,
) -> Any:
    """Run the reference (eager, or a fresh capture) then the replay from the same state; return
    the replay's outputs if they agree."""
    named = list(named_state_tensors(state, fn))
    named += [
        (f"{n}.grad", p.grad) for n, p in named if isinstance(p, torch.nn.Parameter) and p.grad is not None
    ]
    refs = Snapshot.take(state, cuda_devices)
    before = [t.detach().clone() for _, t in named]
    eager_out = sig.flatten(run_reference())[0]
    eager_out = [t.detach().clone() for t in eager_out]
    eager_state = [t.detach().clone() for _, t in named]
    with torch.no_grad():
        for (_, t), saved in zip(named, before):
            t.copy_(saved)
    refs.restore()
    outputs = replay()
    replay_out = sig.flatten(outputs)[0]
    pairs = [(f"output {i}", r, e) for i, (r, e) in enumerate(zip(replay_out, eager_out))]
    pairs += [(name, t, e) for (name, t), e in zip(named, eager_state)]
    for name, got, want in pairs:
        if not _close(got, want, tolerance):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            raise VerificationError(
                f"verify_every: the replay differs from the reference run at {name} (max |diff| {diff}). Something the "
                "graph baked in changed without a guard noticing, or a kernel is not deterministic: turn on "
                "torch.use_deterministic_algorithms(True), or set Config.verify_tolerance."
            )
    return outputs


def verified_replay(life: Life, leaves: list, args: tuple, kwargs: dict) -> Any:
    """A replay checked against a reference run of the same step (`Config(verify_every=N)`)."""
    ctx = life.ctx
    # The reference run reads the same static buffers the replay will.
    buffers = life.inputs.tensors
    inputs = sig.unflatten(life.signature.spec, buffers) if buffers else (args, kwargs)
    if ctx.config.verify_against == "capture":
        reference = functools.partial(_fresh_capture_run, life, leaves, *inputs)
    else:
        reference = functools.partial(ctx.backend.warmup, ctx.fn, *inputs, in_pool=False)
    return verify(
        ctx.state,
        ctx.fn,
        ctx.backend.cuda_devices,
        run_reference=reference,
        replay=lambda: life.current.recording.replay(args, kwargs),
        tolerance=ctx.config.verify_tolerance,
    )


def _fresh_capture_run(life: Life, leaves: list, args: tuple, kwargs: dict) -> Any:
    """Capture this call afresh from the current state and run it once (`verify_against=
    "capture"`): a graph that baked a stale value differs from it, while a library's
    capture-only code path (transformers') is taken by both."""
    stats = life.ctx.stats
    kept_current, kept, counted = life.current, list(life.variants), dataclasses.astuple(stats)
    try:
        return life.capture(leaves, args, kwargs, replaced=[])
    finally:
        fresh = life.current
        life.variants, life.current = kept, kept_current
        for field, value in zip(dataclasses.fields(stats), counted):
            setattr(stats, field.name, value)  # a check, not a step: the counters stay as they were
        if fresh is not kept_current:
            fresh.recording.release()
