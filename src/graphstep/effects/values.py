"""What a write changed, and how to put it back: the before-and-after of attributes, globals,
closure cells and containers that `writes.WriteWatch` compares, the census that tells objects made
before a capture from objects the step made, and the texts that name them in an error."""

from __future__ import annotations

import collections
import gc
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..guards.barriers import MISSING

_LIST_MUTATORS = frozenset(
    [
        "append",
        "extend",
        "insert",
        "pop",
        "remove",
        "clear",
        "sort",
        "reverse",
        "__setitem__",
        "__delitem__",
        "__iadd__",
        "__imul__",
    ]
)

_MUTATORS: dict[type, frozenset[str]] = {
    list: _LIST_MUTATORS,
    dict: frozenset(
        [
            "__setitem__",
            "__delitem__",
            "pop",
            "popitem",
            "setdefault",
            "update",
            "clear",
            "__ior__",
            "move_to_end",
        ]
    ),
    set: frozenset(
        [
            "add",
            "discard",
            "remove",
            "pop",
            "clear",
            "update",
            "difference_update",
            "intersection_update",
            "symmetric_difference_update",
            "__ior__",
            "__iand__",
            "__isub__",
            "__ixor__",
        ]
    ),
    collections.deque: frozenset(
        [
            "append",
            "appendleft",
            "extend",
            "extendleft",
            "pop",
            "popleft",
            "remove",
            "clear",
            "rotate",
            "insert",
            "__setitem__",
            "__delitem__",
            "__iadd__",
        ]
    ),
    bytearray: _LIST_MUTATORS - {"sort"},  # a list's, less sort
}
_mutator_cache: dict[type, frozenset[str]] = {}


def mutators(kind: type) -> frozenset[str]:
    """The mutating methods of a container type (by its builtin base); empty for anything else."""
    found = _mutator_cache.get(kind)
    if found is None:
        base = next((b for b in kind.__mro__ if b in _MUTATORS), None)
        found = _mutator_cache[kind] = _MUTATORS[base] if base is not None else frozenset()
    return found


# -- before and after ------------------------------------------------------------------------------


def attr_state(obj: Any, name: str) -> tuple[str, Any] | None:
    """Where `obj.name` lives and what it holds; None for an attribute a store computes (a property)."""
    if isinstance(obj, nn.Module):
        d = obj.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            entries = d.get(table)
            if entries is not None and name in entries:
                return table, entries[name]
        return "__dict__", d.get(name, MISSING)
    for klass in type(obj).__mro__:
        found = klass.__dict__.get(name)
        if found is not None and hasattr(type(found), "__set__"):
            if isinstance(found, types.MemberDescriptorType):  # a slot
                return "slot", getattr(obj, name, MISSING)
            return None  # a property: its setter's own writes are judged where they happen
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, (dict, types.MappingProxyType)):
        return None
    return "__dict__", d.get(name, MISSING)


def restore_attr(obj: Any, name: str, state: tuple[str, Any]) -> None:
    where, value = state
    if isinstance(obj, nn.Module):
        d = obj.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            d.get(table, {}).pop(name, None)
        d.pop(name, None)
        if value is not MISSING:
            (d if where == "__dict__" else d[where])[name] = value
    elif value is MISSING:
        if hasattr(obj, name):
            delattr(obj, name)
    else:
        setattr(obj, name, value)


def contents(container: Any) -> Any:
    if isinstance(container, dict):
        return list(container.items())
    if isinstance(container, bytearray):
        return bytes(container)
    return list(container)


PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)
"""Values compared by equality: a write of an equal one changes nothing."""


