"""PyTorch Lightning: run a LightningModule's whole training step captured, with a callback.

    from graphstep.integrations.lightning import GraphStepCallback
    trainer = Trainer(callbacks=[GraphStepCallback()], max_steps=1000)
    trainer.fit(module, loader)

Lightning drives a step differently in its two modes, and the callback captures what each calls:

- **Automatic optimization.** Lightning calls `module.optimizer_step(..., closure)`, the optimizer
  calls the closure (`training_step`, `zero_grad`, `backward` with the precision plugin's scaling and
  the backward hooks), then gradient clipping and `optimizer.step()` run. The callback replaces the
  module's `optimizer_step` (on the instance, for the duration of `fit`) by a captured step that runs
  all of that: one graph per step. Lightning's closure is made anew for every batch; the captured
  step feeds it the batch graphstep passes in (the graph's static input buffers at capture) and, after
  a replay, hands the closure the replay's outputs, so `training_step`'s returned loss reaches
  `on_train_batch_end` as usual. Schedulers from `configure_optimizers` are stepped by Lightning
  between calls, as without graphstep. An optimizer whose step runs as an eager segment (SGD with a
  schedule, a OneCycleLR that cycles AdamW's betas, Adagrad on a GPU) gets Lightning's closure too: the
  closure runs in the graph and the update between replays (see `backends/segments.py`).
- **Gradient accumulation** (`accumulate_grad_batches > 1`, automatic optimization). On a micro-batch
  that only accumulates, Lightning calls its closure itself (training_step, backward, no step): the
  callback routes that call through the same captured step. What Lightning decides in Python before
  the call (accumulate or step; `zero_grad` first, on the first micro-batch of a window) is a static
  argument of the captured step, so each kind of micro-batch gets its own graph: two for
  `accumulate_grad_batches=2`, three from 3 on. The gradients one graph leaves are the ones the next
  accumulates into.
- **Manual optimization.** Lightning calls `training_step` directly; it calls `manual_backward` and
  `optimizer.step()` itself. The callback replaces `training_step` by a captured one and, after a
  replay, advances Lightning's optimizer-step counter (`trainer.global_step`) by the steps the
  captured code took. Step schedulers outside `training_step` (in `on_train_batch_end`): a
  `scheduler.step()` inside would run only at capture, so the callback raises there instead.

Logging: `self.log(...)` / `self.log_dict(...)` inside the step are Python side effects that a replay
would not repeat. The callback records each call while the step's code runs (warm-up, capture), makes
the logged tensors outputs of the captured step, and calls Lightning's real `self.log` after every
call with that call's values. A Python number or a torchmetrics object logged inside the step is
logged as it was when the step's code last ran.

`batch_idx` reaches `training_step` as a 0-d integer tensor on the module's device: a replay sees the
current index in arithmetic, and a Python `if batch_idx ...` synchronises with the host, which
graphstep reports instead of replaying one branch forever.

What does not work (each raises a `GraphStepError` saying so, unless noted): hooks with Python side
effects inside the step (`on_before_backward`, `on_after_backward`, `on_before_optimizer_step`, an overridden
`optimizer_step`) run only while the step's code runs, not on replays (not detected); strategies that
wrap the module (DDP, FSDP) on CUDA, since Lightning builds DDP on the default stream (graphstep's
`CaptureError` says so; the eager backend works). 16-bit precision with a non-fused optimizer works:
its GradScaler's inf check and the update run as an eager segment (backends/library_segments.py).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ..capture import CapturedStep, capture
from ..config import Config
from ..diagnostics import StepStats
from ..errors import GraphStepError

__all__ = ["GraphStepCallback", "callback_class"]  # noqa: F822 (GraphStepCallback: module __getattr__)

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _lightning(package: str | None = None) -> types.ModuleType:
    """The Lightning package to build on: `package`, else one already imported, else the first found."""
    names = [package] if package else [p for p in _PACKAGES if p in sys.modules] + list(_PACKAGES)
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "graphstep.integrations.lightning needs PyTorch Lightning: pip install 'graphstep[lightning]' "
        "(pytorch-lightning) or pip install lightning."
    )


class _Logged:
    """`self.log` calls made while the step's code ran: tensors become outputs, the rest is kept."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls: dict[str, tuple[Any, tuple, dict, str | None]] = {}

    def record(self, module: Any) -> Callable[..., None]:
        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(value, torch.Tensor):
                self.tensors[name] = value
            self.calls[name] = (value, args, kwargs, module._current_fx_name)

        return log

    def replay(self, module: Any, real_log: Callable[..., None], tensors: dict[str, torch.Tensor]) -> None:
        """Call Lightning's `log` for every recorded call, with this call's tensor values."""
        before = module._current_fx_name
        try:
            for name, (value, args, kwargs, fx) in self.calls.items():
                module._current_fx_name = fx  # as when the step logged it (Lightning checks the hook)
                real_log(name, tensors.get(name, value), *args, **kwargs)
        finally:
            module._current_fx_name = before


