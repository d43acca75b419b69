"""Hugging Face: a `transformers.Trainer` whose training step runs captured, and a plain `accelerate` loop.

    from graphstep.integrations.huggingface import GraphStepTrainer
    trainer = GraphStepTrainer(model=model, args=TrainingArguments(...), train_dataset=data)
    trainer.train()

**`GraphStepTrainer`** is a `transformers.Trainer` whose `training_step` (one micro-batch: forward, loss
normalised for gradient accumulation, `accelerator.backward`) runs as a captured step. Everything the
Trainer does around it is left as the Trainer does it, eagerly: gradient accumulation over
`gradient_accumulation_steps` micro-batches, `max_grad_norm` clipping, `optimizer.step()`, the scheduler,
`model.zero_grad()`, logging of the returned loss, evaluation. So one optimizer update is one or more
graph replays (forward and backward, the bulk of the kernels) plus an eager optimizer step: a fused
optimizer (transformers' default `adamw_torch_fused`) keeps that short. The Trainer runs the optimizer
step in its own loop, outside `training_step`; capturing it too would mean copying that loop.

To make the gradients the graph accumulates into live across calls, the Trainer's `model.zero_grad()`
zeroes them in place (`set_to_none=False`) instead of dropping them; the numbers are the same.
What the step's Python reads and a graph would bake is made part of its key: the number of
micro-batches in this update (smaller at the end of an epoch) and whether gradients are synchronised
(the last micro-batch under DDP), so each combination gets its own graph. The inputs are moved to the
device before the captured call, so a replay copies device tensors, never pageable host memory.

transformers computes differently while a stream captures (`is_tracing()`: a model given no
`attention_mask` builds one explicitly, and host checks are skipped). graphstep's warm-ups take that
path too (`graphstep.backends.libraries`), so every call computes as the replays do, and a compiled
model compiles it before the capture. With an `attention_mask` in the inputs both paths agree and
the run is bitwise equal to a plain `Trainer` (tested on an H100, with gradient accumulation).

**`capture_accelerated(accelerator, fn, ...)`** captures the step of a plain `accelerate` loop: it passes
the optimizers inside accelerate's `AcceleratedOptimizer` wrappers to `graphstep.capture`, where
graphstep can prepare them (capturable, lr as a device tensor). Write the step as usual, with
`accelerator.backward(loss)`, `accelerator.clip_grad_norm_(...)`, `optimizer.step()`,
`optimizer.zero_grad()`, and gradient accumulation as accelerate documents it: one micro-batch per
call, inside `with accelerator.accumulate(model):`.

accelerate decides on the host, from its own counter, whether a call only accumulates or also syncs
and steps (`Accelerator._do_sync`, run when `accumulate()` is entered); a graph would bake one
decision. So capture_accelerated runs accelerate's own `_do_sync` eagerly before every call (warm-up,
capture and replay alike), lets the `accumulate()` inside the step leave it be, and makes the decision
(`sync_gradients`, with the number of accumulation steps that `accelerator.backward` divides by) part
of the graph's key: one graph per phase, and every call is exactly one eager step, its optimizer
step, `zero_grad` and DDP's `no_sync` included. The first call finds out whether the step enters
`accumulate()` (once per call at most). A plain `graphstep.capture` around such a step is refused at
capture, naming `accelerator.accumulate` (accelerate's counter is a Python write a replay would not
repeat).

Under fp16 (GradScaler, an optimizer that is not fused), `optimizer.step_was_skipped` (which a prepared
scheduler reads to skip its step too) is set after every call that a graph ran, from whether the
scaler backed off: the step was skipped exactly then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..capture import CapturedStep, capture
from ..config import Config
from ..diagnostics import StepStats
from ..errors import GraphStepError

__all__ = ["GraphStepTrainer", "capture_accelerated"]  # noqa: F822 (GraphStepTrainer: module __getattr__)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "graphstep.integrations.huggingface needs transformers: pip install 'graphstep[huggingface]'."
        ) from exc
    return transformers


class _GraphStepTrainerMixin:
    """The behaviour of `GraphStepTrainer`; put on `transformers.Trainer` by `__getattr__` below."""

    graphstep_config: Config | None = None
    """The `graphstep.Config` of the captured step (None: the default)."""

    def __init__(self, *args: Any, graphstep_config: Config | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.graphstep_config = graphstep_config
        self.graphstep_step: CapturedStep | None = None
        """The captured `training_step`, made on the first call; closed when `train` returns."""
        self.graphstep_stats: StepStats | None = None
        """The captured step's counters (warm-ups, captures, replays), kept when `train` returns."""
        self._graphstep_model: torch.nn.Module | None = None

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if self.graphstep_step is None or model is not self._graphstep_model:
            if self.graphstep_step is not None:  # the Trainer wrapped the model anew (a second train())
                self.graphstep_step.close()
            self.graphstep_step, self._graphstep_model = self._make_graphstep(model), model
        _keep_grads(model)
        model.train()  # training_step does it first; done here, the mode a replay checks is right
        inputs = self._prepare_inputs(inputs)
        # Python values the step reads: part of the key, so that each value gets its own graph.
        micro_batches = self.current_gradient_accumulation_steps
        sync = bool(self.accelerator.sync_gradients)
        return self.graphstep_step(inputs, num_items_in_batch, micro_batches, sync)

    def _make_graphstep(self, model: torch.nn.Module) -> CapturedStep:
        parent = super()

        def training_step(
            inputs: dict[str, Any], num_items: Any, micro_batches: int, sync: bool
        ) -> torch.Tensor:
            self.current_gradient_accumulation_steps = micro_batches
            return parent.training_step(model, inputs, num_items)

        training_step.__qualname__ = f"{type(self).__name__}.training_step"
        return capture(training_step, model=model, config=self.graphstep_config)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.graphstep_step is not None:
                self.graphstep_stats = self.graphstep_step.stats
                self.graphstep_step.close()
                self.graphstep_step = None


