"""The Python values an optimizer's `step()` changes: what decides, for any optimizer from any
package, whether its step can live in a graph.

A graph replays the kernels a step launched, never its Python. An optimizer that keeps a step count,
a bias correction or a running maximum as a Python number (`group["k"] += 1` in schedule-free,
`group["step"] += 1` in timm's Lamb and in pytorch-optimizer) would have that number frozen at its
capture value by every replay, and train silently wrong. So graphstep watches each optimizer's step
during warm-up: a step that changes a Python value in its param groups, its `state` or its own
attributes (a wrapped optimizer's too), or creates a number there, runs as an eager segment between
graph replays (`modes.py`); one that keeps every per-step value in device tensors stays in the graph.

What is compared: numbers, flags, strings and None, inside dicts, lists and tuples (bounded), and
host tensors when the graph runs on a GPU (a CPU step count beside CUDA parameters is host state too,
MADGRAD's `state["k"]`). Device tensors are left out: the graph updates them. Values a step creates are
compared only when they are numbers in param groups or state (a first step makes its state lazily; a
flag torch sets once, such as a warning already given, is no per-step value).

Also seen: a step that keeps a parameter's `.grad` in its state by reference (timm 1.0.29's Mars keeps
`state["last_grad"] = grad`). Eagerly every step's gradient is a new tensor, so the reference holds the
last one; a graph writes every step's gradient into one buffer, so it would follow the new one. Such a
step runs as an eager segment handed a copy of each gradient (`backends/segments.py`). The capture is
watched the same way, so that a step that stops a capture can be moved and the step captured again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..state import holders

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MOST_ITEMS = 64
"""Containers and host tensors larger than this are not compared (a step count is small)."""
_DEPTH = 4
_OWN = frozenset({"state", "param_groups", "defaults"})
"""Attributes of `torch.optim.Optimizer` that are compared through their own paths, or never change."""


def values(opt: Any, *, host_tensors: bool) -> dict[str, Any]:
    """Every Python value of `opt` that a step could change, by a path that names it."""
    found: dict[str, Any] = {}
    _optimizer(opt, "", found, host_tensors, depth=0)
    return found


def _optimizer(opt: Any, prefix: str, found: dict, host_tensors: bool, depth: int) -> None:
    params = {
        id(p): i for i, p in enumerate(p for g in getattr(opt, "param_groups", ()) for p in g["params"])
    }
    for i, group in enumerate(getattr(opt, "param_groups", ())):
        for key, value in group.items():
            if key != "params":
                _collect(f"{prefix}param_groups[{i}][{key!r}]", value, found, host_tensors, 0)
    for param, entries in getattr(opt, "state", {}).items():
        if isinstance(entries, dict):
            where = f"{prefix}state[param {params.get(id(param), '?')}]"
            for key, value in entries.items():
                _collect(f"{where}[{key!r}]", value, found, host_tensors, 0)
        else:  # a value of the optimizer's own beside its parameters' (MADGRAD's state["k"])
            _collect(
                f"{prefix}state[{param!r}]" if isinstance(param, str) else f"{prefix}state[?]",
                entries,
                found,
                host_tensors,
                0,
            )
    for name, value in vars(opt).items():
        if name in _OWN:
            continue
        if isinstance(value, torch.optim.Optimizer) and depth < 2:  # a wrapper's inner optimizer
            _optimizer(value, f"{prefix}{name}.", found, host_tensors, depth + 1)
        else:
            _collect(f"{prefix}{name}", value, found, host_tensors, 0)


def _collect(path: str, value: Any, found: dict, host_tensors: bool, depth: int) -> None:
    if isinstance(value, _PLAIN):
        found[path] = value
    elif isinstance(value, torch.Tensor):
        if host_tensors and value.device.type == "cpu" and value.numel() <= _MOST_ITEMS:
            found[path] = value.detach().clone()
    elif depth < _DEPTH and isinstance(value, (list, tuple)) and len(value) <= _MOST_ITEMS:
        for i, item in enumerate(value):
            _collect(f"{path}[{i}]", item, found, host_tensors, depth + 1)
    elif depth < _DEPTH and isinstance(value, dict) and len(value) <= _MOST_ITEMS:
        for key, item in value.items():
            _collect(f"{path}[{key!r}]", item, found, host_tensors, depth + 1)


def grad_references(opt: Any) -> list[str]:
    """Paths of `opt.state` tensors that share storage with a parameter's `.grad` (timm 1.0.29's Mars
    keeps `state["last_grad"] = grad`): eagerly each step's gradient is a new tensor, so the reference
    keeps the last one; a graph reuses one buffer, so the reference would see the new gradient."""
    params = [p for g in getattr(opt, "param_groups", ()) for p in g["params"]]
    grads = set().union(*(_memory(p.grad) for p in params if p.grad is not None))
    index = {id(p): i for i, p in enumerate(params)}
    found = []
    for param, entries in getattr(opt, "state", {}).items():
        for key, value in entries.items() if isinstance(entries, dict) else ():
            if isinstance(value, torch.Tensor) and _memory(value) & grads:
                found.append(f"state[param {index.get(id(param), '?')}][{key!r}]")
    return found


def _memory(t: torch.Tensor) -> set[int]:
    """Data pointers of the storages holding a strided tensor's elements: a DTensor's (FSDP2, tensor
    parallel) are its local shard's, as a wrapper subclass has no storage of its own; none for an
    empty one (freed shards share pointer 0)."""
    if t.layout != torch.strided or not t.numel():
        return set()
    pointers = {h.untyped_storage().data_ptr() for h in holders(t)}
    pointers.discard(0)
    return pointers


def same(a: Any, b: Any) -> bool:
    """Equal as a step would read them (NaN equals NaN; a host tensor by its values and dtype)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a, b) or bool(
            a.is_floating_point()
            and torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))
            and torch.equal(a.isnan(), b.isnan())
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`path: before -> after` for each value the step changed, and each number it created in its
    param groups or state."""
    found = []
    for path, now in after.items():
        was = before.get(path, _ABSENT)
        if was is _ABSENT:
            created_number = isinstance(now, (int, float)) and not isinstance(now, bool)
            if created_number and _in_groups_or_state(path):
                found.append(f"{path}: (absent) -> {_shown(now)}")
        elif not same(was, now):
            found.append(f"{path}: {_shown(was)} -> {_shown(now)}")
    return found


def _in_groups_or_state(path: str) -> bool:
    tail = path.rsplit(".", 1)[-1]
    return tail.startswith(("param_groups[", "state["))


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a host tensor {value.tolist() if value.numel() <= 4 else list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_ABSENT = object()


@dataclasses.dataclass
class Observed:
    """One optimizer's last step seen in warm-up: the Python values it changed, and its host time."""

    changes: list[str]
    seconds: float
    during: str
    """Which call it was seen in ("the last warm-up", "the capture")."""
    grad_references: list[str] = dataclasses.field(default_factory=list)
    """Paths of state tensors that are a parameter's `.grad` after the step (kept by reference)."""


