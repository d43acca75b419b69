"""Eager segments on the autograd path: a piece of the forward pass that runs eagerly between graphs,
and whose backward runs eagerly between the backward graphs.

`segments.py` splits a capture around work whose results carry no autograd history (an optimizer's
update, a host read). This module adds the other kind: a function or an `nn.Module`'s forward whose
results the loss depends on (an MoE layer's token dispatch, a CTC loss, a matcher on the host). At
capture it becomes one node of autograd's graph, `_Boundary`, whose forward ends one graph and begins
the next and whose backward does the same inside the captured backward:

    replay:  graph A | segment forward (eager, with autograd) | graph B (rest of forward, backward
             down to the segment) | segment backward (eager) | graph C (rest of backward, optimizer)

Tensors cross the boundary through fixed buffers: the segment's inputs are graph A's results, read at
replay as leaves that require grad (the segment gets a view of each, so that autocast casts it anew
at each use as it does an activation eagerly, where it would cache a leaf's cast); its results are copied into buffers graph B reads; graph B's
gradients for them are what the eager backward starts from; the gradients it gives its inputs and its
parameters are copied into buffers graph C reads. The parameters' gradients reach `.grad` through the
boundary node, in graph C, exactly where eager's autograd would accumulate them (so DDP's gradient
hooks and a `.grad` that accumulates are captured as usual).

In a CUDA capture those buffers live in the graphs' pool, held by the segment without owning them, and
a replay's results take their buffer's memory until the segment's backward (`segment_buffers.py`).

Bitwise: the segment's own arithmetic is eager's; each gradient of an input or parameter is summed
in eager's order, with what users outside the segment give it too (`grad_order.py`). Random draws in
the segment take the generator's offsets between the graphs', in eager order.

What a replay cannot follow raises rather than guess: results of another structure, shape, dtype or
`requires_grad` than at capture; a parameter that gets a gradient at replay but did not in the last
warm-up, or gets none where eager would have made its `.grad` (a token router that sends no token to
an expert, with gradients set to None). Refused at capture: a double backward through a segment, a
segment reached again from autograd's backward (activation checkpointing around it: put the
checkpoint inside the segment instead), a segment that reads a tensor with autograd history it was
not given as an argument, a parameter of a segment with a gradient hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import signature as sig
from ..errors import CaptureError, GraphStepError
from ..guards.state_guard import SEGMENT_MARK
from ..profiling import ranged
from . import grad_order, loose, segment_buffers, segments


@torch.compiler.disable  # a compiled model around a segment: dynamo breaks its graph here, never traces it
def run(fn: Callable, args: tuple, kwargs: dict, name: str, module: torch.nn.Module | None = None) -> Any:
    """Call `fn` (a module's forward when `module` is given) as an eager segment whose results may
    carry autograd history: plainly outside graphstep and in warm-up, split around at capture."""
    session = segments.active()
    if (
        segments.capture_elsewhere()
        if session is None
        else isinstance(session, segments.Capture) and _in_backward()
    ):
        raise CaptureError(
            f"the eager segment {name} was called from autograd's backward while the step was being "
            "captured: activation checkpointing around it recomputes its forward there, where no "
            "graph can be split. Checkpoint inside the segment, or the parts before and after it."
        )
    if session is None:
        return fn(*args, **kwargs)
    if isinstance(session, segments.Warmup):
        return _warm_up(session, fn, args, kwargs, name, module)
    seen = next(session.seen, None)
    if seen is None or seen.reach is None:  # no results with history in the last warm-up
        return segments.split(session, fn, args, kwargs, name, seen)
    return _split(session, fn, args, kwargs, name, seen)


def _in_backward() -> bool:
    """Autograd's engine is running a backward on this thread (CPU backward runs on the caller's)."""
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1


def _warm_up(
    session: segments.Warmup, fn: Callable, args: tuple, kwargs: dict, name: str, module: Any
) -> Any:
    inputs, _ = sig.flatten((args, kwargs))
    session.passed.update(map(id, inputs))
    first = _next_sequence_number()
    with session.outside_pool():  # where its replays allocate: the pool stays the graphs' size
        results = segments.plainly(fn, args, kwargs)
    tensors, spec = sig.flatten(results)
    move_out = getattr(module.__dict__.get("forward"), "_graphstep_move_out", None) if module else None
    if move_out is not None and move_out(module, spec):  # results no graph can take: moved to its parent
        return results
    segments.check_results(name, spec)
    metas = [sig.TensorMeta.of(t) for t in tensors]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        session.seen.append(segments.Seen(name, spec, metas))
        return results
    reach = grad_order.reach(name, inputs, tensors, first, module)
    session.seen.append(segments.Seen(name, spec, metas, reach))
    return results


def _next_sequence_number() -> int:
    """The sequence number autograd gives the next node made on this thread."""
    return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


# -- at capture ---------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class ForwardSegment:
    """The segment's forward at replay: `fn` on its input buffers, results into the output buffers."""

    fn: Callable
    name: str
    input_spec: Any
    inputs: list[torch.Tensor]
    requires: list[bool]
    outputs: list[torch.Tensor]
    output_spec: Any
    output_requires: list[bool]
    amp: list[tuple[str, bool, torch.dtype, bool]]
    arguments: grad_order.Arguments | None = None
    """Which inputs are one tensor, and which are leaves it gets as they are (`grad_order`)."""
    backward: BackwardSegment | None = None
    differentiable: bool = True
    """Its results carry history at replay: the capture's backward reached the segment (`finish`)."""
    live: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """The leaves and results of the last forward, with history, until its backward."""
    host_s: float = 0.0
    """Host time of its last run."""
    loose: list = dataclasses.field(default_factory=list)
    """Arguments used only in segments (`loose.py`): (position, placeholder), the call's own each time."""

    def run(self) -> None:
        start = time.perf_counter()
        differentiable = self.differentiable
        with ranged("graphstep.eager_segment"), _autocast(self.amp), torch.set_grad_enabled(differentiable):
            leaves = self.arguments.leaves(self.inputs, self.requires, differentiable)
            for i, placeholder in self.loose:  # the call's own tensor
                leaves[i] = placeholder.gs_now
            args, kwargs = sig.unflatten(self.input_spec, leaves)
            results = segments.plainly(self.fn, args, kwargs)
        tensors, spec = sig.flatten(results)
        if spec != self.output_spec or any(
            t.shape != b.shape or t.dtype != b.dtype or (differentiable and t.requires_grad != r)
            for t, b, r in zip(tensors, self.outputs, self.output_requires)
        ):
            raise GraphStepError(
                f"the eager segment {self.name} returned {segments.describe(tensors)} at this replay but "
                f"{segments.describe(self.outputs)} at capture (or results that require grad differ); the "
                "graph after it reads buffers of the captured shape. Return the same structure and shapes "
                "every call (pad, or keep the varying part inside the segment)."
            )
        del results  # (the structure held the results too: `segment_buffers.onto_buffers` counts references)
        segment_buffers.onto_buffers(tensors, self.outputs)
        if differentiable:
            self.live = (leaves, tensors)
        self.host_s = time.perf_counter() - start


