"""What the step reads *inside* containers: their contents, as a graph saw them, and the check that
they still are.

A binding guard (reads.py) sees that `CFG` still refers to the same dict; it cannot see
`CFG["smoothing"] = 0.2`, `LOSS_WEIGHTS[0] = 0.25` or `cfg.loss.weight = 0.5`, and a replay would
keep the old number. `Contents` takes, at capture, a value snapshot of everything reachable from a
value the step read (a *root*: a global, a closure cell, a default argument, a module's attribute,
a non-tensor argument) through lists, tuples, dicts, sets, deques, `SimpleNamespace`, dataclass
instances, objects of the user's own classes and config objects of libraries (OmegaConf,
ml_collections, pydantic, attrs, argparse, any Mapping or Sequence: configs.py), to any depth, and
checks before each replay that it still holds: numbers, strings and other simple values by value
(and type), tensors, modules, functions and other objects by identity. A root whose value changed
picks a graph variant (or captures one); a value changed back picks the old graph again.

Which attributes of an object of the user's own class are guarded: those whose names the user's
code that ran loads (`obj.weight`), so that a counter the training loop keeps on the same object
(`trainer.step += 1`) does not capture a graph per call. Dicts, lists and sets are guarded whole
(a key read through a variable cannot be told from one that is not read): an unrelated entry that
changes every call costs a capture every call, and the log says which.

Entries the step itself writes during the capture (a dict key it sets, a list it appends to) are
left out and reported as written (a replay does not write them; see `snapshot`).

Cost per replay: nothing for dicts (object attributes included) from Python 3.12 while none of them
changed, when the C++ helper is built (PEP 699 dict watchers, `fastcheck.py`); otherwise, and for
lists, sets and deques, one identity pass over each container's items in C (`map(operator.is_)`).
Only after a change is a root walked again and compared by value; an equal value is adopted. Config
objects read through their protocol (configs.py) add a check per replay that reads them again; a
read that builds a new object each time (not a number or string) walks its root again on every replay.

Not guarded, and named once in a log line at capture (refused with `Config(strict_reads=True)`): a
root of more than `MAX_ENTRIES` entries, and objects graphstep cannot see into (walk.py's `opaque`:
instances of library classes that are no config, NumPy arrays, bytearrays).
Also not seen: class attributes read through an instance, an object's `__dict__` replaced
wholesale, and `OrderedDict.move_to_end` (an order change without a dict event) from Python 3.12.
"""

from __future__ import annotations

import functools
import itertools
import operator
import types
from typing import Any

from . import fastcheck
from .barriers import MISSING, cell_value
from .walk import IDENTITY_OK, MAX_ENTRIES, TooLarge, Walk, at, diff, is_data, opaque, snapshot, walkable

__all__ = ["IDENTITY_OK", "MAX_ENTRIES", "Contents", "is_data", "opaque", "snapshot", "walkable"]


class _Root:
    """One value the step read, and what its walk found."""

    __slots__ = ("frozen", "label", "value", "walk")

    def __init__(self, label: str, value: Any, walk: Walk, frozen: Any):
        self.label, self.value, self.walk, self.frozen = label, value, walk, frozen


