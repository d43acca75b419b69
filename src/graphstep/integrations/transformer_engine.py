"""Transformer Engine: what `graphstep.capture` watches of TE's process-wide FP8 state.

Nothing to call: a step that runs TE modules under `te.autocast` (FP8 delayed scaling included) is captured
with plain `graphstep.capture`. This module is what the captured step consults on each call once TE is
imported.

Why. TE keeps delayed scaling's state process-wide (`FP8GlobalStateManager.quantization_state`,
transformer_engine/pytorch/quantization.py): each TE module adds its amax history and scale tensors, once,
in its first FP8 forward that is not being captured, to global buffers per recipe key (the recipe's repr
and the amax group; `add_fp8_tensors_to_global_buffer`). The reduction at the outermost grad-enabled
`te.autocast`'s exit (the forward's tensors) and in the first module's backward (the backward's) updates
every tensor registered under the key, those of modules outside the step included. A graph's reduction
covers the tensors registered when it was captured; eagerly, the same step also updates the ones registered
since. Where that differs: a model with the same recipe first run after the capture *without grad* (an
evaluation, a frozen teacher) leaves its amaxes for the next training step's reduction, which a graph
captured before it would skip, its scale left behind (TE's update skips a tensor whose current amax is 0, so
a second model that *trains* reduces its own and is not affected). So the captured step reads the buffers'
membership at each call: when a module joined (or `FP8GlobalStateManager.reset()` made a new state), its
graphs are dropped and it warms up and is captured again, the reduction covering them.

Read from TE 2.20's source and checked on an H100 (benchmarks/te_probe.py, tests/gpu/test_transformer_engine_gpu.py):
everything else TE's Python does in such a step leaves no trace between calls (the autocast's state is saved
and put back, the modules' flags are written with the values they hold), and the updates themselves are GPU
work, in the graph. Not covered: TE's debug tools (`nvdlfw_inspect`, per-iteration Python state), and dropout
inside `te.distributed.checkpoint` (recompute was checked with and without an RNG tracker, on layers without
dropout).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["amax_membership", "te_imported"]

_QUANTIZATION_MODULES = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")
"""Where FP8GlobalStateManager lives: quantization.py since TE 2.10, fp8.py before."""


def te_imported() -> bool:
    return any(name in sys.modules for name in _QUANTIZATION_MODULES)


def _manager() -> Any:
    for name in _QUANTIZATION_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "FP8GlobalStateManager"):
            return module.FP8GlobalStateManager
    return None


def amax_membership() -> tuple:
    """Which tensors TE's amax reductions cover now: the state object (`reset()` makes another) and,
    per global buffer key, how many tensors are registered (modules are only ever added, once each)."""
    manager = _manager()
    if manager is None:  # TE not imported yet: nothing registered
        return ()
    state = getattr(manager, "quantization_state", manager)  # TE < 2.20 kept the buffers on the class
    buffers = getattr(state, "global_amax_buffer", {})
    return (id(state), tuple(sorted((key, len(tensors)) for key, tensors in buffers.items())))