class _GraphStepLogic:
    """The callback's behaviour; `callback_class` puts it on the Lightning package's `Callback`."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config
        self.step: CapturedStep | None = None
        """The captured step while `fit` trains; None before and after."""
        self.stats: StepStats | None = None
        """The step's counters (warm-ups, captures, replays), kept when `fit` ends."""
        self._module: Any = None
        self._batch: Any = None
        self._batch_idx: torch.Tensor | None = None
        self._automatic_call: tuple | None = None
        self._output: Any = None
        self._logged = _Logged()
        self._ran = False
        self._optimizer_steps = 0

    # -- Lightning hooks ---------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._module = pl_module
        self._training_step = pl_module.training_step
        optimizers = list(trainer.optimizers)
        if pl_module.automatic_optimization:
            self._optimizer_step = pl_module.optimizer_step
            pl_module.optimizer_step = self._automatic_optimizer_step
            loop = trainer.fit_loop.epoch_loop.automatic_optimization
            loop._make_closure = self._routing_closures(loop._make_closure)
            fn = self._run_automatic
        else:
            fn = self._run_manual
        pl_module.training_step = self._captured_training_step

        def training_step(
            batch: Any, batch_idx: torch.Tensor, kind: tuple = ()
        ) -> tuple[Any, dict[str, torch.Tensor]]:
            return fn(batch, batch_idx, kind)

        training_step.__qualname__ = f"{type(pl_module).__name__}.training_step"  # how graphstep names it
        self.step = capture(training_step, model=pl_module, optimizer=optimizers, config=self.config)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        if self._batch_idx is None or self._batch_idx.device != pl_module.device:
            self._batch_idx = torch.zeros((), dtype=torch.int64, device=pl_module.device)
        self._batch_idx.fill_(batch_idx)  # on the device, no host sync

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore(pl_module)

    def _restore(self, pl_module: Any) -> None:
        for name in ("training_step", "optimizer_step"):
            pl_module.__dict__.pop(name, None)  # back to the class's method
        trainer = getattr(pl_module, "_trainer", None)
        if trainer is not None:
            trainer.fit_loop.epoch_loop.automatic_optimization.__dict__.pop("_make_closure", None)
        if self.step is not None:
            self.stats = self.step.stats
            self.step.close()
            self.step = None

    # -- automatic optimization ----------------------------------------------------------------------

    def _automatic_optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> None:
        self._automatic_call = (epoch, batch_idx, optimizer, closure)
        try:
            output, logged = self._call_step(("step", *_closure_kind(closure)))
        finally:
            self._automatic_call = None
        self._hand_back(closure, output, logged)

    def _accumulate(self, closure: Any) -> Any:
        """Lightning called its closure itself: a micro-batch that only accumulates gradients."""
        self._automatic_call = (None, None, None, closure)
        try:
            output, logged = self._call_step(("accumulate", *_closure_kind(closure)))
        finally:
            self._automatic_call = None
        self._hand_back(closure, output, logged)
        return closure._result.loss

    def _hand_back(self, closure: Any, output: Any, logged: dict[str, torch.Tensor]) -> None:
        # The closure consumed after this hook must hold this call's loss, also after a replay (when
        # the closure never ran) and after a capture (when it holds the capture's own tensors).
        result_cls = sys.modules[type(closure).__module__].ClosureResult
        closure._result = result_cls.from_training_step_output(
            output, self._trainer().accumulate_grad_batches
        )
        if not self._ran and _closure_kind(closure)[0]:
            # A replay zeroed the grads on the device; Lightning counts zero_grad in the closure's
            # Python (ready, started, completed), which ran at capture only: count this one too.
            loop = self._trainer().fit_loop.epoch_loop.automatic_optimization
            zero_grad = loop.optim_progress.optimizer.zero_grad
            zero_grad.increment_ready()
            zero_grad.increment_started()
            zero_grad.increment_completed()
        self._log(logged)

    def _run_automatic(
        self, batch: Any, batch_idx: torch.Tensor, kind: tuple
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """The captured step: Lightning's optimizer_step with this batch (closure, clip, step), or
        for a micro-batch that only accumulates, Lightning's closure (training_step, backward)."""
        epoch, idx, optimizer, closure = self._automatic_call
        with self._running(batch, batch_idx):
            if kind[0] == "accumulate":
                closure()
            else:
                self._optimizer_step(epoch, idx, optimizer, closure)
            return self._output, dict(self._logged.tensors)

    def _routing_closures(self, make_closure: Callable) -> Callable:
        """Wrap Lightning's `_make_closure`: a closure Lightning calls itself (to accumulate
        gradients without a step) runs as a captured step too."""
        logic = self

        def make(*args: Any, **kwargs: Any) -> Any:
            closure = make_closure(*args, **kwargs)
            closure.__class__ = _routed_closure_class(type(closure))
            closure._graphstep = logic
            return closure

        return make

    # -- manual optimization ---------------------------------------------------------------------------

    def _run_manual(
        self, batch: Any, batch_idx: torch.Tensor, kind: tuple
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        progress = self._step_progress()
        before = progress.total.completed
        with self._running(batch, batch_idx), self._no_scheduler_steps():
            self._output = self._training_step(batch, batch_idx)
            self._optimizer_steps = progress.total.completed - before
            return self._output, dict(self._logged.tensors)

    def _step_progress(self) -> Any:
        return self._trainer().fit_loop.epoch_loop.manual_optimization.optim_step_progress

    # -- both ----------------------------------------------------------------------------------------

    def _captured_training_step(self, batch: Any, batch_idx: Any, *args: Any, **kwargs: Any) -> Any:
        if self._ran is None:  # automatic: Lightning's closure, inside the captured optimizer_step
            self._output = self._training_step(self._batch_arg, self._batch_idx_arg, *args, **kwargs)
            return self._output
        if self._module.automatic_optimization:  # a training_step outside optimizer_step: eager
            return self._training_step(batch, batch_idx, *args, **kwargs)
        progress = self._step_progress()
        output, logged = self._call_step(())
        if not self._ran:  # a replay: the optimizer steps happened on the device, not in Python
            progress.increment_ready()  # Lightning counts optimizer steps (trainer.global_step)
            for _ in range(self._optimizer_steps):
                progress.increment_completed()
        self._log(logged)
        return output

    def _call_step(self, kind: tuple) -> tuple[Any, dict[str, torch.Tensor]]:
        """`kind` (a static argument: one graph per value): what Lightning asks of this batch in
        automatic optimization: ("step" or "accumulate", zero_grad first, backward)."""
        self._ran = False
        return self.step(self._batch, self._batch_idx, kind)

    def _running(self, batch: Any, batch_idx: torch.Tensor) -> Any:
        logic = self

        class Running:
            def __enter__(self) -> None:
                logic._ran = None  # None while the step's code runs: training_step uses these arguments
                logic._batch_arg, logic._batch_idx_arg = batch, batch_idx
                logic._logged = _Logged()
                logic._module.log = logic._logged.record(logic._module)

            def __exit__(self, *exc: object) -> None:
                logic._module.__dict__.pop("log", None)
                logic._batch_arg = logic._batch_idx_arg = None
                logic._ran = True

        return Running()

    def _no_scheduler_steps(self) -> Any:
        schedulers = [config.scheduler for config in self._trainer().lr_scheduler_configs]

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise GraphStepError(
                "GraphStepCallback: lr_scheduler.step() inside a captured training_step would run only "
                "when the step's code runs (warm-up, capture), never on replays. Step the scheduler in "
                "on_train_batch_end instead (manual optimization)."
            )

        class NoSchedulerSteps:
            def __enter__(self) -> None:
                for scheduler in schedulers:
                    scheduler.step = refuse

            def __exit__(self, *exc: object) -> None:
                for scheduler in schedulers:
                    scheduler.__dict__.pop("step", None)

        return NoSchedulerSteps()

    def _log(self, logged: dict[str, torch.Tensor]) -> None:
        self._logged.replay(self._module, self._module.log, logged)

    def _trainer(self) -> Any:
        return self._module.trainer


def _closure_kind(closure: Any) -> tuple[bool, bool]:
    """What Lightning's closure does besides training_step (Python decides it outside the step)."""
    return getattr(closure, "_zero_grad_fn", None) is not None, getattr(
        closure, "_backward_fn", None
    ) is not None


_routed: dict[type, type] = {}


def _routed_closure_class(base: type) -> type:
    """`base` (Lightning's `Closure`), whose direct call goes through the callback's captured step
    unless the captured step's own code is running (then it is the optimizer calling it)."""
    if base not in _routed:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            logic = self.__dict__.get("_graphstep")
            if logic is None or logic._ran is None or logic.step is None:
                return base.__call__(self, *args, **kwargs)
            return logic._accumulate(self)

        # Same module as `base`: the callback finds `ClosureResult` beside the closure's class.
        _routed[base] = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return _routed[base]


_classes: dict[str, type] = {}


def callback_class(package: str | None = None) -> type:
    """`GraphStepCallback` built on `package`'s `Callback` ("lightning.pytorch" or "pytorch_lightning";
    default: the one already imported, else the first installed)."""
    pl = _lightning(package)
    if pl.__name__ not in _classes:
        _classes[pl.__name__] = type(
            "GraphStepCallback",
            (_GraphStepLogic, pl.Callback),
            {"__doc__": __doc__, "__module__": __name__},
        )
    return _classes[pl.__name__]


def __getattr__(name: str) -> Any:
    if name == "GraphStepCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
