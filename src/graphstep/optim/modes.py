"""Where each optimizer's `step()` runs: inside the graphs, or as an eager segment between replays.

An optimizer moves to an eager segment, once and for good, when its step would differ from what a
graph bakes: `Config(optimizer_mode="eager")` from the start; in `"auto"`, before a capture when its
step reads the host every call, it updates parameters with sparse gradients, its step changed Python
values in warm-up or a scheduler will change a value it bakes, and after a capture when such a baked
value changed. Graphs captured before a move are
out of date: `epoch` counts the moves, and a graph records the epoch it was captured in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from ..diagnostics import log
from ..errors import HostSyncError, PythonWriteError, UnsupportedOptimizerError
from .adapter import OptimizerAdapter
from .python_state import StepObserver


class OptimizerModes:
    """The optimizers of one captured step whose `step()` runs as an eager segment."""

    def __init__(
        self,
        adapter: OptimizerAdapter,
        mode: str,
        step_name: str,
        *,
        graphs: bool = False,
        host_tensors: bool = False,
    ):
        self.adapter = adapter
        self.graphs = graphs
        """The backend captures graphs (the eager backend runs every step eagerly: nothing to watch)."""
        self.mode = mode
        """`Config.optimizer_mode`: "auto", "graph" or "eager"."""
        self.step_name = step_name
        self.eager: list[torch.optim.Optimizer] = []
        self.epoch = 0
        """Bumped when an optimizer moves: graphs captured before are out of date."""
        self.observer = StepObserver(host_tensors=host_tensors)
        """What each optimizer's step changed in Python in the last warm-up (see `python_state.py`).
        `host_tensors`: the graphs run on a GPU, so a CPU tensor in an optimizer is host state."""

    def observing(
        self, optimizers: Iterable[torch.optim.Optimizer], *, capturing: bool = False
    ) -> contextlib.AbstractContextManager:
        """While warming up or capturing (graphs only): note what each optimizer's step changes in
        Python, whether it keeps a gradient by reference, and which step raised."""
        if not self.graphs:
            return contextlib.nullcontext()
        return self.observer.watching(optimizers, "the capture" if capturing else "the last warm-up")

    def fresh_grads(self) -> list[torch.optim.Optimizer]:
        """The eager optimizers whose step keeps a gradient by reference: their segment is handed a
        copy of each gradient (a graph reuses one buffer; eager makes a new gradient every step)."""
        return [opt for opt in self.eager if self.observer.keeps_grads(opt)]

    def after_failed_capture(self, error: BaseException, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
        """In "auto" mode, after a capture failed: an optimizer whose step raised the host sync that
        stopped it, or whose step changed Python values while capturing (a write the capture refused),
        moves to an eager segment; True when one moved (capture again). Warm-up usually finds these
        first; this catches a step that syncs only while a stream captures, or an optimizer whose
        Python values a single warm-up could not tell from its lazily made state."""
        if self.mode != "auto":
            return False
        moved = False
        for opt in optimizers:
            if self.is_eager(opt):
                continue
            why = None
            if isinstance(error, HostSyncError) and any(opt is o for o in self.observer.interrupted):
                why = f"its step reads the host, which a graph cannot record: {str(error).splitlines()[0]}"
            elif isinstance(error, PythonWriteError):
                why = self.observer.reason(opt)
            if why:
                self.move_to_eager([opt], why)
                moved = True
        return moved

    def is_eager(self, opt: torch.optim.Optimizer) -> bool:
        return any(opt is o for o in self.eager)

    def move_to_eager(self, optimizers: Iterable[torch.optim.Optimizer], why: str) -> None:
        for opt in optimizers:
            if not self.is_eager(opt):
                self.eager.append(opt)
                log.warning(
                    "graphstep: %s: %s.step() runs eagerly between graph replays from now on. Why: %s",
                    self.step_name,
                    type(opt).__qualname__,
                    why,
                )
        self.epoch += 1

    def choose_before_capture(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """In `optimizer_mode="auto"`: an optimizer whose step will differ from what a graph bakes
        runs as an eager segment from the start, rather than after a capture that its first change
        would throw away. That is one whose step reads the host every call, one whose step changed
        Python values in the last warm-up (a step counter in its param groups or state, which no graph
        would update, whatever package it comes from: `python_state.py`), and one with
        a scheduler attached (torch's schedulers add `initial_lr`, and `base_momentum` when they cycle
        momentum) that changes a value it bakes. Only for backends that capture graphs: the eager
        backend runs every step eagerly already."""
        if self.mode == "graph" and self.graphs:
            for opt in optimizers:
                why = (
                    self.observer.reason(opt)
                    if self.observer.keeps_grads(opt)
                    else self.adapter.sparse_grads(opt)
                )
                if why:
                    raise UnsupportedOptimizerError(
                        f'{type(opt).__qualname__} cannot run in a graph (Config(optimizer_mode="graph")): '
                        f'{why}. Use optimizer_mode="auto" or "eager".'
                    )
        if self.mode != "auto":
            return
        for opt in optimizers:
            if self.is_eager(opt):
                continue
            why = self.why_eager(opt, self.observer)
            if why:
                self.move_to_eager([opt], why)

    def why_eager(self, opt: torch.optim.Optimizer, observer: StepObserver) -> str | None:
        """Why `opt`'s step must run as an eager segment from the start in "auto" mode (`observer`:
        what its step was seen to change), or None: it stays in the graph."""
        why = self.adapter.eager_only(opt) or self.adapter.sparse_grads(opt) or observer.reason(opt)
        for key in _scheduled_keys(opt):
            if not why and not self.adapter.can_stay_in_graph(opt, key):
                why = f"a scheduler changes {key!r}, which it reads as a Python number; {_NO_RECAPTURE}"
        return why

    def explain(self, opt: torch.optim.Optimizer, observer: StepObserver) -> str:
        """Where `opt`'s step will run and why, for `graphstep.explain` (`observer`: its dry run)."""
        name = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if self.is_eager(opt):
            return f"{name}.step(): an eager segment between graph replays (already moved)"
        if self.mode == "eager":
            return f'{name}.step(): an eager segment between graph replays (Config(optimizer_mode="eager"))'
        if self.mode == "graph" and observer.reason(opt):
            return (
                f'{name}.step(): in the graph (Config(optimizer_mode="graph")), but the capture will refuse '
                f"it: {observer.reason(opt)}"
            )
        why = self.why_eager(opt, observer) if self.mode == "auto" else None
        if why:
            return (
                f"{name}.step(): an eager segment between graph replays, one host round trip per call: {why}"
            )
        if id(opt) not in observer.seen:
            return f"{name}.step(): not called by this step"
        return (
            f"{name}.step(): in the graph (its step changed no Python value: every per-step value is on "
            "the device; a hyperparameter it reads as a number moves it to an eager segment when it changes)"
        )

    def move_for_changes(self, changes: Iterable[object]) -> bool:
        """In `optimizer_mode="auto"`: each optimizer whose baked hyperparameters are among a guard's
        `changes` moves to an eager segment, its log line naming the keys that changed and how (only
        its own changes). True when one moved."""
        if self.mode != "auto":
            return False
        by_optimizer: dict[int, tuple[torch.optim.Optimizer, list]] = {}
        for change in changes:
            opt = getattr(change, "optimizer", None)
            if opt is not None:
                by_optimizer.setdefault(id(opt), (opt, []))[1].append(change)
        for opt, own in by_optimizer.values():
            keys = sorted({c.key for c in own if getattr(c, "key", None)})
            named = ", ".join(repr(k) for k in keys) or "a param-group value"
            listed = "\n".join(f"  - {c}" for c in own)
            self.move_to_eager(
                [opt],
                f"{named} changed, which its step reads as a Python number (baked into the graph):\n"
                f"{listed}\n({_NO_RECAPTURE})",
            )
        return bool(by_optimizer)


_NO_RECAPTURE = "no re-capture will be needed when its hyperparameters change again"


def _scheduled_keys(opt: torch.optim.Optimizer) -> list[str]:
    """The keys a torch LR scheduler attached to `opt` will change (see `choose_before_capture`)."""
    group = opt.param_groups[0] if opt.param_groups else {}
    keys = ["lr"] if "initial_lr" in group else []
    if "base_momentum" in group:  # OneCycleLR / CyclicLR with cycle_momentum=True
        keys.append("momentum" if "momentum" in group else "betas[0]")
    return keys
