"""`StepContext`: what every input signature of one captured step shares: the step function, its
config, training state, backend, optimizer adapter, counters and ranks, and where each optimizer's
`step()` runs (inside the graphs, or as an eager segment between them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import signature as sig
from .backends.base import Backend
from .config import Config
from .diagnostics import StepStats, log
from .distributed.ranks import Ranks
from .optim.adapter import OptimizerAdapter
from .state import TrainingState


@dataclasses.dataclass(eq=False)
class StepContext:
    """What every signature of one captured step shares."""

    fn: Callable
    name: str
    config: Config
    state: TrainingState
    backend: Backend
    optim: OptimizerAdapter
    stats: StepStats
    generators: list[torch.Generator]
    ranks: Ranks | None
    warmups_needed: int
    graphs_alive: Callable[[], int]
    eager_optimizers: list[torch.optim.Optimizer] = dataclasses.field(default_factory=list)
    """Optimizers whose `step()` runs as an eager segment between graph replays."""
    modes_epoch: int = 0
    """Bumped when an optimizer moves to an eager segment: graphs captured before are out of date."""

    def pool_is_free(self) -> bool:
        """Warm up inside the pool only while no graph uses it (see `Backend.warmup`)."""
        return self.backend.graphs == 0

    def renew_pool_if_unused(self) -> None:
        if self.pool_is_free():
            self.backend.renew_pool()

    def move_to_eager(self, optimizers: list[torch.optim.Optimizer], why: str) -> None:
        for opt in optimizers:
            if not any(opt is o for o in self.eager_optimizers):
                self.eager_optimizers.append(opt)
                log.warning(
                    "graphstep: %s: %s.step() runs eagerly between graph replays from now on; no re-capture "
                    "will be needed when its hyperparameters change again. Why: %s",
                    self.name,
                    type(opt).__qualname__,
                    why,
                )
        self.modes_epoch += 1

    def choose_optimizer_modes(self) -> None:
        """Before a capture, in `optimizer_mode="auto"`: an optimizer whose step will differ from
        what a graph bakes runs as an eager segment from the start, rather than after a capture
        that its first change would throw away. That is one whose step reads the host every call,
        one whose state holds Python numbers (a custom optimizer's step counter, which no graph
        would update), and one with a scheduler attached (torch's schedulers add `initial_lr`, and
        `base_momentum` when they cycle momentum) that changes a value it bakes."""
        if self.config.optimizer_mode != "auto" or not self.backend.static_buffers:
            return  # the eager backend runs every step eagerly already
        for opt in self.state.optimizers:
            if any(opt is o for o in self.eager_optimizers):
                continue
            why = self.optim.eager_only(opt)
            if not why and any(isinstance(v, (int, float)) for s in opt.state.values() for v in s.values()):
                why = "its state holds Python numbers, which a graph would freeze"
            for key in _scheduled_keys(opt):
                if not why and not self.optim.can_stay_in_graph(opt, key):
                    why = f"a scheduler changes {key!r}, which it reads as a Python number"
            if why:
                self.move_to_eager([opt], why)

    def optimizers_to_move(self, changes: list) -> list[torch.optim.Optimizer]:
        """Optimizers whose baked hyperparameters are among `changes` and that may move to an
        eager segment (`optimizer_mode="auto"`)."""
        if self.config.optimizer_mode != "auto":
            return []
        found = [getattr(c, "optimizer", None) for c in changes]
        return [opt for opt in found if opt is not None]

    def run_eager(self, args: tuple, kwargs: dict) -> Any:
        self.stats.eager_calls += 1
        return sig.detached(self.fn(*args, **kwargs))


def _scheduled_keys(opt: torch.optim.Optimizer) -> list[str]:
    """The keys a torch LR scheduler attached to `opt` will change (see `choose_optimizer_modes`)."""
    group = opt.param_groups[0] if opt.param_groups else {}
    keys = ["lr"] if "initial_lr" in group else []
    if "base_momentum" in group:  # OneCycleLR / CyclicLR with cycle_momentum=True
        keys.append("momentum" if "momentum" in group else "betas[0]")
    return keys