class StepObserver:
    """Watches the `step()` of optimizers while it is entered (warm-ups, explain's dry run) through
    torch's per-optimizer step hooks: which Python values each step changed, and how long it took on
    the host. `seen` keeps the last step of each optimizer, by id."""

    def __init__(self, *, host_tensors: bool):
        self.host_tensors = host_tensors
        self.seen: dict[int, Observed] = {}
        self._pending: dict[int, tuple[dict[str, Any], float]] = {}
        self.interrupted: list[torch.optim.Optimizer] = []
        """The optimizers whose step raised inside the last `watching` (their post-hook never ran)."""
        self.during = "the last warm-up"

    @contextmanager
    def watching(
        self, optimizers: Iterable[torch.optim.Optimizer], during: str = "the last warm-up"
    ) -> Iterator[StepObserver]:
        """Observe the steps of `optimizers` while inside; `during` names the call in log lines."""
        optimizers = list(optimizers)
        self.during = during
        handles, wrapped = [], []
        for opt in optimizers:
            if hasattr(opt, "_optimizer_step_pre_hooks"):
                handles.append(opt.register_step_pre_hook(self._before))
                handles.append(opt.register_step_post_hook(self._after))
            else:  # a wrapper that never ran `Optimizer.__init__`: no hooks, so its bound step is wrapped
                wrapped.append((opt, opt.__dict__.get("step")))
                opt.step = functools.partial(self._observed, opt, opt.step)
        self._pending = {}
        self.interrupted = []
        try:
            yield self
        finally:
            # A step that raised (a host sync while capturing) left its entry behind.
            self.interrupted = [opt for opt in optimizers if id(opt) in self._pending]
            for handle in handles:
                handle.remove()
            for opt, before in wrapped:
                if before is None:
                    opt.__dict__.pop("step", None)
                else:
                    opt.step = before
            self._pending = {}

    def _observed(self, opt: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        self._before(opt, args, kwargs)
        result = step(*args, **kwargs)
        self._after(opt, args, kwargs)
        return result

    def _before(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._pending[id(opt)] = (values(opt, host_tensors=self.host_tensors), time.perf_counter())

    def _after(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        started = self._pending.pop(id(opt), None)
        if started is None:
            return
        before, start = started
        seconds = time.perf_counter() - start
        after = values(opt, host_tensors=self.host_tensors)
        self.seen[id(opt)] = Observed(changes(before, after), seconds, self.during, grad_references(opt))

    def keeps_grads(self, opt: torch.optim.Optimizer) -> bool:
        """`opt`'s last observed step kept a parameter's `.grad` in its state by reference."""
        observed = self.seen.get(id(opt))
        return observed is not None and bool(observed.grad_references)

    def reason(self, opt: torch.optim.Optimizer) -> str | None:
        """Why `opt`'s step cannot be in a graph, from its last observed step, or None."""
        observed = self.seen.get(id(opt))
        if observed is None:
            return None
        if observed.grad_references:
            return (
                f"its step keeps a gradient by reference ({', '.join(observed.grad_references[:3])} is a "
                "parameter's .grad): a graph writes every step's gradients into the same buffers, so the kept "
                "one would follow them; as an eager segment it is handed a copy of each gradient, as eager's "
                "fresh gradients are"
            )
        if not observed.changes:
            return None
        listed = observed.changes[:4] + (
            [f"... {len(observed.changes) - 4} more"] if len(observed.changes) > 4 else []
        )
        return (
            "its step() changes Python values it keeps, which a graph would freeze at their capture values: "
            + "; ".join(listed)
            + f" (its step took {observed.seconds * 1e3:.2f} ms on the host in {observed.during}; as an eager "
            "segment it runs on every call)"
        )
