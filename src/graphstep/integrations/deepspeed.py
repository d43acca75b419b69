"""DeepSpeed: a ZeRO-1/2 engine's training step captured, `engine(x)`, `engine.backward(loss)`, `engine.step()`.

    import graphstep.integrations.deepspeed as gs_deepspeed
    engine, optimizer, _, scheduler = gs_deepspeed.initialize(model=model, config=ds_config, ...)

    def train_step(x, y):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    step = gs_deepspeed.capture_engine_step(engine, train_step)
    for x, y in loader:
        loss = step(x, y)

What runs where. The forward, the backward (ZeRO's gradient hooks: bucketing, the reduction or
reduce-scatter into each rank's partition, DeepSpeed's scaling of the loss for accumulation and by
the loss scale) is captured. `engine.step()` runs as an eager segment after it, on every call
(replays included): ZeRO's overflow check and gradient norm (both read on the host), the dynamic loss
scaler's update, clipping, the torch optimizer's update, the all-gather of the updated partitions,
DeepSpeed's lr scheduler, and DeepSpeed's counters (`global_steps`, `micro_steps`, `skipped_steps`,
`global_samples`): all of it exactly as eager DeepSpeed runs it, so those Python values are DeepSpeed's
own. A micro-batch that only accumulates (`gradient_accumulation_steps > 1`) runs `engine.step()`'s
counting too, with no host read.

What a graph would bake, and how each stays right:

- **The accumulation boundary.** DeepSpeed decides from its counter (`micro_steps`) whether this
  micro-batch ends an accumulation window, and ZeRO's backward whether it is the first of one. The
  position in the window (`micro_steps % gradient_accumulation_steps`) and the window's length (the
  backward divides the loss by it) are part of the graph's key: one graph per position, read before
  every call.
- **The loss scale** (fp16's dynamic scaler): the backward multiplies the loss by the scaler's Python
  float. While the step's Python runs, that product reads a device tensor instead, filled from the
  scaler before every call: a scale the segment halved or doubled reaches the next replay.
- **What ZeRO's backward hands its step in Python** (the averaged gradients' lists, the micro-step
  id, flags): a replay runs no Python, so the segment puts back what the captured backward left, the
  tensors it names being the graph's own, before `engine.step()` runs.
- **The throughput timer** DeepSpeed starts in the forward: started eagerly before every call
  (its stop is in the step's segment).

Refused when the engine is handed over (`UnsupportedEngineError`, with DeepSpeed's name for it and what
to set): ZeRO stage 3 and stage 0, DeepSpeed's pipeline engine, CPU offload,
`wall_clock_breakdown`, the flops profiler, `managed_gradient_accumulation: false`, a custom or torch
autocast loss scaler. On a GPU the engine must be built on graphstep's capture stream: `initialize` here
does that (ZeRO's gradient hooks and accumulators are made at initialize, and autograd runs them on that
stream); ZeRO's `overlap_comm` waits for its reduction stream on the host inside the backward and is
refused on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..backends import segments
from ..backends.cuda import capture_stream
from ..capture import CapturedStep
from ..config import Config
from ..diagnostics import expected_host_reads
from ..errors import CaptureError
from ..guards import unchanging
from .deepspeed_handover import Handover, places

__all__ = ["ReadAfterStepError", "UnsupportedEngineError", "capture_engine_step", "initialize"]


class UnsupportedEngineError(CaptureError):
    """A DeepSpeed engine whose step graphstep cannot capture: what it is, in DeepSpeed's words, and
    what to set instead. Nothing was run."""


class ReadAfterStepError(CaptureError):
    """The step reads what `engine.step()` made (`engine.get_global_grad_norm()`, ...) after calling it:
    a replay would see the capture's value."""


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "graphstep.integrations.deepspeed needs DeepSpeed: pip install 'graphstep[deepspeed]'."
        ) from exc
    return deepspeed


