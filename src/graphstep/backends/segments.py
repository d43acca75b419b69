"""Eager segments: work inside a captured step that runs eagerly between graph replays.

Some work cannot live in a CUDA graph: an optimizer whose hyperparameters change but stay Python
numbers, an optimizer graphstep cannot reason about, code that reads values on the host. A
segment splits the step there: the capture ends one graph before the segment and begins the
next after it, and every replay runs graph, segment, graph, ... on the caller's stream. All
graphs of a step live in its one memory pool; tensors passed from one part to the next stay at
the addresses they had at capture.

A segment is any function called through `run` (the public face is `graphstep.eager_segment`, in
`autograd_segments.py`, which also takes segments whose results carry autograd history);
an optimizer in eager mode gets its `step` routed through it during capture. A step called with a
closure (`opt.step(closure)`, as Lightning calls it) keeps the closure in the graph and makes only
the update the segment (`optimizer_steps_as_segments`). Outside a capture
(warm-up, eager backend) `run` simply calls the function. During a capture:

- the function is not run (a CUDA capture executes nothing): the segment is recorded with its
  arguments, and its results are empty buffers shaped like the results it gave in the last
  warm-up, which the next graph reads and every replay refills;
- each parameter's `.grad` as the step left it at that point is remembered and attached again
  before the segment runs at replay (a graph cannot re-run `p.grad = ...`); after the last part,
  `.grad` is put back as the capture left it, exactly what a replay without segments leaves.

Segments run here under `torch.no_grad()`: their results carry no autograd history (those that do
are `autograd_segments.py`'s). Host syncs
(`.item()`, `print(tensor)`) are fine in a segment. Each costs a host round trip per call: the
Python of the segment runs on every replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import signature as sig
from ..errors import CaptureError, GraphStepError, WarmUpAgain
from ..profiling import ranged
from . import grad_order, loose

_local = threading.local()
_NONE_SPEC = sig.flatten(None)[1]


@dataclasses.dataclass
class Splitter:
    """How a backend ends one part of a capture and begins the next, at an eager segment."""

    end_part: Callable[[], None]
    begin_part: Callable[[], None]
    executes: bool
    """The backend runs the step while capturing (recording, eager): a segment runs then too."""
    in_pool: Callable[[list[torch.Tensor]], list[bool]] | None = None
    """A capture into a memory pool (CUDA): which of the tensors live in that pool now, between parts."""


@dataclasses.dataclass(eq=False)
class Segment:
    """One eager segment of a captured step: what to call, and what to hand over around it."""

    fn: Callable
    args: tuple
    kwargs: dict
    grads: list[tuple[torch.Tensor, torch.Tensor | None]]
    """Each parameter's `.grad` when the capture reached this segment."""
    output_spec: Any
    outputs: list[torch.Tensor]
    """The buffers later parts read; a replay copies the segment's fresh results into them."""
    name: str
    host_s: float = 0.0
    """Host time of its last run."""
    loose: list = dataclasses.field(default_factory=list)
    """Arguments used only in segments (`loose.py`): (position, placeholder) pairs, the call's own each time."""

    def run(self) -> None:
        start = time.perf_counter()
        for p, g in self.grads:
            p.grad = g
        args, kwargs = (
            loose.resolve((self.args, self.kwargs), self.loose) if self.loose else (self.args, self.kwargs)
        )
        with torch.no_grad(), ranged("graphstep.eager_segment"):
            results = self.fn(*args, **kwargs)
            tensors, spec = sig.flatten(results)
            if spec != self.output_spec or any(
                t.shape != b.shape or t.dtype != b.dtype for t, b in zip(tensors, self.outputs)
            ):
                raise GraphStepError(
                    f"the eager segment {self.name} returned {describe(tensors)} at this replay but "
                    f"{describe(self.outputs)} at capture; the graph after it reads "
                    "buffers of the captured shape. Return the same structure and shapes every call "
                    "(pad, or compute the varying part outside the captured step)."
                )
            for buffer, t in zip(self.outputs, tensors):
                if t is not buffer:
                    buffer.copy_(t)
        self.host_s = time.perf_counter() - start


