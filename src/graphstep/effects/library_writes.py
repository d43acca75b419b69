"""A library's writes during a capture, judged by what they leave behind at its end.

Library code keeps scratch state in long-lived objects: a parser resets its lexer's position, reads a
new input and leaves the position where the last parse left it; a module caches the last shape it saw.
Judged store by store, as the user's writes are, every such reset would be refused. What a replay gets
wrong is only the net effect of the call: so each place a library writes is remembered with its value
before the first write, and compared at the end of the capture. It is refused when a plain value
changed (a number, a flag, a string, None, a tuple of those: `self.calls += 1`, `group["k"] += 1`), or a
container the library fills (an item added or removed, a plain item changed). Rebinding an attribute to
a new object (a fresh list, a new input stream) is the library's bookkeeping: a replay leaves the
object of the capture in place, which the library sets again before it reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from ..guards.barriers import cell_value
from . import values


@dataclasses.dataclass
class _First:
    """A place a library wrote, as it was before the first write."""

    kind: str
    """"global", "cell" (a closure variable; `obj` is its cell), "attr" or "item" (a container's contents)."""
    obj: Any
    name: Any
    before: Any
    text: str
    where: str
    module: Any = None
    """The innermost module whose `forward` was running when the library wrote."""


class LibraryWrites:
    """The places library code wrote during one capture, each with its value before."""

    def __init__(self) -> None:
        self._first: dict[tuple, _First | None] = {}

    def note(
        self, kind: str, obj: Any, name: Any, before: Any, text: str, where: Callable[[], tuple | None]
    ) -> None:
        """A library store completed. `where`: its site and the module around it, asked for the first
        write to a place only; None when the store is not the step's to judge (inside an eager segment,
        a gc callback)."""
        key = (kind, id(obj), name if kind != "item" else None)
        if key not in self._first:
            site = where()
            self._first[key] = None if site is None else _First(kind, obj, name, before, text, *site)

    def changed(
        self, redone: set[tuple[int, str | None]] = frozenset()
    ) -> list[tuple[str, str, Callable[[], None], tuple[int, str] | None, Any]]:
        """(where, what, undo, attribute, module) for each place whose net change a replay would not
        repeat. `redone`: (id of the object, attribute name, or None for a container's contents) of
        places an integration sets again on every replay."""
        found = []
        for first in self._first.values():
            if first is not None and (id(first.obj), first.name if first.kind == "attr" else None) in redone:
                continue
            judged = None if first is None else _judge(first)
            if judged is not None:
                found.append((first.where, *judged, first.module))
        return found

    def undo_all(self) -> None:
        """Put back every place a library wrote, judged or not (a failed capture leaves what eager
        would: a metric that rebound its state tensors before the capture stopped gets them back),
        but for a global the library made that holds an object (a lazily made singleton: code that
        made it once reads it without looking, and would fail on a missing name)."""
        firsts, self._first = [f for f in self._first.values() if f is not None], {}
        for f in reversed(firsts):
            if f.kind == "global" and f.before is values.MISSING and not _plain(f.obj.get(f.name)):
                continue  # a library's lazily made global (a singleton): deleting it breaks the library
            if f.kind == "global":
                values.undo_global(f.obj, f.name, f.before)()
            elif f.kind == "cell":
                values.undo_cell(f.obj, f.before)()
            elif f.kind == "attr":
                values.restore_attr(f.obj, f.name, f.before)
            else:
                values.restore_contents(f.obj, f.before)


def _judge(f: _First) -> tuple[str, Callable[[], None], tuple[int, str] | None] | None:
    if f.kind == "global":
        now = f.obj.get(f.name, values.MISSING)
        if not _plain_change(f.before, now):
            return None
        what = f"global {f.name!r} of {os.path.basename(f.obj.get('__file__', '?'))}"
        return (
            f"{what}: {values.shown(f.before)} -> {values.shown(now)}",
            values.undo_global(f.obj, f.name, f.before),
            None,
        )
    if f.kind == "cell":
        now = cell_value(f.obj)
        if not _plain_change(f.before, now):
            return None
        what = f"closure variable {f.name!r}: {values.shown(f.before)} -> {values.shown(now)}"
        return what, values.undo_cell(f.obj, f.before), None
    if f.kind == "attr":
        now = values.attr_state(f.obj, f.name)
        now_value = values.MISSING if now is None else now[1]
        if not _plain_change(f.before[1], now_value):
            return None
        what = f"`{f.text}`, attribute {f.name!r} of {values.described(f.obj)}"
        what += f": {values.shown(f.before[1])} -> {values.shown(now_value)}"
        return what, functools.partial(values.restore_attr, f.obj, f.name, f.before), (id(f.obj), f.name)
    if _pipeline_losses(f):
        what = (
            f"`{f.text}`: torch.distributed.pipelining's `schedule.step(..., losses=...)` puts this call's "
            "loss tensors into a list made outside the step. A replay runs no Python: the list would keep "
            "the capture's tensors, rewritten by every replay (a history of them would show the last step "
            "only). Make the list inside the step and return the losses: `losses = []; "
            "schedule.step(..., losses=losses); return torch.stack(losses)`"
        )
        return what, functools.partial(values.restore_contents, f.obj, f.before), None
    if not _contents_change(f.obj, f.before):
        return None
    what = f"`{f.text}` changes {values.described(f.obj)} in place"
    return what, functools.partial(values.restore_contents, f.obj, f.before), None


def _pipeline_losses(f: _First) -> bool:
    """The `losses` list a pipeline schedule fills (`_PipelineSchedule._update_losses`), when it
    existed before the capture: same length every call, so `_contents_change` sees nothing, but its
    tensors are the capture's (the list the step makes itself is not judged at all)."""
    return (
        isinstance(f.obj, list)
        and "pipelining" in f.where
        and " in _update_losses:" in f.where
        and any(isinstance(x, torch.Tensor) for x in f.obj)
    )


def _plain(value: Any) -> bool:
    if value is values.MISSING:
        return True
    if isinstance(value, tuple):
        return len(value) <= 64 and all(_plain(v) for v in value)
    return isinstance(value, values.PLAIN)


def _plain_change(before: Any, now: Any) -> bool:
    """A plain value (or an absent one) became another plain value."""
    return _plain(before) and _plain(now) and not values.same(before, now)


def _contents_change(container: Any, before: Any) -> bool:
    if isinstance(container, dict):
        if len(container) != len(before) or any(k not in container for k, _ in before):
            return True
        return any(_plain_change(v, dict.get(container, k)) for k, v in before)
    if isinstance(container, (set, frozenset)):
        return len(container) != len(before) or any(x not in container for x in before)
    if isinstance(container, bytearray):
        return bytes(container) != before
    now = list(container)
    return len(now) != len(before) or any(_plain_change(b, a) for b, a in zip(before, now))
