"""A value snapshot of everything reachable from an object the step read, for `contents.py`.

`Walk.freeze(value)` turns a value into nested tuples that compare equal exactly when the contents
do: simple values by type and value, containers by their entries in order (sets unordered), objects
of data classes and the user's own classes by their attributes, config objects of libraries and
other Mappings and Sequences by their entries (configs.py), anything else by identity (ids of
objects the walk keeps alive). It also notes, for the per-replay check, each mutable container's
items as they are, so that a check can tell by identity alone that nothing changed.

What a walk compares by identity though it may hold numbers the step bakes in cannot be watched
(`opaque()`): named at capture, refused with `Config(strict_reads=True)`. `unchanging(obj)` marks an
object the user promises not to change between calls (compared by identity, never named).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import io
import logging
import numbers
import operator
import pathlib
import re
import sys
import types
import uuid
import weakref
from typing import Any

import torch
from torch import nn

from . import configs
from .barriers import MISSING, describe, is_simple
from .user_code import is_user_class

MAX_ENTRIES = 1_000
"""Entries (items, keys, attributes, at every depth) one root may hold; past it, it is not guarded."""

_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})
IDENTITY_OK = (
    torch.Tensor,
    nn.Module,
    torch.optim.Optimizer,
    torch.Generator,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    type,
    functools.partial,
)
"""Objects whose identity is all a graph depends on (their own state is guarded elsewhere, or is code)."""
_HARMLESS = (logging.Logger, logging.LoggerAdapter, re.Pattern, range, slice, io.IOBase, weakref.ref)
"""Library objects a step reads that hold no number a graph bakes in: compared by identity, not named."""
_IMMUTABLE = (numbers.Number, datetime.date, datetime.time, datetime.timedelta, pathlib.PurePath, uuid.UUID)
"""Values that cannot change in place (a Decimal, a NumPy scalar, a date): their identity is their
contents, so a binding compared by identity watches them whole; not named."""
_WATCH_OBJECT_DICTS = sys.version_info < (3, 13)
"""From Python 3.13 an ordinary object's attribute write can skip its materialised `__dict__`'s
watchers (inline values): those dicts are compared on every replay instead. SimpleNamespace keeps a
real dict and is watched."""


_UNCHANGING: dict[int, Any] = {}
"""id -> a callable giving the object back (a weak reference where it takes one), for `unchanging`."""


def unchanging(obj: Any) -> Any:
    """Mark `obj` as unchanging between calls of any captured step, and return it.

    The guards then compare it by identity only: they neither read its contents (a config object or
    container the step reads; a module's Python attributes) nor name it as an object they cannot see into, and
    `Config(strict_reads=True)` accepts it. Changing it between calls is then yours to avoid: a
    replay keeps what the capture read. An object that takes no weak reference is kept alive.
    """
    key = id(obj)
    try:
        _UNCHANGING[key] = weakref.ref(obj, lambda _, key=key: _UNCHANGING.pop(key, None))
    except TypeError:
        _UNCHANGING[key] = lambda: obj
    return obj


def is_unchanging(value: Any) -> bool:
    ref = _UNCHANGING.get(id(value)) if _UNCHANGING else None
    return ref is not None and ref() is value


def _is_fields(value: Any) -> bool:
    """Data objects guarded whole: SimpleNamespace, argparse.Namespace, dataclass, attrs and pydantic
    instances."""
    return (
        isinstance(value, types.SimpleNamespace)
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
        or configs.is_namespace(value)
        or configs.field_names(value) is not None
    )


def _slots(cls: type) -> tuple[str, ...]:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += (
            [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
        )
    return tuple(names)


def _attributes(value: Any, names: frozenset[str] | None) -> dict[str, Any] | None:
    """The attributes of a data object or a user object that are guarded (None: not such an object)."""
    declared = configs.field_names(value)
    if declared is not None:  # attrs, pydantic: the fields the class declares
        return {n: getattr(value, n, MISSING) for n in declared}
    if not (_is_fields(value) or is_user_class(type(value))):
        return None
    found = dict(vars(value)) if hasattr(value, "__dict__") else {}
    found.update((n, getattr(value, n, MISSING)) for n in _slots(type(value)))
    if names is not None and not _is_fields(value):
        found = {k: v for k, v in found.items() if k in names}
    return found


class TooLarge(Exception):
    pass


def _key(k: Any) -> Any:
    return ("v", type(k), k) if type(k) in _SCALARS else ("id", id(k))


class Walk:
    """One walk over a root: its frozen value, and the identity checks of its mutable containers."""

    def __init__(
        self, names: frozenset[str] | None, before: dict[int, Any], label: str, skip: set = frozenset()
    ):
        self.names = names
        self.before = before
        self.label = label
        self.skip = set(skip)
        """What the step wrote, left out: (id(dict), key) pairs and ids of lists, deques, sets."""
        self.entries = 0
        self.kept: list[Any] = []  # everything an id in `frozen` stands for stays alive
        self.seen: set[int] = set()
        self.dicts: list[tuple[dict, tuple, tuple]] = []  # whole dicts: keys and values in order
        self.seqs: list[tuple[Any, tuple]] = []  # lists, deques, sets: items in order
        self.subsets: list[tuple[Any, tuple, tuple]] = []  # (getter, keys, values): chosen keys only
        self.stores: list[tuple[tuple, str, tuple]] = []  # (dicts, name, values): config nodes' storage
        self.calls: list[Any] = []  # checks that read a config again (configs.py): True while it holds
        self.trees: dict[int, bool] = {}  # OmegaConf roots whose storage is compared (False: too large)
        self.watchable: list[dict] = []  # the dicts behind `dicts` and `subsets` (not their getters)
        self.opaque: list[tuple[str, Any]] = []
        self.found: list[tuple[str, Any]] = []  # modules and tensors inside containers
        self.written: list[str] = []

    def freeze(self, value: Any, path: str) -> Any:
        t = type(value)
        if t in _SCALARS:
            return ("v", t, value)
        if isinstance(value, IDENTITY_OK):
            if isinstance(value, (torch.Tensor, nn.Module)) and path:
                self.found.append((at(self.label, path), value))
            return self._identity(value)
        if value is MISSING:
            return ("v", None, None)
        if t is configs.Unreadable:
            return ("v", configs.Unreadable, value.error)
        i = id(value)
        if i in self.seen:
            return ("ref", i)
        if is_unchanging(value):
            return self._identity(value)
        if isinstance(value, dict):
            watch = not isinstance(value, collections.OrderedDict)  # move_to_end is no dict event
            return self._mapping(value, value, "d", path, whole=True, watch=watch)
        if isinstance(value, (list, collections.deque, tuple, set, frozenset)):
            return self._items(value, path)
        if is_simple(value):
            return ("v", t, value)
        view = configs.view(value)
        if view is not None:
            return self._config(value, view, path)
        attributes = _attributes(value, self.names)
        if attributes is not None:
            self.seen.add(i)
            self.kept.append(value)
            whole = _is_fields(value) or self.names is None
            if hasattr(value, "__dict__") and not _slots(t):
                watch = _WATCH_OBJECT_DICTS or isinstance(value, types.SimpleNamespace)
                return (
                    "o",
                    t,
                    self._mapping(vars(value), attributes, "a", path, whole=whole, watch=watch)[2],
                )
            return ("o", t, self._attribute_items(value, attributes, path))
        if _unseen(value):
            self.opaque.append((at(self.label, path), value))
        return self._identity(value)

    def _config(self, value: Any, view: configs.View, path: str) -> Any:
        """A config object, Mapping or Sequence, by the entries `configs.view` read from it."""
        self.seen.add(id(value))
        self.kept.append(value)
        self._count(len(view.entries))
        self._compare(view)
        self.calls += view.calls
        for root, check in view.trees:  # interpolations: the storage of their whole tree, once
            if id(root) not in self.trees:
                tree = configs.storage(root, MAX_ENTRIES)
                self.trees[id(root)] = tree is not None
                if tree is not None:
                    self.kept.append(root)
                    self._compare(tree)
            if not self.trees[id(root)]:
                self.calls.append(check)
        if view.tag == "s":
            return ("s", type(value), tuple(self.freeze(v, f"{path}[{k}]") for k, v in view.entries))
        items = tuple((_key(k), self.freeze(v, path + _step(k, view.tag))) for k, v in view.entries)
        return ("o" if view.tag == "a" else "d", type(value), items)

    def _compare(self, view: configs.View) -> None:
        """A replay's identity checks of a config's storage: its dicts, lists and node values."""
        for d in view.dicts:
            self.dicts.append((d, tuple(d), tuple(d.values())))
            self.watchable.append(d)
        by_name: dict[str, list[dict]] = {}
        for d, name in view.stores:
            by_name.setdefault(name, []).append(d)
        self.stores += [(tuple(ds), n, tuple(d.get(n, MISSING) for d in ds)) for n, ds in by_name.items()]
        self.seqs += [(c, tuple(c)) for c in view.seqs]

    def _identity(self, value: Any) -> Any:
        self.kept.append(value)
        return ("id", id(value))

    def _count(self, n: int) -> None:
        self.entries += n
        if self.entries > MAX_ENTRIES:
            raise TooLarge

    def _mapping(self, d: dict, chosen: dict, tag: str, path: str, *, whole: bool, watch: bool) -> Any:
        """A dict, or an object's `__dict__` (`chosen`: the attributes guarded)."""
        self.seen.add(id(d))
        self.kept.append(d)
        written = self._written_keys(d)
        self.written += [at(self.label, path + _step(k, tag)) for k in written]
        self.skip.update((id(d), k) for k in written)
        if any((id(d), k) in self.skip for k in chosen):
            chosen = {k: v for k, v in chosen.items() if (id(d), k) not in self.skip}
            whole = False
        self._count(len(chosen))
        if whole:
            self.dicts.append((d, tuple(d), tuple(d.values())))
        else:
            self.subsets.append((d.get, tuple(chosen), tuple(chosen.values())))
        if watch:
            self.watchable.append(d)
        items = tuple((_key(k), self.freeze(v, path + _step(k, tag))) for k, v in chosen.items())
        return (tag, type(d), items)

    def _attribute_items(self, obj: Any, chosen: dict, path: str) -> Any:
        """An object with `__slots__`: read attribute by attribute (no dict to watch)."""
        self._count(len(chosen))
        getter = functools.partial(getattr, obj)
        self.subsets.append((getter, tuple(chosen), tuple(chosen.values())))
        return tuple((_key(k), self.freeze(v, f"{path}.{k}")) for k, v in chosen.items())

    def _items(self, c: Any, path: str) -> Any:
        self.seen.add(id(c))
        self.kept.append(c)
        mutable = not isinstance(c, (tuple, frozenset))
        if mutable and id(c) in self.before and not _same_items(self.before[id(c)], tuple(c)):
            self.written.append(at(self.label, path))  # the step changed it: not guarded
            self.skip.add(id(c))
        if id(c) in self.skip:
            return ("id", id(c))
        self._count(len(c))
        items = tuple(c)
        if mutable:
            self.seqs.append((c, items))
        frozen = tuple(self.freeze(v, f"{path}[{i}]") for i, v in enumerate(items))
        if isinstance(c, (set, frozenset)):
            return ("set", type(c), frozenset(frozen))
        return ("s", type(c), frozen)

    def _written_keys(self, d: dict) -> list[Any]:
        was = self.before.get(id(d))
        if was is None:
            return []
        return [k for k in {**was, **d} if was.get(k, MISSING) is not d.get(k, MISSING)]


def at(label: str, path: str) -> str:
    """`global 'CFG' in train.py, at ['loss'].weight`."""
    return f"{label}, at {path}" if path else label


def _step(key: Any, tag: str) -> str:
    return f".{key}" if tag == "a" else f"[{key!r}]"


def _same_items(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def snapshot(value: Any, into: dict[int, Any], budget: int = MAX_ENTRIES) -> None:
    """Note, by id, the items of every container reachable from `value` (not yet noted), as they
    are now: a later walk tells by them which entries the step itself wrote in between."""
    stack = [value]
    while stack and budget > 0:
        v = stack.pop()
        if type(v) in _SCALARS or isinstance(v, IDENTITY_OK) or id(v) in into:
            continue
        if isinstance(v, (dict, list, collections.deque, set, tuple, frozenset)) and len(v) > budget:
            continue  # too large to guard anyway
        if isinstance(v, dict):
            into[id(v)] = (dict(v), v)
            children = list(v.values())
        elif isinstance(v, (list, collections.deque, set)):
            into[id(v)] = (tuple(v), v)
            children = list(v)
        elif isinstance(v, (tuple, frozenset)):
            children = list(v)
        elif hasattr(v, "__dict__") and (_is_fields(v) or is_user_class(type(v))):
            into[id(v.__dict__)] = (dict(vars(v)), v.__dict__)
            children = list(vars(v).values())
        else:
            continue
        budget -= len(children)
        stack += children


def _unseen(value: Any) -> bool:
    """An object a walk compares by identity that may hold numbers a graph bakes in: not code (a
    callable), not an inert library object (`_HARMLESS`) or a value that cannot change in place
    (`_IMMUTABLE`), not torch's own (its tensors are guarded as tensors; the rest is machinery:
    streams, process groups, GradScaler's settings), not marked `unchanging`."""
    module = getattr(type(value), "__module__", None) or ""
    return not (
        callable(value)
        or isinstance(value, (*_HARMLESS, *_IMMUTABLE))
        or module == "torch"
        or module.startswith("torch.")
        or is_unchanging(value)
    )


def opaque(value: Any) -> bool:
    """Unwatchable: an object a step reads that may hold numbers, but whose contents no guard reads.
    Not so: simple values (compared by value), tensors, modules, optimizers, generators, functions and
    classes (`IDENTITY_OK`: their state is guarded elsewhere, or is code), what a walk reads by content
    (`walkable`), and what `_unseen` leaves out. Such as: an object of a library class that is no
    config (configs.py), an object of a C type without a `__dict__`, a NumPy array, a `bytearray`."""
    return not (
        type(value) in _SCALARS
        or value is MISSING
        or isinstance(value, IDENTITY_OK)
        or is_simple(value)
        or walkable(value, None)
    ) and _unseen(value)


def is_data(value: Any) -> bool:
    """A data object (SimpleNamespace, dataclass, attrs, pydantic, argparse.Namespace) or a library's
    config object (OmegaConf, ml_collections): guarded whole, wherever it is held (a module's
    attribute read by a library's forward, say)."""
    return _is_fields(value) or configs.kind(value) in ("omegaconf", "ml_collections")


def walkable(value: Any, names: frozenset[str] | None) -> bool:
    if type(value) in _SCALARS or isinstance(value, IDENTITY_OK) or is_simple(value) or is_unchanging(value):
        return False
    if isinstance(value, (dict, list, collections.deque, tuple, set, frozenset)):
        return True
    return _is_fields(value) or is_user_class(type(value)) or configs.kind(value) is not None


def _shown(frozen: Any) -> str:
    tag = frozen[0]
    if tag == "v":
        if frozen[1] is configs.Unreadable:
            return f"unreadable ({frozen[2]})"
        return describe(MISSING) if frozen[1] is None else describe(frozen[2])
    if tag in ("id", "ref"):
        return "another object"
    return f"a {frozen[1].__qualname__} of {len(frozen[2])} entries"


def diff(was: Any, now: Any, path: str):
    """(path, text, is_value_change) for each place where two frozen values differ."""
    if was == now:
        return
    tag = was[0]
    if tag != now[0] or tag in ("v", "id", "ref", "set") or was[1] is not now[1]:
        value = (tag == "v" and now[0] == "v") or tag == now[0] == "set"
        yield (path, f"{_shown(was)} -> {_shown(now)}", value)
        return
    if tag == "s":
        if len(was[2]) != len(now[2]):
            yield (path, f"{len(was[2])} entries -> {len(now[2])}", True)
            return
        for i, (a, b) in enumerate(zip(was[2], now[2])):
            yield from diff(a, b, f"{path}[{i}]")
        return
    old, new = dict(was[2]), dict(now[2])
    for key in {**old, **new}:
        step = (f".{key[2]}" if tag == "o" else f"[{key[2]!r}]") if key[0] == "v" else "[?]"
        yield from diff(old.get(key, _ABSENT), new.get(key, _ABSENT), path + step)


_ABSENT = ("v", None, None)
