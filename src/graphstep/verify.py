"""`Config(verify_every=N)`: check a replay against a reference run of the same step.

The reference is eager execution (`verify_against="eager"`), or a graph captured afresh for this
very call (`"capture"`: it catches a stale baked value without being fooled by libraries that
take another code path while a stream captures). Every N-th replay: copy the state, run the
reference, keep its results, put the state back
(values and Python references, RNG included), replay the graph, and compare outputs and every
state tensor, bitwise or within `Config.verify_tolerance`. A mismatch raises a
`VerificationError` naming the first differing tensor; the state is then the replay's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import signature as sig
from .errors import VerificationError
from .guards.state_guard import named_state_tensors
from .state import Snapshot, TrainingState


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