@dataclasses.dataclass(eq=False)
class Seen:
    """A segment's results in a warm-up: the shape of the buffers a capture hands out instead."""

    name: str
    spec: Any
    metas: list[sig.TensorMeta]
    reach: Any = None
    """For results with autograd history: what the segment's backward reaches (`autograd_segments.Reach`)."""


class ResultsOnHost(CaptureError):
    """A segment of a step captured into CUDA graphs returned tensors in host memory: the graph after
    it would compute on them once, at capture, and never again."""


def check_devices(name: str, seen: Seen, splitter: Splitter) -> None:
    if not splitter.executes and any(m.device.type == "cpu" for m in seen.metas):
        raise ResultsOnHost(
            f"the eager segment {name} returns tensors in host memory; a CUDA graph after it would compute "
            "on them at capture only. Return them on the GPU (`.to(device)` inside the segment), or make "
            "the code that uses them part of the segment."
        )


class Warmup:
    """Notes each segment's results during a warm-up, in call order, and the tensors handed to them."""

    def __init__(self, outside_pool: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.seen: list[Seen] = []
        self.passed: set[int] = set()
        """The ids of the tensors handed to segments (an argument used only there: `loose.py`)."""
        self.outside_pool = outside_pool
        """Around a segment's forward: allocate outside the step's pool (the backend's `outside_pool`),
        as a replay's segments do (the pool's free blocks are the graphs' scratch then). In the pool,
        what the segment took would stay cached there for good, used by no replay; outside it, the
        capture hands it back (CUDA: `empty_cache` after a capture with segments)."""


class Capture:
    def __init__(self, splitter: Splitter, params: list[torch.Tensor], seen: list[Seen]):
        self.splitter = splitter
        self.params = params
        self.seen = iter(seen)
        self.segments: list[Segment] = []
        self.exits = contextlib.ExitStack()
        """What the capture's end undoes (autograd's entry, wrapped for `order`)."""
        self.order = grad_order.Watch(self.exits)
        """Segments on the autograd path whose gradients must be summed in eager's order."""


_PLAIN: Any = object()
"""The session of a thread that runs a segment's body: nested segments run plainly in it."""
_captures = 0
"""Captures in progress, in any thread."""


def active() -> Warmup | Capture | None:
    session = getattr(_local, "active", None)
    return None if session is _PLAIN else session


def capture_elsewhere() -> bool:
    """A capture is in progress, and this thread is neither capturing nor running a segment's body
    (autograd's backward thread, recomputing a checkpointed forward)."""
    return _captures > 0 and getattr(_local, "active", None) is not _PLAIN


@contextlib.contextmanager
def _activate(session: Any) -> Iterator[None]:
    previous = getattr(_local, "active", None)
    _local.active = session
    try:
        yield
    finally:
        _local.active = previous


@contextlib.contextmanager
def watching_warmup(outside_pool: Callable[[], Any] = contextlib.nullcontext) -> Iterator[Warmup]:
    """Around a warm-up: note what each segment returns (the next capture hands out such buffers).
    `outside_pool`: the backend's, for the segments' forwards."""
    session = Warmup(outside_pool)
    with _activate(session):
        yield session


@contextlib.contextmanager
def capturing(splitter: Splitter, params: list[torch.Tensor], seen: list[Seen]) -> Iterator[Capture]:
    """Around a capture: each segment call ends a part and begins the next. `seen`: the results
    noted in the last warm-up; `params`: whose `.grad` a segment must find attached at replay."""
    global _captures
    session = Capture(splitter, params, seen)
    _captures += 1
    try:
        with session.exits, _activate(session):
            yield session
    finally:
        _captures -= 1


def run(fn: Callable, args: tuple, kwargs: dict, name: str, *, returns_none: bool = False) -> Any:
    """Call `fn` as an eager segment of the step being captured (or just call it).

    `returns_none`: `fn`'s result is ignored (an optimizer step), so a capture needs no warm-up's
    notes of it: a step whose optimizer just moved to an eager segment can capture at once."""
    session = active()
    if session is None:
        return fn(*args, **kwargs)
    if isinstance(session, Warmup):
        session.passed.update(map(id, sig.flatten((args, kwargs))[0]))
    if returns_none:
        if isinstance(session, Warmup):
            plainly(fn, args, kwargs)
        else:
            split(session, fn, args, kwargs, name, Seen(name, _NONE_SPEC, []))
        return None
    if isinstance(session, Warmup):
        with torch.no_grad():
            results = plainly(fn, args, kwargs)
        tensors, spec = sig.flatten(results)
        check_results(name, spec)
        session.seen.append(Seen(name, spec, [sig.TensorMeta.of(t) for t in tensors]))
        return sig.unflatten(spec, [t.detach() for t in tensors])
    return split(session, fn, args, kwargs, name, next(session.seen, None))


def split(session: Capture, fn: Callable, args: tuple, kwargs: dict, name: str, seen: Seen | None) -> Any:
    if seen is None or seen.name != name:
        raise WarmUpAgain(
            f"the capture reached the eager segment {name}, which the last warm-up "
            + ("did not call at this point" if seen is None else f"did not call here (it called {seen.name})")
            + ". The step must call the same eager segments in the same order every time."
        )
    splitter = session.splitter
    check_devices(name, seen, splitter)
    splitter.end_part()
    grads = [(p, p.grad) for p in session.params]
    held = loose.placeholders((args, kwargs))
    if splitter.executes:  # the step really runs while capturing: so does the segment
        with torch.no_grad():
            results = plainly(fn, *(loose.resolve((args, kwargs), held) if held else (args, kwargs)))
        tensors, spec = sig.flatten(results)
        outputs = [t.detach() for t in tensors]
    else:
        spec = seen.spec
        outputs = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in seen.metas]
    session.segments.append(Segment(fn, args, kwargs, grads, spec, outputs, name, loose=held))
    splitter.begin_part()
    return sig.unflatten(spec, outputs)