def initialize(*args: Any, **kwargs: Any) -> Any:
    """`deepspeed.initialize(...)`, on graphstep's capture stream when CUDA is there.

    ZeRO registers its gradient hooks and accumulators at initialize; autograd runs them on the stream
    they were made on, and a backward captured on graphstep's stream cannot wait on the default one
    (as DDP, which is built the same way: see `graphstep.capture_stream`)."""
    deepspeed = _deepspeed()
    if not torch.cuda.is_available():
        return deepspeed.initialize(*args, **kwargs)
    with torch.cuda.stream(capture_stream()):
        return deepspeed.initialize(*args, **kwargs)


def capture_engine_step(engine: Any, fn: Callable | None = None, *, config: Config | None = None) -> Any:
    """`graphstep.capture` for a step that trains DeepSpeed engine `engine` (see the module's docstring).

    `fn` calls `engine(...)`, `engine.backward(loss)` and `engine.step()` once each, as DeepSpeed's
    examples write a step; one call is one micro-batch. Usable as a decorator:
    `@capture_engine_step(engine)`. Raises `UnsupportedEngineError` for what it cannot capture."""
    if fn is None:
        return functools.partial(capture_engine_step, engine, config=config)
    driver = _Driver(engine)

    # Called through this function, graphstep's search for state looks at `step`'s closure (the
    # driver), not `fn`'s: the engine's ZeRO optimizer and the torch optimizer inside it are
    # DeepSpeed's to step, in the segment, and graphstep must not prepare them.
    @functools.wraps(fn)
    def step(*args: Any, _graphstep_deepspeed: tuple = (), **kwargs: Any) -> Any:
        return driver.run(fn, args, kwargs)

    del step.__wrapped__
    # The engine's Python values the captured part reads are its counters (the accumulation position,
    # in the key) and its configuration; its counters change on every call, in the step's segment.
    # Compared by identity only: a guard on its contents would re-capture on every call.
    unchanging(engine)
    captured = _EngineStep(step, model=engine.module, config=config)
    captured._driver = driver
    return captured


class _EngineStep(CapturedStep):
    """A `CapturedStep` whose calls carry the engine's accumulation position in their key."""

    _driver: _Driver

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        driver, stats = self._driver, self._stats
        key = driver.before_call()
        position = key[0], key[2]  # (position in the window, the window's length)
        generation = driver.window.generation_for(position)
        before = (stats.replays, stats.captures, stats.variant_switches, stats.variants)
        with driver.calling():
            result = super().__call__(*args, _graphstep_deepspeed=(*key, generation), **kwargs)
        replayed = stats.replays > before[0] and stats.variant_switches == before[2]
        captured = stats.captures > before[1]
        driver.window.ran(
            position, graph=captured or (replayed and stats.variants == before[3]), captured=captured
        )
        return result


class _Window:
    """Which graph of an accumulation window each position's graph was captured after.

    ZeRO's backward keeps the window's gradients in buffers its Python makes (the bucket, the
    partition of averaged gradients), and hands them from one micro-batch to the next in Python.
    A graph captured for position `p` reads the tensors of what ran for `p - 1` when it was
    captured: that graph's, or an eager run's. When `p - 1` has run anything else since (an eager
    call, a graph captured again, another variant), `p`'s graph would read stale buffers: its
    generation, part of the key, moves on, and `p` warms up and is captured again."""

    def __init__(self) -> None:
        self.generation: dict[tuple[int, int], int] = {}
        self.source: dict[tuple[int, int], Any] = {}
        """Per position: what ran for it last: (generation, captures there) of a graph, or a fresh
        object for an eager run."""
        self.after: dict[tuple[int, int], Any] = {}
        """Per position with a graph in its generation: the source of `p - 1` it was captured after."""
        self.captures: dict[tuple[int, int], int] = {}

    def generation_for(self, position: tuple[int, int]) -> int:
        if position in self.after and self.after[position] != self.source.get(_previous(position)):
            self.generation[position] = self.generation.get(position, 0) + 1
            del self.after[position]
        return self.generation.get(position, 0)

    def ran(self, position: tuple[int, int], *, graph: bool, captured: bool) -> None:
        if captured:
            self.captures[position] = self.captures.get(position, 0) + 1
            self.after[position] = self.source.get(_previous(position))
        if graph:
            self.source[position] = (self.generation.get(position, 0), self.captures.get(position, 0))
        else:
            self.source[position] = object()