def _keep_grads(model: torch.nn.Module) -> None:
    """Make `model.zero_grad()` zero gradients in place: the graph accumulates into the same tensors."""
    if "zero_grad" not in model.__dict__:
        model.zero_grad = functools.partial(type(model).zero_grad, model, set_to_none=False)


def capture_accelerated(
    accelerator: Any,
    fn: Callable | None = None,
    *,
    model: torch.nn.Module | list[torch.nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    config: Config | None = None,
) -> Any:
    """`graphstep.capture` for a step of a plain `accelerate` loop (see the module's docstring).

    `model` and `optimizer` as `accelerator.prepare` returned them; the optimizers inside accelerate's
    wrappers are what graphstep prepares and guards. Usable as a decorator:
    `@capture_accelerated(accelerator, model=model, optimizer=opt)`.
    """
    if fn is None:
        return functools.partial(
            capture_accelerated, accelerator, model=model, optimizer=optimizer, config=config
        )
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer else []
    inner = [getattr(o, "optimizer", o) for o in optimizers]  # AcceleratedOptimizer.optimizer
    modules = model if isinstance(model, (list, tuple)) else [model] if model is not None else None
    accumulation = _Accumulation(accelerator, optimizers)

    # graphstep looks for optimizers in the step's closure and would find accelerate's wrapper, which
    # it cannot prepare (it skips Optimizer.__init__). Called through this function, the step's own
    # closure is not searched: the optimizers inside the wrappers are given explicitly instead.
    @functools.wraps(fn)
    def step(*args: Any, _graphstep_accumulation: tuple = (), **kwargs: Any) -> Any:
        return accumulation.run(fn, args, kwargs)

    del step.__wrapped__  # keep graphstep's closure search on `step` itself
    captured = _AcceleratedStep(step, model=modules, optimizer=inner or None, config=config)
    captured._accumulation = accumulation
    return captured


class _Accumulation:
    """accelerate's gradient-accumulation decision for one captured step, made before each call.

    `Accelerator._do_sync` advances accelerate's counter and sets `sync_gradients` when the step enters
    `accelerator.accumulate()`. Here it runs eagerly before the call instead, and the step's own
    `accumulate()` finds `in_step` in its place, which leaves the decision as it is."""

    def __init__(self, accelerator: Any, optimizers: list) -> None:
        self.accelerator = accelerator
        self.scaled = [
            o
            for o in optimizers
            if getattr(o, "scaler", None) is not None
            and not getattr(o.optimizer, "_step_supports_amp_scaling", False)
        ]
        """AcceleratedOptimizers whose GradScaler skips a step on the host (fp16, not fused): what
        `step_was_skipped` says is redone after a call whose Python did not run it."""
        self.uses: bool | None = None
        """Whether the step enters `accumulate()`: found by its first call."""
        self.entered = 0
        """`accumulate()` entries in the step's Python now running."""

    def before_call(self) -> tuple[bool, int]:
        """Advance accelerate's decision for this call (if the step accumulates) and return it: the
        phase that is part of the graph's key."""
        acc = self.accelerator
        state = acc.gradient_state
        if self.uses:
            type(acc)._do_sync(acc)
        elif self.uses is None:  # the first call runs accelerate's own `_do_sync` inside: foresee it
            before = acc.step, state.sync_gradients
            type(acc)._do_sync(acc)
            phase = bool(state.sync_gradients), state.num_steps
            acc.step, state.sync_gradients = before
            return phase
        return bool(state.sync_gradients), state.num_steps

    def in_step(self) -> None:
        """`accelerator._do_sync` while a call runs: the decision was made before the call."""
        self.entered += 1
        if self.uses is None and self.entered == 1:
            acc = self.accelerator
            type(acc)._do_sync(acc)  # the first call: eager, as accelerate does it

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the step's Python once (a warm-up or a capture), checking it entered `accumulate()`
        as its first call did."""
        self.entered = 0
        result = fn(*args, **kwargs)
        if self.entered > 1:
            raise GraphStepError(
                f"{_name(fn)} entered accelerator.accumulate() {self.entered} times in one call; "
                "capture_accelerated supports one accumulate() per call of the step (one micro-batch "
                "per call, as accelerate's examples write it): call the step once per micro-batch."
            )
        uses = self.entered == 1
        if self.uses is None:
            self.uses = uses
        elif uses != self.uses:
            raise GraphStepError(
                f"{_name(fn)} {'entered' if uses else 'did not enter'} accelerator.accumulate() in this "
                f"call, but {'did' if self.uses else 'did not'} in its first call; capture_accelerated "
                "advances accelerate's accumulation counter before every call, so the step must enter "
                "accumulate() on every call or on none."
            )
        return result


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


class _AcceleratedStep(CapturedStep):
    """A `CapturedStep` whose calls carry accelerate's accumulation phase in their key."""

    _accumulation: _Accumulation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        accumulation = self._accumulation
        phase = accumulation.before_call()
        accelerator = accumulation.accelerator
        accelerator._do_sync = accumulation.in_step  # what accumulate() calls while the step runs
        scales = [o.scaler._scale.clone() for o in accumulation.scaled if o.scaler._scale is not None]
        ran = self._stats.replays + self._stats.captures
        try:
            result = super().__call__(*args, _graphstep_accumulation=phase, **kwargs)
        finally:
            del accelerator._do_sync
        if (
            phase[0]
            and len(scales) == len(accumulation.scaled)
            and self._stats.replays + self._stats.captures > ran
        ):
            # A graph ran the step: accelerate's Python that tells a skipped step (its patched
            # `optimizer.step` not called: inf gradients) did not, or saw the step deferred to a
            # segment. GradScaler backs its scale off exactly when it skipped.
            for o, before in zip(accumulation.scaled, scales):
                o._is_overflow = bool(o.scaler._scale < before)
                o._accelerate_step_called = False
        return result


_classes: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "GraphStepTrainer":
        if name not in _classes:
            _classes[name] = type(
                "GraphStepTrainer",
                (_GraphStepTrainerMixin, _transformers().Trainer),
                {"__doc__": __doc__, "__module__": __name__},
            )
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