def plainly(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a segment's body as plain eager code: a segment it calls (an eager optimizer's step
    inside GradScaler's) is part of it, not a split of its own, as it is at replay."""
    with _activate(_PLAIN):
        return fn(*args, **kwargs)


def check_results(name: str, spec: Any) -> None:
    for path, leaf in sig.paths(spec, "result"):
        if not sig.is_tensor_leaf(leaf) and sig.value_of(leaf) is not None:
            value = sig.value_of(leaf)
            raise GraphStepError(
                f"the eager segment {name} returns a {type(value).__name__} ({value!r}) at {path}. The graph "
                "after a segment runs no Python, so it would see this value as it was at capture. Return "
                "tensors (or None), or use the value inside the segment."
            )


def describe(tensors: list[torch.Tensor]) -> str:
    return "(" + ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors) + ")" if tensors else "no tensors"


@contextlib.contextmanager
def optimizer_steps_as_segments(
    optimizers: list[torch.optim.Optimizer], fresh_grads: list[torch.optim.Optimizer] = ()
) -> Iterator[None]:
    """While warming up or capturing: route each of `optimizers`' `step()` through an eager segment.

    A step called with a closure (Lightning always passes one) is split where torch's own step
    splits it: the closure (forward, backward, clipping: the bulk of the work) runs in the graph
    before the segment, and the update is the segment, which returns the closure's loss from the
    graph. That is exact for an optimizer whose step calls the closure once, first, under
    `enable_grad` (every torch.optim optimizer but LBFGS, which graphstep refuses); one that calls
    it again is stopped with a `CaptureError` (see `_OneEvaluation`). `fresh_grads`: those of them
    whose step keeps a gradient by reference; their segment hands the step a copy of each gradient at
    replay, as eager hands it a new tensor every step (a graph writes every step's into one buffer)."""
    # What the instance held before (a torch LR scheduler wraps `opt.step` on the instance to notice
    # the step was called): put back afterwards, not dropped.
    held = [(opt, opt.__dict__.get("step")) for opt in optimizers]
    for opt in optimizers:
        step = opt.step
        fresh = any(opt is o for o in fresh_grads)
        opt.step = functools.partial(_segment_step, opt, step, f"{type(opt).__qualname__}.step", fresh)
    try:
        yield
    finally:
        for opt, before in held:
            if before is None:
                opt.__dict__.pop("step", None)
            else:
                opt.step = before