def _previous(position: tuple[int, int]) -> tuple[int, int] | None:
    index, steps = position
    return (index - 1, steps) if index else None


class _Driver:
    """What one captured engine step does around DeepSpeed's Python: the key, the live loss scale,
    the timer, and `engine.step()` as a segment."""

    def __init__(self, engine: Any) -> None:
        _check_supported(engine)
        self.engine = engine
        self.zero = engine.optimizer
        self.scaler = getattr(self.zero, "loss_scaler", None)
        device = next(engine.module.parameters()).device
        self.scale = torch.ones((), dtype=torch.float64, device=device)
        """The loss scale the captured backward multiplies by: the scaler's float, filled before every call."""
        self.window = _Window()
        self.stepped = False
        """While the step's Python runs: it called `engine.step()` already."""
        self.before: tuple[dict[tuple, tuple], set[int]] = ({}, set())
        """While the step's Python runs: DeepSpeed's Python state at its start (`deepspeed_handover.places`)."""

    def before_call(self) -> tuple:
        """DeepSpeed's Python decisions for this call, as the graph's key; the loss scale and the timer."""
        engine = self.engine
        if self.scaler is not None:
            self.scale.fill_(float(self.scaler.loss_scale))
        if engine.training_dataloader is None:  # as the engine's forward does (its own start is off)
            engine.tput_timer.start()
        steps = engine.gradient_accumulation_steps()  # the backward divides the loss by it: a key too
        return engine.micro_steps % steps, engine._is_gradient_accumulation_boundary, steps

    @contextlib.contextmanager
    def calling(self) -> Any:
        """While graphstep runs the call: `engine.step` routed through `_step`, the loss scaled by the
        device tensor, the forward's timer start left to `before_call`."""
        engine, scaler, timer = self.engine, self.scaler, self.engine.tput_timer
        engine.__dict__["step"] = self._step  # not Module.__setattr__: no module bookkeeping
        for name in _READ_BY_STEP:
            engine.__dict__[name] = functools.partial(self._read, name)
        timer.start = _nothing
        if scaler is not None:
            scaler.scale_loss = self._scale_loss
        try:
            yield
        finally:
            for name in ("step", *_READ_BY_STEP):
                engine.__dict__.pop(name, None)
            timer.__dict__.pop("start", None)
            if scaler is not None:
                scaler.__dict__.pop("scale_loss", None)

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """The step's Python (a warm-up or a capture)."""
        self.before = places(self._handed_over())
        self.stepped = False
        try:
            return fn(*args, **kwargs)
        finally:
            self.before = ({}, set())
            self.stepped = False

    def _read(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`engine.<name>()` while graphstep runs a call: what `engine.step()` made, asked for after it
        inside the step, would be the capture's on every replay (the step runs in a segment, and what
        the step's Python does with its result after it is captured once)."""
        if self.stepped:
            raise ReadAfterStepError(
                f"engine.{name}() after engine.step() inside a captured step: engine.step() runs as an eager "
                "segment on every replay, but what the step does after it with Python values runs at "
                f"capture only, so every replay would see the capture's. Call engine.{name}() after the "
                "captured call returns."
            )
        return getattr(type(self.engine), name)(self.engine, *args, **kwargs)

    def _handed_over(self) -> tuple:
        return self.engine, self.zero

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # Bitwise as DeepSpeed's `loss * cur_scale`: the Python float becomes the loss's math type
        # (float32 for 16- and 32-bit losses, float64 for a double loss), the product is rounded to
        # the loss's dtype; the scale is kept in float64 as the float it copies.
        if loss.dtype == torch.float64:
            return loss * self.scale
        return (loss.float() * self.scale.float()).to(loss.dtype)

    def _step(self, lr_kwargs: Any = None) -> None:
        """`engine.step()` inside the step's Python: an eager segment."""
        real = _expected_reads(type(self.engine).step)  # its host reads are the segment's, not the step's
        args = (self.engine, lr_kwargs)
        if isinstance(segments.active(), segments.Capture):
            handover = Handover(self._handed_over(), self.before)
            handover.roll_back()  # what the captured backward wrote: each replay's segment sets it again
            handover.redone()
            segments.run(handover.step, (real, *args), {}, "DeepSpeedEngine.step", returns_none=True)
        else:
            segments.run(real, args, {}, "DeepSpeedEngine.step", returns_none=True)
        self.stepped = True


_READ_BY_STEP = ("get_global_grad_norm", "was_step_applied", "get_lr", "get_mom")
"""The engine's readers of what `engine.step()` sets (its last norm, whether it stepped, the schedule's
values): refused after `engine.step()` inside the step."""


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _expected_reads(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def segment(*args: Any, **kwargs: Any) -> Any:
        with expected_host_reads():
            return fn(*args, **kwargs)

    return segment


# -- what is refused -----------------------------------------------------------------------------------


def _check_supported(engine: Any) -> None:
    deepspeed = _deepspeed()
    name = type(engine).__name__
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise UnsupportedEngineError(
            f"capture_engine_step takes the engine deepspeed.initialize returned, not a {name}."
        )
    refusals = []
    stage = engine.zero_optimization_stage()
    if stage == 3:
        refusals.append(
            "ZeRO stage 3 (`zero_optimization.stage: 3`): its parameters are gathered and released "
            "by hooks around every module, with Python bookkeeping (the prefetch coordinator's trace, "
            "each parameter's `ds_status`) that changes during the step and a replay would not redo. "
            "Use stage 1 or 2, or run the stage-3 engine without graphstep"
        )
    elif stage == 0:
        refusals.append(
            "ZeRO stage 0 (`zero_optimization.stage: 0`): only stages 1 and 2 are supported; set "
            "`zero_optimization.stage` to 1 (the optimizer state partitioned, as cheap as stage 0 on one rank)"
        )
    zero = engine.optimizer
    if getattr(engine.optimizer, "overlap_comm", False) and next(engine.module.parameters()).is_cuda:
        refusals.append(
            "`zero_optimization.overlap_comm: true`: ZeRO waits for its reduction stream on the host "
            "inside the backward (`accelerator.synchronize()`), which no CUDA graph can capture; set "
            "`overlap_comm: false` (the reductions run on the capture stream, in the graph)"
        )
    if type(engine).__name__ == "PipelineEngine":
        refusals.append(
            "DeepSpeed's pipeline engine (`PipelineModule`): its `train_batch` drives its own schedule"
        )
    if engine.zero_cpu_offload():
        refusals.append(
            "ZeRO-Offload (`zero_optimization.offload_optimizer`): its step reads overflow and norms "
            "on the host from CPU buffers the backward fills; set `offload_optimizer.device: none`"
        )
    if engine.wall_clock_breakdown():
        refusals.append(
            "`wall_clock_breakdown: true`: its timers synchronise the device in the forward and "
            "backward; set it to false"
        )
    if engine.flops_profiler_enabled():
        refusals.append("the flops profiler (`flops_profiler.enabled: true`): turn it off")
    if not engine.managed_gradient_accumulation():
        refusals.append(
            "`managed_gradient_accumulation: false`: the step's accumulation boundary is the caller's; "
            "leave it true (DeepSpeed's own `gradient_accumulation_steps`)"
        )
    if getattr(engine, "random_ltd_enabled", lambda: False)():
        refusals.append("random layer token drop (`data_efficiency.data_routing.random_ltd`): turn it off")
    if getattr(zero, "custom_loss_scaler", False):
        refusals.append(
            "a loss scale set by `override_loss_scale`: its Python float would be baked into the graph"
        )
    if getattr(zero, "torch_autocast_gradscaler", None) is not None or getattr(
        engine, "torch_autocast_z0_gradscaler", None
    ):
        refusals.append("`torch_autocast` with a GradScaler: use DeepSpeed's own `fp16` or `bf16`")
    if not isinstance(zero, deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer) and stage in (1, 2):
        refusals.append(
            f"the engine's optimizer is a {type(zero).__name__}, not ZeRO's DeepSpeedZeroOptimizer"
        )
    if refusals:
        raise UnsupportedEngineError(
            f"capture_engine_step cannot capture this DeepSpeed {name}'s step:\n"
            + "\n".join(f"  - {r}." for r in refusals)
            + "\nNothing was run; the engine is as it was."
        )