@dataclasses.dataclass(eq=False)
class BackwardSegment:
    """The segment's backward at replay: gradients of its inputs and parameters into fixed buffers."""

    forward: ForwardSegment
    grad_outputs: list[torch.Tensor | None]
    params: list[torch.Tensor]
    slots: list[torch.Tensor | None]
    """Per target (the inputs that require grad, then `params`): the buffer graph C reads, or None
    where the boundary gave autograd no gradient at capture."""
    zero_ok: list[bool]
    """Per target: a missing gradient is exactly a zero one (the parameter's `.grad` existed at
    capture, so eager would have left it as it was, and graph C adds zero)."""
    amp: list[tuple[str, bool, torch.dtype, bool]]
    name: str
    seeds: list[list[torch.Tensor] | None] = dataclasses.field(default_factory=list)
    """Per target: what users made after the segment gave it (`grad_order`), its sum's start."""
    host_s: float = 0.0
    """Host time of its last run."""

    def run(self) -> None:
        start = time.perf_counter()
        fwd = self.forward
        if fwd.live is None:
            raise GraphStepError(f"the eager segment {self.name}'s backward ran without its forward")
        leaves, results = fwd.live
        fwd.live = None
        outs, grads = [], []
        for t, g in zip(results, self.grad_outputs):
            if t.requires_grad and g is not None:
                outs.append(t)
                grads.append(g)
        inputs = [leaf for leaf, r in zip(leaves, fwd.requires) if r]
        targets = inputs + self.params
        taps, seeds = grad_order.seeded(targets, self.seeds)  # later users' part: first in each sum
        outs, grads = outs + taps, grads + seeds
        with ranged("graphstep.eager_segment"), _autocast(self.amp):
            got = (
                torch.autograd.grad(outs, targets, grads, allow_unused=True)
                if outs
                else [None] * len(targets)
            )
        for i, (slot, g) in enumerate(zip(self.slots, got)):
            if slot is not None and g is not None:
                slot.copy_(g)
            elif slot is not None and self.zero_ok[i]:
                slot.zero_()
            elif slot is not None or g is not None:
                raise GraphStepError(self._changed(i, len(inputs), got_one=g is not None))
        self.host_s = time.perf_counter() - start

    def _changed(self, i: int, n_inputs: int, *, got_one: bool) -> str:
        what = (
            f"its argument {i}"
            if i < n_inputs
            else f"a parameter of shape {list(self.params[i - n_inputs].shape)}"
        )
        now, then = ("a gradient", "none") if got_one else ("no gradient", "one")
        return (
            f"the eager segment {self.name} gave {what} {now} at this replay but {then} at capture (which "
            "parameters a segment uses changed: a router sent no token to an expert, for instance). The graph "
            "after it cannot follow: eager would leave that `.grad` as it was. Make every parameter take part "
            "every call, or keep gradients allocated (`zero_grad(set_to_none=False)`), which makes a missing "
            "gradient exactly a zero one."
        )