_AMP_ATTRIBUTES = ("grad_scale", "found_inf")
"""What GradScaler.step sets on a fused optimizer for the one step() call (and deletes after it)."""


def _segment_step(
    opt: torch.optim.Optimizer,
    step: Callable,
    name: str,
    fresh: bool,
    closure: Callable | None = None,
    **kwargs: Any,
) -> Any:
    if not isinstance(active(), Capture):  # warm-up: the real step, eagerly, as torch runs it
        if closure is None:
            return step(**kwargs)
        evaluation = _OneEvaluation(name, closure, again=True)
        result = step(evaluation, **kwargs)
        evaluation.check_called()  # after the step: a failed check leaves what eager leaves
        return result
    loss = None
    if closure is not None:
        with torch.enable_grad():  # as torch's step calls it
            loss = closure()
    # GradScaler hands a fused optimizer its scale and inf flag as attributes for this one call:
    # a replay runs the segment without GradScaler around it, so the segment sets them itself (the
    # tensors the graph computes them into).
    amp = {key: opt.__dict__[key] for key in _AMP_ATTRIBUTES if key in opt.__dict__}
    run(
        _update, (opt, step, name, closure is not None, loss, kwargs, amp, fresh), {}, name, returns_none=True
    )
    return loss


def _update(
    opt: torch.optim.Optimizer,
    step: Callable,
    name: str,
    closed: bool,
    loss: Any,
    kwargs: dict,
    amp: dict,
    fresh: bool,
) -> None:
    """The segment of an optimizer step: the update (handed the loss the graph computed, if the step
    was called with a closure), with GradScaler's attributes as at capture; `fresh`: with a copy of
    each gradient, put back to the graph's buffer after the step."""
    before = {key: opt.__dict__[key] for key in amp if key in opt.__dict__}
    opt.__dict__.update(amp)
    buffers = (
        [(p, p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None] if fresh else []
    )
    for p, grad in buffers:
        p.grad = grad.clone()
    try:
        if not closed:
            step(**kwargs)
            return
        evaluation = _OneEvaluation(name, lambda: loss)
        step(evaluation, **kwargs)
        evaluation.check_called()
    finally:
        for p, grad in buffers:  # the graph's buffers again, as the capture left them
            p.grad = grad
        for key in amp:
            if key in before:
                opt.__dict__[key] = before[key]
            else:
                opt.__dict__.pop(key, None)


class _OneEvaluation:
    """A step's closure that counts its calls: a graph evaluates it once, and cannot again.

    `again`: a second call evaluates it again (an eager warm-up, which `check_called` reports
    after the step); otherwise (a replay, where the graph computed the loss) it raises at once."""

    def __init__(self, name: str, closure: Callable, *, again: bool = False):
        self.name = name
        self.closure = closure
        self.again = again
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls > 1 and not self.again:
            raise self._error("called its closure a second time in one step")
        return self.closure()

    def check_called(self) -> None:
        if self.calls > 1:
            raise self._error(f"called its closure {self.calls} times in one step")
        if self.calls == 0:
            raise CaptureError(
                f"{self.name} was called with a closure and did not call it. Inside a captured step "
                "graphstep runs the closure before the optimizer's update, as torch's optimizers do; "
                "an optimizer that skips it would see gradients it never computed. Call the closure "
                "before the step and call step() without one."
            )

    def _error(self, what: str) -> CaptureError:
        return CaptureError(
            f"{self.name} {what}. Inside a captured step the closure (forward, backward) runs once, in "
            "the graph, and the optimizer's update runs eagerly after it, so an optimizer that "
            "re-evaluates the loss (LBFGS, a line search, SAM) cannot run there. Run that optimizer "
            "without graphstep, or use one whose step calls the closure once (every torch.optim "
            "optimizer but LBFGS)."
        )