def same(a: Any, b: Any) -> bool:
    """`b` is `a`, or a plain value equal to it (a write of the value already there changes nothing:
    `self.scale = 0.5` again, `group["lr"] = group["lr"]`); NaN equals NaN."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, PLAIN):
        return a == b or (isinstance(a, float) and a != a and b != b)
    if isinstance(a, tuple) and len(a) == len(b) and len(a) <= 64:
        return all(same(x, y) for x, y in zip(a, b))
    return False


def unchanged(container: Any, was: Any) -> bool:
    if isinstance(container, dict):
        return len(container) == len(was) and all(same(v, dict.get(container, k, MISSING)) for k, v in was)
    if isinstance(container, bytearray):
        return bytes(container) == was
    if isinstance(container, (set, frozenset)):
        return len(container) == len(was) and all(x in container for x in was)
    return len(container) == len(was) and all(same(b, a) for a, b in zip(container, was))


def restore_contents(container: Any, was: Any) -> None:
    if isinstance(container, (dict, set, collections.deque)):
        container.clear()
        (container.extend if isinstance(container, collections.deque) else container.update)(was)
    else:  # list, bytearray
        container[:] = was


def described(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    if isinstance(obj, nn.Module):
        return f"a {type(obj).__name__} module"
    if isinstance(obj, (list, dict, set, collections.deque, bytearray)):
        return f"a {type(obj).__name__} of {len(obj)} item{'s' * (len(obj) != 1)}"
    return f"a {type(obj).__qualname__} object"


def shown(value: Any) -> str:
    if value is MISSING:
        return "(absent)"
    if isinstance(value, (int, float, bool, str, type(None))):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    return f"a {type(value).__qualname__}"


def undo_global(namespace: dict, name: str, before: Any) -> Callable[[], None]:
    def undo() -> None:
        if before is MISSING:
            namespace.pop(name, None)
        else:
            namespace[name] = before

    return undo


def undo_cell(cell: types.CellType, before: Any) -> Callable[[], None]:
    def undo() -> None:
        if before is MISSING:
            del cell.cell_contents
        else:
            cell.cell_contents = before

    return undo


def find_cell(code: types.CodeType, name: str, now: Any) -> types.CellType | None:
    """The cell in which a closure of `code` holds `name`, found by what it holds now."""
    index = code.co_freevars.index(name)
    for ref in gc.get_referrers(code):
        if isinstance(ref, types.FunctionType) and ref.__code__ is code and ref.__closure__:
            cell = ref.__closure__[index]
            if cell.cell_contents is now:
                return cell
    return None


class Census:
    """Which objects existed when a capture began (tensors left out: a write to a tensor is device work).

    The collector's generations tell: a collection of its two younger generations (`gc.collect(1)`,
    a few milliseconds: it walks only the objects made since the last full one) moves every object
    that survives it into the oldest, and whatever is made after lands in the youngest two. An object
    the collector tracks is new when it is there, or was there when a collection of its own moved it
    on (a callback notes those first), and old otherwise. Nothing is listed up front (a list of the
    process's 300,000 objects and a set of their ids cost a tiny GPT's capture 50-100 ms): a question
    looks among the newest objects first, then lists the young ones, a few thousand, when neither that
    nor the last listing answers it (an old object, asked about once). An
    object found old is held from then on, so that nothing made later takes its address. Where the
    collector does not empty its younger generations that way (a free-threaded build, a Python whose
    collector is incremental), the census is a set of the ids of all objects, which are held."""

    def __init__(self) -> None:
        self.taken = True
        """False once dropped: every object then counts as existing."""
        self._young: set[int] = set()
        """Ids of objects made since the census (as of the last listing)."""
        self._moved: set[int] = set()
        """Ids of objects made since the census that a collection moved into the oldest generation."""
        self._old: dict[int, Any] = {}
        """Objects found old, by id, held."""
        self._all: set[int] | None = None
        self._kept: list | None = None
        self._held: dict[int, tuple[Any, bool]] = {}
        gc.collect(1)
        self._by_generation = len(gc.get_objects(0)) + len(gc.get_objects(1)) < _YOUNG_AFTER_COLLECTING
        if self._by_generation:
            gc.callbacks.append(self._collecting)
        else:
            self._kept = [o for o in gc.get_objects() if type(o) not in _TENSOR_TYPES]  # held
            self._all = set(map(id, self._kept))

    def existed(self, obj: Any, *, thorough: bool = True) -> bool:
        """`obj` existed before the capture began, or is held by something that did (a plain dict that
        the collector did not track then: a dict holding only numbers is not tracked). The second costs
        one pass over the collector's objects, once per such dict; `thorough=False` leaves it out (a
        first look, where most objects written were made by the step)."""
        if not self.taken:
            return True
        if self._holds(obj):
            return True
        if type(obj) is not dict or not thorough:  # only a plain dict can have been left untracked
            return False
        cached = self._held.get(id(obj))
        if cached is None or cached[0] is not obj:
            held = any(r is not self._kept and self._holds(r) for r in gc.get_referrers(obj))
            cached = self._held[id(obj)] = (obj, held)
        return cached[1]

    def _holds(self, obj: Any) -> bool:
        key = id(obj)
        if self._all is not None:
            return key in self._all
        if key in self._old:
            return True
        if type(obj) in _TENSOR_TYPES or not gc.is_tracked(obj) or key in self._moved:
            return False
        if key not in self._young and not self._made_lately(obj):  # made after the last listing, or old
            self._young = _young_ids()
            if key not in self._young:
                self._old[key] = obj
                return True
        return False

    def _made_lately(self, obj: Any) -> bool:
        """`obj` is among the objects the youngest generation gained since the last listing (it keeps
        them in the order they were made: the newest last). Most objects a step writes were just made."""
        for young in reversed(gc.get_objects(0)):
            if young is obj:
                return True
            if id(young) in self._young:  # reached the last listing (or an address it knew, reused)
                return False
        return False

    def _collecting(self, phase: str, info: dict) -> None:
        if phase == "start" and info.get("generation", 2) >= 1:  # the young move into the oldest
            self._moved |= _young_ids()

    def drop(self) -> None:
        if self._by_generation:
            gc.callbacks.remove(self._collecting)
        self._by_generation = False
        self._young, self._moved, self._old, self._all, self._kept = set(), set(), {}, None, None
        self.taken = False
        self._held.clear()


def _young_ids() -> set[int]:
    # (`map` calls `id` from C: a profile function active meanwhile sees no call per object)
    return set(map(id, gc.get_objects(0))) | set(map(id, gc.get_objects(1)))


_YOUNG_AFTER_COLLECTING = 1000
"""Objects the younger two generations may hold just after `gc.collect(1)` for the census to go by
generation (they hold none where the collector works as described; another thread may add a few)."""

_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})
"""Left out of the census (subclasses are rare enough to keep: DTensor parameters live on anyway)."""