class _Boundary(torch.autograd.Function):
    """The segment as one node of the captured autograd graph: its forward and backward split the capture."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = plan.begin_forward(tensors)
        ctx.plan = plan
        ctx.mark_non_differentiable(*[o for o, r in zip(outputs, plan.forward.output_requires) if not r])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return (None, *ctx.plan.begin_backward(grad_outputs))


@dataclasses.dataclass(eq=False)
class _Plan:
    """One segment call at capture: what the boundary's forward and backward record."""

    session: segments.Capture
    fn: Callable
    name: str
    input_spec: Any
    n_inputs: int
    seen: segments.Seen
    tensors: list[torch.Tensor]
    """What the boundary node takes: the tensor arguments, then the parameters the segment uses."""
    loose: list
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The segment's inputs, owned from its forward to its backward (as eager's saved tensors are)."""
    forward: ForwardSegment | None = None
    order: grad_order.Order | None = None
    """Its targets' users made after it (`grad_order`), once the boundary node exists."""

    def begin_forward(self, tensors: tuple) -> tuple[torch.Tensor, ...]:
        splitter = self.session.splitter
        metas = self.seen.metas
        outputs = segment_buffers.made_by_ending_part(
            splitter,
            lambda: [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in metas],
        )
        reach = self.seen.reach
        arguments, inputs, requires = grad_order.Arguments.of(tensors[: self.n_inputs], reach.inputs)
        self.inputs = inputs  # owned until the segment's backward, which reads them (its forward saved them)
        held = segment_buffers.unowned_in_pool(
            [None if k else t for t, k in zip(inputs, arguments.keep)], splitter
        )
        fwd = self.forward = ForwardSegment(
            self.fn,
            self.name,
            self.input_spec,
            [t if k else h for t, h, k in zip(inputs, held, arguments.keep)],  # keep: the leaf itself
            requires,
            outputs if splitter.in_pool is None else [segment_buffers.unowned(t) for t in outputs],
            self.seen.spec,
            reach.outputs,
            _amp_state(),
            arguments,
            loose=self.loose,
        )
        self.session.segments.append(fwd)
        if splitter.executes:  # the recording backend runs the step while it captures: the segment too
            fwd.run()
        splitter.begin_part()
        return tuple(outputs)

    def begin_backward(self, grad_outputs: tuple) -> list[torch.Tensor | None]:
        if torch.is_grad_enabled():
            raise CaptureError(
                f"a double backward (create_graph=True) reached the eager segment {self.name}; its "
                "backward runs eagerly and gives gradients without history. Take the double backward "
                "outside the captured step, or leave this piece out of segments."
            )
        fwd = self.forward
        seeds = [] if self.order is None else self.session.order.seeds(self.order)
        splitter = self.session.splitter
        reach = self.seen.reach
        inputs = [t for t, r in zip(self.inputs, fwd.requires) if r]
        given = {id(t) for t in self.tensors[: self.n_inputs]}
        params = reach.params + [p for p in reach.idle if id(p) not in given]
        zero_ok = [False] * len(inputs) + [p.grad is not None for p in reach.params + reach.idle]
        # unused in the warm-up (`idle`): exact only where .grad exists (gets + 0)
        wanted = inputs + reach.params + [p if p.grad is not None else None for p in reach.idle]
        # Each becomes a `.grad`, or is freed once summed into one.
        slots = segment_buffers.made_by_ending_part(
            splitter, lambda: [None if t is None else torch.empty_like(t) for t in wanted]
        )
        grad_outputs = segment_buffers.unowned_in_pool(
            [None if g is None else g.detach() for g in grad_outputs], splitter
        )
        hold = segment_buffers.alias if splitter.in_pool is None else segment_buffers.unowned
        held = [None if t is None else hold(t) for t in slots]
        bwd = BackwardSegment(fwd, grad_outputs, params, held, zero_ok, _amp_state(), self.name, seeds)
        fwd.backward = bwd
        self.session.segments.append(bwd)
        if splitter.executes:
            bwd.run()
        splitter.begin_part()
        self.inputs = []  # the segment's backward was their last use: later parts may reuse them
        by_input = iter(slots[: len(inputs)])
        grads = [next(by_input) if r else None for r in fwd.requires]
        by_param = dict(zip(map(id, params), slots[len(inputs) :]))
        return grads + [by_param.get(id(t)) for t in self.tensors[self.n_inputs :]]

    def let_go(self, kind: type | None, error: BaseException | None, tb: Any) -> None:
        """At the end of a capture, failed or not (`ExitStack.push`: called with the error, if any). The
        capture's boundary nodes hold this plan (`ctx.plan`), and through it the capture's session, its
        segments' buffers and the forward graph with its saved activations; the nodes are held by the graph
        in C++, a cycle the garbage collector cannot see. A failed capture's stayed so, in its abandoned
        pool, for good (issue 42: 39 MiB on the MoE row, 113 MiB with grouped_mm), and the capture that
        succeeded kept its own until the process ended, `close()` or not. Replays need none of it."""
        self.forward, self.order, self.tensors, self.session, self.inputs = None, None, [], None, []

    def watch(self, outputs: tuple) -> None:
        """After the boundary node exists: have the capture's backward find its targets' later users."""
        node = next((o.grad_fn for o in outputs if o.grad_fn is not None), None)
        if node is not None:
            given = self.tensors[: self.n_inputs]
            wanted = [(t, f"its argument {i} {segments.describe([t])}") for i, t in enumerate(given)]
            wanted = [w for w, r in zip(wanted, self.forward.requires) if r]
            wanted += [(p, f"its parameter of shape {list(p.shape)}") for p in self.seen.reach.params]
            self.order = self.session.order.follow(self.name, node, wanted, self.seen.reach.casts)


