"""`ReadGuard`: the values the step's Python read (see reads.py), as a graph saw them, and the check
on every replay that they still are: bindings by identity (then by value for simple values), the
containers and config objects they hold by content (contents.py, configs.py).

What no guard can watch (walk.py's `opaque`: an object the guard compares by identity though its
contents may hold a number the graph bakes in; a container past `MAX_ENTRIES`) is named with the
user's line that read it: in one warning at capture, or, with `Config(strict_reads=True)`, in an
`UnwatchedReadError` that fails the capture.
"""

from __future__ import annotations

import itertools
import logging
import operator
from typing import Any

from ..errors import UnwatchedReadError
from . import contents, fastcheck
from .barriers import MISSING, cell_value, change, is_simple
from .reads import Reads, site

log = logging.getLogger("graphstep")

_cell_contents = operator.attrgetter("cell_contents")

_named: set[str] = set()
"""What `report_unwatched` has named in this process (each is named once)."""


class ReadGuard:
    """The values behind a `Reads`, as they are now, and the check that they still are.

    Bindings (a global, a closure cell) are compared by value where they hold a simple value, else
    by identity; containers and data objects they hold, by content (see contents.py), and so are
    containers in default arguments, in the step's arguments and in attributes user code loads.
    `owners`: names for modules by id (`model.encoder`), to label their attributes.
    """

    def __init__(self, reads: Reads, owners: dict[int, str] | None = None):
        self.contents = contents.Contents(reads.attribute_names, reads.before)
        sites = {key: site(*where) for key, where in reads.sites.items()}
        self.globals = []
        for label, ns, name in reads.globals:
            value = ns.get(name, MISSING)
            if not self.contents.add(label, value, ns=ns, name=name, site=sites.get(label, "")):
                self.globals.append((label, ns, name, value, is_simple(value)))
        self.cells = []
        for label, cell in reads.cells:
            value = cell_value(cell)
            if not self.contents.add(label, value, cell=cell, site=sites.get(label, "")):
                self.cells.append((label, cell, value, is_simple(value)))
        owners = owners or {}
        for owner, name in reads.attributes:
            where = owners.get(id(owner)) or f"a {type(owner).__qualname__}"
            value = vars(owner).get(name, MISSING)
            read_at = sites.get((id(owner), name), "")
            self.contents.add(f"{where}.{name}", value, ns=vars(owner), name=name, site=read_at)
        for label, value in reads.defaults + reads.arguments:
            self.contents.add(label, value)
        self.contents.before = {}  # its ids are valid only while `reads` keeps the objects alive
        self._index_bindings()
        self.modules = reads.modules
        self.unguarded = [
            f"{label} ({type(value).__qualname__}): graphstep cannot see into it"
            + (f"; read at {sites[label]}" if label in sites else "")
            for label, value in self.objects() + reads.opaque
            if contents.opaque(value)
        ]

    def objects(self) -> list[tuple[str, Any]]:
        """The values read through bindings (globals, closure cells), content-guarded ones too."""
        return (
            [(label, value) for label, _, _, value, _ in self.globals]
            + [(label, value) for label, _, value, _ in self.cells]
            + [(root.label, root.value) for root in self.contents.roots]
        )

    def reached(self) -> list[tuple[str, Any]]:
        """`objects()`, and the modules and tensors found inside the containers read."""
        return self.objects() + self.contents.found + [(type(m).__qualname__, m) for m in self.modules]

    @property
    def written(self) -> list[str]:
        """Entries of containers the step itself wrote during the watched run (left out)."""
        return self.contents.written

    def watch_fields(self, label: str, value: Any) -> None:
        """Guard a data object held by a module (a config dataclass kept as `self.config`) by content:
        nothing else sees a write to its fields."""
        if contents.is_data(value):
            self.contents.add(label, value)

    @property
    def unwatched(self) -> list[str]:
        """What the step reads that no guard can watch, each with where it was read."""
        return self.unguarded + self.contents.unguarded

    def report_unwatched(self, step: str, *, strict: bool) -> None:
        """Name what the step reads that no guard can watch: in one warning (each object once per
        process), or, when `strict` (`Config.strict_reads`), in an `UnwatchedReadError`."""
        if strict and self.unwatched:
            raise UnwatchedReadError(unwatched_message(step, self.unwatched))
        new = [u for u in self.unwatched if u not in _named]
        if new:
            _named.update(new)
            log.warning(
                "graphstep: %s reads values whose contents no guard watches; a change to them between "
                "calls is not seen by the graph (Config(strict_reads=True) makes this an error):\n%s",
                step,
                "\n".join(f"  - {u}" for u in new),
            )

    def _index_bindings(self) -> None:
        """The bindings as parallel lists, for `holds()`'s identity pass in C loops (None: a globals
        namespace that is not a plain dict, which only the per-binding loop reads right)."""
        plain = all(type(ns) is dict for _, ns, _, _, _ in self.globals)
        self._namespaces = [ns for _, ns, _, _, _ in self.globals] if plain else None
        self._names = [name for _, _, name, _, _ in self.globals]
        self._cells = [cell for _, cell, _, _ in self.cells]
        self._values = [value for _, _, _, value, _ in self.globals] + [
            value for _, _, value, _ in self.cells
        ]

    def holds(self) -> bool:
        if self._namespaces is not None:
            try:
                now = list(map(dict.get, self._namespaces, self._names, itertools.repeat(MISSING)))
                now += map(_cell_contents, self._cells)
            except ValueError:  # an emptied closure cell
                return False
            if all(
                map(operator.is_, now, self._values)
            ):  # the common replay: every binding is the object seen
                return not self.contents.roots or self.contents.holds()
        return self._holds_by_value()

    def identities(self) -> list | None:
        """`holds()`'s identity pass as `fastcheck` entries (None: a namespace that is not a plain
        dict, or contents only the Python loop reads)."""
        if self._namespaces is None:
            return None
        n = len(self._names)
        out = [
            (fastcheck.ITEM, ns, name, v) for ns, name, v in zip(self._namespaces, self._names, self._values)
        ]
        out += [(fastcheck.CELL, cell, v, None) for cell, v in zip(self._cells, self._values[n:])]
        contents = self.contents.identities() if self.contents.roots else []
        return None if contents is None else out + contents

    def _holds_by_value(self) -> bool:
        """The per-binding loop: a simple value rebound to an equal one (`LR = 1e-3` again) holds,
        and the equal objects are adopted, so the next identity pass holds again."""
        rebound = False
        for _, ns, name, value, by_value in self.globals:
            now = ns.get(name, MISSING)
            if now is not value:
                if not (by_value and type(now) is type(value) and now == value):
                    return False
                rebound = True
        for _, cell, value, by_value in self.cells:
            try:
                now = cell.cell_contents
            except ValueError:
                return False
            if now is not value:
                if not (by_value and type(now) is type(value) and now == value):
                    return False
                rebound = True
        if rebound:  # adopt the equal objects (a namespace that is not a plain dict comes here every call)
            self.globals = [
                (label, ns, name, ns.get(name, MISSING), v) for label, ns, name, _, v in self.globals
            ]
            self.cells = [(label, cell, cell.cell_contents, v) for label, cell, _, v in self.cells]
            self._index_bindings()
        return not self.contents.roots or self.contents.holds()

    def changes(self) -> list[tuple[str, bool]]:
        """(text, is_value_change) per difference."""
        return self.binding_changes() + self.contents.changes()

    def binding_changes(self) -> list[tuple[str, bool]]:
        """`changes()` of the globals and closure cells alone (not the contents of containers)."""
        current = [
            (label, ns.get(name, MISSING), value, by_value)
            for label, ns, name, value, by_value in self.globals
        ]
        current += [(label, cell_value(cell), value, by_value) for label, cell, value, by_value in self.cells]
        return [d for label, now, value, by_value in current if (d := change(label, value, now, by_value))]


def unwatched_message(step: str, unwatched: list[str]) -> str:
    listed = "\n".join(f"  - {u}" for u in unwatched)
    return (
        f"capturing {step} refused (Config(strict_reads=True)): its code reads objects whose contents no "
        "guard can watch, so a change to them between calls would not reach the graph, whose replays "
        f"keep what the capture read:\n{listed}\n"
        "Pass such a number as a tensor (a 0-d device tensor updated in place, or an argument), keep it "
        "in a dict, a dataclass or a config object graphstep reads by content (OmegaConf, ml_collections, "
        "pydantic, attrs, argparse.Namespace), or, if it never changes between calls, mark it with "
        "`graphstep.unchanging(obj)`. Nothing was lost: the model, optimizer and RNG are as the last "
        "warm-up left them."
    )
