"""Gradients summed in eager's order across an eager segment on the autograd path.

Autograd's engine runs the nodes of a backward in descending sequence number (creation order,
newest first: the node it runs is always the newest one still pending). A tensor's gradient is the
sum of what each of its users gives it, added into the producer's input buffer in that order, one
addition at a time: `((a + b) + c) + d`, which float arithmetic does not regroup.

An eager segment is one node of the captured graph (`autograd_segments._Boundary`), created where
the segment was called. Its backward runs the segment's own backward, where a tensor the segment
uses several times gets those contributions summed first; the node then hands autograd one sum.
Eager instead adds them one by one onto what the users made *after* the segment (a residual's add, a
post-norm block's add, a tied head) already gave: `((after + s1) + s2)` against `after + (s1 + s2)`.
Users made before the segment are no matter: they come after in both orders.

So, at capture, when a backward starts (graphstep wraps autograd's entry, `torch.autograd.backward`
and `grad`, for the capture), the graph is walked from its roots and every user of a segment's
input or parameter made after the segment gets a hook that takes its contribution out of autograd's
sum and hands it to the segment. The segment's backward starts that tensor's sum with them (a view
of the tensor, made after the segment's nodes, runs first and gives it their sum), adds its own
contributions in its own order, and hands autograd the whole: the additions eager makes, in eager's
order, whatever count of uses each call makes. Refused at capture, naming the tensor: a backward
that computes only some gradients (`torch.autograd.grad`, `backward(inputs=...)`) through a segment
whose tensor has later users, a backward that starts from such a tensor, a backward that did not go
through torch.autograd's entry, and a parameter used through autocast's cached cast both inside the
segment and outside it (eagerly one shared low-precision cast, which no split can share).

Also here, for the same sums: what a segment's autograd graph reached in a warm-up (`reach`), and how
its arguments become its leaves at replay (`Arguments`): one tensor passed twice is one leaf, a
parameter passed in is the parameter itself, so that all its uses inside sum in one buffer, and an
argument with history is a view of its leaf, so that autocast casts it at each use (it caches the cast
of a leaf that requires grad, never an activation's: one shared cast would sum the uses in bf16).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CaptureError


@dataclasses.dataclass(eq=False)
class Reach:
    """What a segment's autograd graph reached in a warm-up."""

    inputs: list[bool]
    """Per tensor argument: its gradient depends on the segment's results."""
    params: list[torch.Tensor]
    """Leaves that require grad (parameters) the segment used."""
    idle: list[torch.Tensor]
    """The segment module's parameters it did not use this time (an expert no token reached)."""
    outputs: list[bool]
    """Per result tensor: it requires grad."""
    casts: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Parameters it used through autocast's cached cast: eagerly, a use outside the segment under the
    same autocast shares that cast (one node, one sum in the low precision), which no split can."""


def reach(name: str, inputs: list, outputs: list, first: int, module: Any) -> Reach:
    """Walk the segment's part of autograd's graph, from its results down to its inputs."""
    edges = {}
    for i, t in enumerate(inputs):
        if t.requires_grad:
            edge = torch.autograd.graph.get_gradient_edge(t)
            edges[(edge.node, edge.output_nr)] = i
    input_nodes = {node for node, _ in edges}
    reached = [False] * len(inputs)
    leaves: dict[int, torch.Tensor] = {}
    seen: set = set()
    casts: set = set()
    todo = [
        (e.node, e.output_nr)
        for t in outputs
        if t.requires_grad
        for e in [torch.autograd.graph.get_gradient_edge(t)]
    ]
    while todo:
        node, nr = todo.pop()
        if (node, nr) in edges:
            reached[edges[(node, nr)]] = True
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf the segment used
            leaves[id(variable)] = variable
            continue
        if node in input_nodes or node._sequence_nr() < first:
            _cast_before(name, node)
            raise CaptureError(
                f"the eager segment {name} uses a tensor with autograd history that is not one of its "
                "arguments (made before the segment, e.g. kept on a module or in a closure). Its backward "
                "runs apart from the graphs', so every tensor with history must come in as an argument."
            )
        if node in seen:
            continue
        seen.add(node)
        todo.extend((n, i) for n, i in node.next_functions if n is not None)
        if type(node).__name__ == "ToCopyBackward0" and _cached_casts():
            casts.update(
                (id(n.variable), n.variable) for n, _ in node.next_functions if hasattr(n, "variable")
            )
    used = list(leaves.values())
    idle = []
    if module is not None:
        idle = [p for p in module.parameters() if p.requires_grad and id(p) not in leaves]
    for p in used + idle:
        if p._backward_hooks:
            raise CaptureError(
                f"a parameter of the eager segment {name} has a gradient hook (`register_hook`); its "
                "gradient is computed in the segment and accumulated in the graph after it, where the "
                "hook would run twice. Register the hook on the module's output instead."
            )
    used = [p for p in used if all(p is not t for t in inputs)]
    return Reach(reached, used, idle, [t.requires_grad for t in outputs], [p for _, p in casts])


def _cached_casts() -> bool:
    """Autocast is on, with its cache of parameters' casts, where the segment runs eagerly."""
    return torch.is_autocast_cache_enabled() and any(
        torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if d == "cpu" or torch.cuda.is_available()
    )