def _split(
    session: segments.Capture, fn: Callable, args: tuple, kwargs: dict, name: str, seen: segments.Seen
) -> Any:
    if seen.name != name:
        segments.split(session, fn, args, kwargs, name, seen)  # raises: another segment was expected
    segments.check_devices(name, seen, session.splitter)
    inputs, input_spec = sig.flatten((args, kwargs))
    held = loose.placeholders((args, kwargs))
    for i, placeholder in held:  # the boundary takes the call's tensor; each replay, that call's
        inputs[i] = placeholder.gs_now
    reach = seen.reach
    if len(inputs) != len(reach.inputs):
        raise CaptureError(
            f"the eager segment {name} was called with {len(inputs)} tensors at capture but "
            f"{len(reach.inputs)} in the last warm-up; call it the same way every time."
        )
    known = {id(t) for t in inputs}
    params = [p for p in reach.params + reach.idle if id(p) not in known]
    plan = _Plan(session, fn, name, input_spec, len(inputs), seen, inputs + params, held)
    session.exits.push(plan.let_go)
    outputs = _Boundary.apply(plan, *inputs, *params)
    if plan.forward is not None:
        plan.watch(outputs)
    return sig.unflatten(seen.spec, list(outputs))


def finish(parts: list) -> None:
    """After a capture: a segment whose backward the capture never reached runs without autograd."""
    for part in parts:
        if isinstance(part, ForwardSegment) and part.backward is None:
            part.differentiable = False