class Contents:
    """The contents of the containers a step read, as a graph saw them.

    `names`: the attribute names the user's code loads (objects of user classes are guarded on those
    only; None: all). `before`: `snapshot()`s taken before the step ran (written entries are left out).
    """

    def __init__(self, names: frozenset[str] | None = None, before: dict[int, Any] | None = None):
        self.names = names
        self.before = {k: v[0] for k, v in (before or {}).items()}
        self.roots: list[_Root] = []
        self.bound: list[tuple[_Root, dict, str]] = []  # roots read from a namespace: (root, ns, name)
        self.cells: list[tuple[_Root, types.CellType]] = []
        self.unguarded: list[str] = []
        self.written: list[str] = []
        self.found: list[tuple[str, Any]] = []
        self._ids: set[int] = set()
        helper = fastcheck.helper()
        self._watch_type = (
            getattr(helper, "DictWatch", None) if getattr(helper, "watches_dicts", False) else None
        )
        self._index()

    # -- building ---------------------------------------------------------------------------------

    def add(
        self,
        label: str,
        value: Any,
        *,
        ns: dict | None = None,
        name: str = "",
        cell: Any = None,
        site: str = "",
    ) -> bool:
        """Guard the contents of `value` (read through `ns[name]` or `cell`, if given: a rebinding
        to an equal value is adopted). False: compare the binding by identity instead (`value` is no
        container, or another root guards its contents already). `site`: the user's line that read
        it, for what cannot be guarded."""
        if not walkable(value, self.names) or id(value) in self._ids:
            return False
        walk = Walk(self.names, self.before, label)
        read_at = f"; read at {site}" if site else ""
        try:
            frozen = walk.freeze(value, "")
        except TooLarge:
            self.unguarded.append(
                f"{label} ({type(value).__qualname__}): more than {MAX_ENTRIES} entries{read_at}"
            )
            return False
        self.unguarded += [
            f"{where} ({type(obj).__qualname__}): graphstep cannot see into it{read_at}"
            for where, obj in walk.opaque
        ]
        self.written += walk.written
        self.found += walk.found
        root = _Root(label, value, walk, frozen)
        self.roots.append(root)
        self._ids.add(id(value))
        if ns is not None:
            self.bound.append((root, ns, name))
        elif cell is not None:
            self.cells.append((root, cell))
        self._index_root(root)
        return True

    def _index(self) -> None:
        """The flat lists `holds()` runs over, from every root's walk (again, after an adoption)."""
        self.watch = None
        self.dicts, self.seqs, self.subsets, self.watched_dicts, self.watched_subsets = [], [], [], [], []
        self.stores: list[tuple[_Root, tuple, str, tuple]] = []
        self.calls: list[tuple[_Root, Any]] = []
        for root in self.roots:
            self._index_root(root)

    def _index_root(self, root: _Root) -> None:
        w = root.walk
        if self.watch is None and self._watch_type is not None and w.watchable:
            self.watch = self._watch_type()
        watch = self.watch
        watched = {id(d) for d in w.watchable if watch is not None and watch.watch(d)}
        for d, keys, values in w.dicts:
            (self.watched_dicts if id(d) in watched else self.dicts).append((root, d, keys, values))
        for get, keys, values in w.subsets:
            owner = getattr(get, "__self__", None)  # the dict of `dict.get`; None for a getattr
            into = self.watched_subsets if id(owner) in watched else self.subsets
            into.append((root, get, keys, values))
        self.seqs += [(root, c, items) for c, items in w.seqs]
        self.stores += [(root, *store) for store in w.stores]
        self.calls += [(root, call) for call in w.calls]

    # -- the check on every replay ------------------------------------------------------------

    def holds(self) -> bool:
        for root, ns, name in self.bound:
            now = ns.get(name, MISSING)
            if now is not root.value and not self._adopt(root, now):
                return False
        for root, cell in self.cells:
            now = cell_value(cell)
            if now is not root.value and not self._adopt(root, now):
                return False
        settled: set[int] = set()
        if not self._settle(False, settled):
            return False
        watch = self.watch
        if watch is not None and watch.changed():
            if not self._settle(True, settled):
                return False
            self.watch.clear()  # (a new watch, where a root was adopted)
        return True

    def _settle(self, watched: bool, settled: set[int]) -> bool:
        """Each container (of the watched dicts, or of the others) is what the graph saw: where one
        is not, its root is walked again, and adopted where equal by value; else False. A root adopted
        is not checked again in this call: a read that builds a new object each time (a config's
        computed entry) would fail its identity check again, though its value is equal."""
        while True:
            if watched:
                root = _changed(self.watched_dicts, self.watched_subsets, (), (), (), settled)
            else:
                root = _changed(self.dicts, self.subsets, self.seqs, self.stores, self.calls, settled)
            if root is None:
                return True
            if not self._adopt(root, root.value):
                return False
            settled.add(id(root))  # the lists were renewed: the loop checks the rest again

    def _adopt(self, root: _Root, now: Any) -> bool:
        walk = Walk(self.names, {}, root.label, root.walk.skip)
        try:
            frozen = walk.freeze(now, "")
        except TooLarge:
            return False
        if frozen != root.frozen:
            return False
        walk.written = root.walk.written
        root.value, root.walk = now, walk
        self._ids = {id(r.value) for r in self.roots}
        self._index()
        return True

    def identities(self) -> list | None:
        """`holds()`'s common case as `fastcheck` entries: every root and container item still the
        object seen and no watched dict changed (None: a part only the Python loop reads right)."""
        out: list = []
        for root, ns, name in self.bound:
            if type(ns) is not dict:
                return None
            out.append((fastcheck.ITEM, ns, name, root.value))
        out += [(fastcheck.CELL, cell, root.value, None) for root, cell in self.cells]
        for _, d, keys, values in self.dicts:
            if type(d) is not dict:  # an OrderedDict's order is its own, not the dict's
                return None
            out.append((fastcheck.DICT, d, keys, values))
        for _, get, keys, values in self.subsets:
            owner = getattr(get, "__self__", None)
            if type(owner) is dict and get == owner.get:
                out += [(fastcheck.ITEM, owner, k, v) for k, v in zip(keys, values)]
            elif isinstance(get, functools.partial) and get.func is getattr and len(get.args) == 1:
                out += [(fastcheck.ATTR, get.args[0], k, v) for k, v in zip(keys, values)]
            else:
                return None
        out += [(fastcheck.ITEMS, c, items, None) for _, c, items in self.seqs]
        for _, dicts, name, values in self.stores:
            out += [(fastcheck.ITEM, d, name, v) for d, v in zip(dicts, values)]
        out += [(fastcheck.TRUE, call, None, None) for _, call in self.calls]
        if self.watch is not None:
            out.append((fastcheck.FALSE, self.watch.changed, None, None))
        return out

    # -- the slow path ----------------------------------------------------------------------------

    def changes(self) -> list[tuple[str, bool]]:
        """(text, is_value_change) per root that differs from what the graph saw."""
        found = []
        current = {id(root): root.value for root in self.roots}
        current.update((id(root), ns.get(name, MISSING)) for root, ns, name in self.bound)
        current.update((id(root), cell_value(cell)) for root, cell in self.cells)
        moved = self._moved(current)
        for root in self.roots:
            if id(root) not in moved:  # every object of it is the one seen: its walk would be equal
                continue
            walk = Walk(self.names, {}, root.label, root.walk.skip)
            try:
                frozen = walk.freeze(current[id(root)], "")
            except TooLarge:
                found.append((f"{root.label}: now holds more than {MAX_ENTRIES} entries", False))
                continue
            if frozen != root.frozen:
                diffs = [
                    (f"{at(root.label, path)}: {text}", value)
                    for path, text, value in diff(root.frozen, frozen, "")
                ]
                found += diffs[:5] or [(f"{root.label}: its contents changed", False)]
        return found

    def _moved(self, current: dict[int, Any]) -> set[int]:
        """Ids of the roots that are not, object for object, what `holds()` last saw (only those are
        walked again: a loop's counter beside a long schedule list costs no walk of the list)."""
        moved = {id(root) for root in self.roots if current[id(root)] is not root.value}
        lists = (
            self.dicts + self.watched_dicts,
            self.subsets + self.watched_subsets,
            self.seqs,
            self.stores,
            self.calls,
        )
        while (root := _changed(*lists, moved)) is not None:  # each check kind, as `holds()` runs it
            moved.add(id(root))
        return moved

    def describe(self) -> list[str]:
        return [
            f"{r.label}: {type(r.value).__qualname__}, {r.walk.entries} entries by content"
            for r in self.roots
        ]


def _changed(
    dicts: list, subsets: list, seqs: list, stores: list, calls: list, settled: set[int]
) -> _Root | None:
    """The root of the first container whose entries are not the objects seen last (or of a config
    check that fails), if any; roots in `settled` were just adopted and are passed over."""
    is_ = operator.is_
    for root, d, keys, values in dicts:
        same = len(d) == len(keys) and all(map(is_, d.values(), values)) and all(map(is_, d, keys))
        if not same and id(root) not in settled:
            return root
    for root, get, keys, values in subsets:
        if not all(map(is_, map(get, keys, itertools.repeat(MISSING)), values)) and id(root) not in settled:
            return root
    for root, c, items in seqs:
        if (len(c) != len(items) or not all(map(is_, c, items))) and id(root) not in settled:
            return root
    for root, dicts, name, values in stores:
        now = map(dict.get, dicts, itertools.repeat(name), itertools.repeat(MISSING))
        if not all(map(is_, now, values)) and id(root) not in settled:
            return root
    for root, call in calls:
        if not call() and id(root) not in settled:
            return root
    return None