def _cast_before(name: str, node: Any) -> None:
    """A tensor with history from before the segment that is autocast's cast of a parameter: the
    parameter is used under autocast before the segment too, and the segment got its cached cast."""
    leaves = [n.variable for n, _ in node.next_functions if hasattr(n, "variable")]
    if type(node).__name__ == "ToCopyBackward0" and leaves:
        raise CaptureError(
            f"the eager segment {name} uses a parameter of shape {list(leaves[0].shape)} that the step "
            "also uses before the segment under "
            "autocast: eagerly both uses share autocast's cached cast of it (one gradient, summed in low "
            "precision), which a segment run between graphs cannot share. Turn the cache off "
            "(`torch.autocast(..., cache_enabled=False)`), or keep both uses on one side of the segment."
        )


@dataclasses.dataclass(eq=False)
class Order:
    """One segment call at capture: which tensors its backward gives gradients, and what users made
    after it gave them before it ran."""

    name: str
    node: Any
    """The segment's node in the captured autograd graph."""
    edges: list[tuple[int, Any]]
    """Per target (index into the segment backward's targets): the autograd edge its gradient goes to."""
    labels: list[str]
    """Per entry of `edges`: how an error names that tensor."""
    early: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    """Per target: the contributions of later users, in the order autograd gave them."""
    walked: bool = False
    """A backward graphstep walked reached this segment (its later users are known)."""
    casts: set[int] = dataclasses.field(default_factory=set)
    """Targets the segment used through autocast's cached cast (`Reach.casts`)."""