# -- the public face ----------------------------------------------------------------------------------


def eager_segment(fn: Callable | torch.nn.Module, *, name: str | None = None) -> Any:
    """Mark a function, or a module's forward, as an eager segment of a captured step.

    Called from a captured step, it runs eagerly between the graphs: anything goes inside (host
    reads, shapes that depend on the data, CPU libraries, its own dropout). Where its results carry
    autograd history, its backward runs eagerly too, between the backward graphs, and the rest of the
    step stays in graphs. The tensors it takes and returns keep one shape per input signature. Each
    call costs the host time of its Python on every step, plus one wait for the GPU where it reads a
    value on the host. A function is wrapped (use it as a decorator); a module is marked in place and
    returned (`graphstep.eager_segment(model.moe)`), and `unmark` takes the mark off.
    """
    if isinstance(fn, torch.nn.Module):
        mark(fn, name or type(fn).__qualname__)
        return fn
    label = name or getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def segment(*args: Any, **kwargs: Any) -> Any:
        return run(fn, args, kwargs, label)

    return segment


def mark(module: torch.nn.Module, name: str, move_out: Callable | None = None) -> None:
    """Make `module`'s forward an eager segment (its instance `forward` is wrapped). `move_out(module,
    spec)`, given its results' spec in a warm-up: True when it moved the segment out (`graph_breaks.py`)."""
    if is_marked(module):
        return
    forward = module.forward

    @functools.wraps(forward)
    def segment(*args: Any, **kwargs: Any) -> Any:
        return run(forward, args, kwargs, name, module)

    setattr(segment, SEGMENT_MARK, forward)
    segment._graphstep_move_out = move_out
    module.forward = segment


def is_marked(module: torch.nn.Module) -> bool:
    return hasattr(module.__dict__.get("forward"), SEGMENT_MARK)


def unmark(module: torch.nn.Module) -> None:
    forward = module.__dict__.get("forward")
    if hasattr(forward, SEGMENT_MARK):
        original = getattr(forward, SEGMENT_MARK)
        if getattr(original, "__self__", None) is module and original.__func__ is type(module).forward:
            del module.__dict__["forward"]
        else:
            module.forward = original


# -- autocast as the step set it ----------------------------------------------------------------------


def _devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _amp_state() -> list[tuple[str, bool, torch.dtype, bool]]:
    cache = torch.is_autocast_cache_enabled()  # off: each use casts a parameter anew, inside as well
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), cache) for d in _devices()]


@contextlib.contextmanager
def _autocast(state: list[tuple[str, bool, torch.dtype, bool]]) -> Iterator[None]:
    """Autocast as it was where the capture reached the segment: a replay runs none of the step's Python."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype, cache in state:
            if enabled or torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield
