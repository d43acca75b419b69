"""Transformer Engine: a step that runs TE modules under `te.autocast` with FP8 delayed scaling, captured.

    import graphstep.integrations.transformer_engine as gs_te

    def train_step(x, y):
        with te.autocast(enabled=True, recipe=recipe):
            out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step = gs_te.capture_te_step(train_step, model=model, optimizer=optimizer)

What a plain `graphstep.capture` would get wrong. TE keeps delayed scaling's state process-wide
(`FP8GlobalStateManager.quantization_state`, transformer_engine/pytorch/quantization.py): each TE module
adds its amax history and scale tensors, once, in its first FP8 forward that is not being captured, to
global buffers per recipe key (the recipe's repr and the amax group; `add_fp8_tensors_to_global_buffer`).
The reduction at the outermost grad-enabled `te.autocast`'s exit (the forward's tensors) and in the first
module's backward (the backward's) updates every tensor registered under the key, those of modules outside
the step included; TE's update kernel skips a tensor whose current amax (`amax_history[0]`) is 0, and
zeroes the others'. A graph's reduction covers the tensors registered when it was captured. That matters
for a module that writes amaxes which no reduction of its own consumes: a model run under `te.autocast`
without grad (an evaluation, a frozen teacher; te.autocast reduces only with grad enabled) first run after
the capture. Eagerly, the next training step's reduction folds its amaxes into its history and scale;
the graph's does not, and that model's scales silently fall behind. (A second model trained with an equal
recipe is not affected: its own reductions consume its amaxes, and the captured step's reduction would
find them 0.) So the buffers' membership is part of the graph's key: when a module joins (or
`FP8GlobalStateManager.reset()` makes a new state), the step warms up and is captured again, its reduction
covering them. Read from TE 2.20's source; the GPU probe (benchmarks/te_probe.py, `linear_fp8_evalmodel`)
checks it: everything else TE's Python does in such a step leaves no trace between calls (the autocast's
state is saved and put back, the modules' flags are written with the values they hold), and the updates
themselves are GPU work, in the graph.

Not handled here: TE's debug tools (`nvdlfw_inspect`, per-iteration Python state), and
`te.distributed.checkpoint` without a graph-safe RNG tracker (it reads the CUDA generator's state with
`get_state()`, which CUDA graph capture forbids): pass `get_rng_state_tracker=` a
`CudaRNGStatesTracker` and its generators as `generators=`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..capture import CapturedStep
from ..config import Config

__all__ = ["capture_te_step", "amax_membership"]

_QUANTIZATION_MODULES = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")
"""Where FP8GlobalStateManager lives: quantization.py since TE 2.10, fp8.py before."""


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


def capture_te_step(
    fn: Callable | None = None,
    *,
    model: Any = None,
    optimizer: Any = None,
    generators: list | None = None,
    config: Config | None = None,
) -> Any:
    """`graphstep.capture` for a step that runs Transformer Engine modules (see the module's docstring):
    the same arguments; the graphs are keyed on TE's amax buffers' membership. Usable as a decorator."""
    options = {"model": model, "optimizer": optimizer, "generators": generators, "config": config}
    if fn is None:
        return lambda f: capture_te_step(f, **options)

    def step(*args: Any, _graphstep_te: tuple = (), **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    step.__name__ = getattr(fn, "__name__", "step")
    step.__qualname__ = getattr(fn, "__qualname__", step.__name__)
    return _TEStep(step, **options)


class _TEStep(CapturedStep):
    """A `CapturedStep` whose calls carry TE's amax buffers' membership in their key."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, _graphstep_te=amax_membership(), **kwargs)