class Watch:
    """The segments of one capture whose backward has not run yet, and autograd's entry wrapped."""

    def __init__(self, exits: contextlib.ExitStack):
        self.pending: list[Order] = []
        self.installed = False
        self.exits = exits
        """The capture's: autograd's entry is wrapped from the first segment to the capture's end."""

    def follow(self, name: str, node: Any, targets: list[tuple[torch.Tensor, str]], casts: list) -> Order:
        """A segment's boundary `node` was made: its `targets` (tensor, how an error names it), in the
        order its backward gives them gradients, get their later users found when a backward starts."""
        edges = [(k, torch.autograd.graph.get_gradient_edge(t)) for k, (t, _) in enumerate(targets)]
        order = Order(name, node, edges, [label for _, label in targets])
        order.casts = {k for k, (t, _) in enumerate(targets) if any(t is c for c in casts)}
        if not self.installed:
            self.exits.enter_context(self.around_backwards())
        self.pending.append(order)
        return order

    def seeds(self, order: Order) -> list[list[torch.Tensor] | None]:
        """When the segment's backward is reached at capture: per target, what later users gave it."""
        if order in self.pending:
            self.pending.remove(order)
        if not order.walked:
            raise CaptureError(
                f"the backward through the eager segment {order.name} did not start through "
                "torch.autograd.backward or torch.autograd.grad, so graphstep could not find what else "
                "uses its inputs, nor sum their gradients in eager's order. Call loss.backward() (or "
                "torch.autograd.backward) in the step."
            )
        return [order.early.get(k) for k in range(len(order.edges))]

    @contextlib.contextmanager
    def around_backwards(self) -> Iterator[None]:
        """While capturing: every backward that starts through torch.autograd walks its graph first."""
        import torch.autograd.graph as graph_module

        original = torch.autograd._engine_run_backward

        def run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            # (a backward inside a backward is a segment's own, run at capture by the recording backend)
            inner = torch._C._current_graph_task_id() != -1
            handles = self._walk(t_outputs, _whole(args, kwargs)) if self.pending and not inner else []
            try:
                return original(t_outputs, *args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()

        torch.autograd._engine_run_backward = run_backward
        graph_module._engine_run_backward = run_backward
        self.installed = True
        try:
            yield
        finally:
            torch.autograd._engine_run_backward = original
            graph_module._engine_run_backward = original
            self.installed = False

    def _walk(self, roots: Any, whole: bool) -> list:
        by_edge: dict[tuple[Any, int], list[tuple[Order, int, int]]] = {}
        for order in self.pending:
            for j, (k, edge) in enumerate(order.edges):
                by_edge.setdefault((edge.node, edge.output_nr), []).append((order, k, j))
        users: list[tuple[Any, int, list[tuple[Order, int, int]]]] = []
        seen: set = set()
        roots = roots if isinstance(roots, (list, tuple)) else [roots]
        for edge in filter(None, map(_edge_of, roots)):  # the backward's own start: a use after all
            for order, _, j in by_edge.get((edge.node, edge.output_nr), ()):
                raise CaptureError(
                    f"a backward starts from {order.labels[j]} of the eager segment {order.name}, which "
                    "autograd adds before the segment's own contributions; a segment cannot follow that "
                    "order. Start the backward from the loss."
                )
        todo = [edge.node for edge in filter(None, map(_edge_of, roots))]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            for i, (child, nr) in enumerate(node.next_functions):
                if child is None:
                    continue
                todo.append(child)
                if (child, nr) in by_edge:
                    users.append((node, i, by_edge[(child, nr)]))
        for order in self.pending:
            order.walked = order.walked or order.node in seen
        # A later user's contribution goes to the segment autograd runs next after it (the newest
        # older one that this backward runs): that one hands it on, in its own sum, to older ones.
        later: dict[Any, list[tuple[Order, int, int, int]]] = {}
        for node, i, candidates in users:
            seq = node._sequence_nr()
            older = [
                c
                for c in candidates
                if c[0].node in seen and c[0].node is not node and c[0].node._sequence_nr() < seq
            ]
            if older:
                order, k, j = max(older, key=lambda c: c[0].node._sequence_nr())
                if k in order.casts and type(node).__name__ == "ToCopyBackward0":
                    raise CaptureError(
                        f"the eager segment {order.name} uses {order.labels[j]} under autocast, and the step "
                        "uses it after the segment under autocast too: eagerly both uses share autocast's "
                        "cached cast of it (one gradient, summed in low precision), which a segment run "
                        "between graphs cannot share. Turn the cache off (`torch.autocast(..., "
                        "cache_enabled=False)`), or keep both uses on one side of the segment."
                    )
                later.setdefault(node, []).append((order, k, i, j))
        if later and not whole:
            order, _, _, j = next(iter(later.values()))[0]
            raise CaptureError(
                f"a backward through the eager segment {order.name} computes only some gradients "
                f"(torch.autograd.grad, or backward(inputs=...)), and {order.labels[j]} is used after the "
                "segment as well: its gradient could not be summed in eager's order. Call backward() "
                "on the loss, or keep the later use of that tensor inside the segment."
            )
        return [node.register_hook(_taking(entries)) for node, entries in later.items()]


def _taking(entries: list[tuple[Order, int, int, int]]) -> Any:
    """A node hook that takes the node's contributions to segment targets out of autograd's sum."""

    def hook(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        grads = list(grad_inputs)
        for order, k, i, _ in entries:
            if grads[i] is not None:
                order.early.setdefault(k, []).append(grads[i])
                grads[i] = None
        return tuple(grads)

    return hook


def _whole(args: tuple, kwargs: dict) -> bool:
    """The backward accumulates into every leaf (backward(), not grad() or inputs=...)."""
    inputs = args[3] if len(args) > 3 else kwargs.get("inputs")
    accumulate = args[5] if len(args) > 5 else kwargs.get("accumulate_grad", True)
    return bool(accumulate) and not inputs


def _edge_of(root: Any) -> Any:
    if isinstance(root, torch.Tensor):
        return torch.autograd.graph.get_gradient_edge(root) if root.requires_grad else None
    return root if hasattr(root, "node") else None  # a GradientEdge


@dataclasses.dataclass(eq=False)
class Arguments:
    """How a segment's tensor arguments become the leaves its body gets at replay, so that each
    tensor's uses inside sum in one buffer, as they do eagerly."""

    same: list[int]
    """Per argument: the first that is the same tensor (one tensor passed twice is one leaf)."""
    keep: list[bool]
    """Per argument: a leaf that requires grad (a parameter passed in), given as it is: its uses
    through the argument and through the module it also reads it from sum together."""
    history: list[bool] = dataclasses.field(default_factory=list)
    """Per argument: it had autograd history eagerly (not a leaf). The segment gets a view of its
    leaf, not the leaf: autocast caches its cast of a leaf that requires grad (one `_to_copy` for all
    uses, their gradients summed in the low precision) but casts an activation anew at every use (one
    gradient per use, each cast back and summed in the argument's own precision), as eagerly."""

    @classmethod
    def of(cls, given: list[torch.Tensor], reached: list[bool]) -> tuple[Arguments, list, list[bool]]:
        """At capture: the arguments, the buffers a replay reads, and which ones get a gradient (one
        tensor passed twice: its first place)."""
        same = [next(j for j in range(i + 1) if given[j] is t) for i, t in enumerate(given)]
        keep = [t.is_leaf and t.requires_grad and not t._backward_hooks for t in given]
        history = [not t.is_leaf for t in given]
        requires = [t.requires_grad and r for t, r in zip(given, reached)]
        for i, j in enumerate(same):
            if j != i:
                requires[j], requires[i] = requires[j] or requires[i], False
        buffers = [t if k else t.detach() for t, k in zip(given, keep)]
        return cls(same, keep, history), buffers, requires

    def leaves(self, buffers: list, requires: list[bool], differentiable: bool) -> list[torch.Tensor]:
        leaves: list[torch.Tensor] = []
        for i, (b, r) in enumerate(zip(buffers, requires)):
            if self.same[i] != i:
                leaves.append(leaves[self.same[i]])
            elif r and differentiable and not self.keep[i]:
                leaf = b.detach().requires_grad_(True)
                leaves.append(leaf.view_as(leaf) if self.history[i] else leaf)
            else:
                leaves.append(b)
        return leaves


def seeded(targets: list[torch.Tensor], seeds: list[list[torch.Tensor] | None]) -> tuple[list, list]:
    """In the segment's backward: views of the targets that have seeds, made now (after every node of
    the segment, so autograd runs them first), and their gradients: each target's seeds summed in the
    order autograd gave them, as its input buffer would have."""
    taps, grads = [], []
    for target, seed in zip(targets, seeds):
        if seed:
            total = seed[0]
            for more in seed[1:]:
                total = total + more
            with torch.enable_grad():  # (at capture this runs inside autograd's backward)
                taps.append(target.view_as(target))
            grads.append(total)
    return taps, grads
