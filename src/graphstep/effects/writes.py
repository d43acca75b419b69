"""Writes to Python state that outlives the call, made by the step's own code while it is captured.

A replay runs the captured GPU work and no Python. A write the step's code makes to state that
outlives the call — `self.seen += 1`, `global CALLS; CALLS += 1`, `self.history.append(loss)`,
`cfg["smoothing"] = 0.2` — happens eagerly on every call, but with graphstep only in warm-up and at
capture, then never again: results drift from eager without a word. `WriteWatch` watches the
capturing run and refuses such writes with the user's line (`PythonWriteError`), after putting back
every value they changed, so nothing is lost.

What counts: a write made from the user's code or a library's — where code lives decides nothing: a
package's Python counter is as frozen by a replay as the user's — to an object that existed before the
capture began: an attribute of an object, module or class, a global, a closure variable of an
enclosing function, the contents of a list, dict, set, deque or bytearray (item assignment, `del`,
in-place operators, and their mutating methods). A library's write names its line and the user's line
that led there. Not judged: the functions `trusted.py` names, each with its reason and its test (the
standard library, torch's module-call machinery and lazy caches, Lightning's progress counters, ...),
writes to objects the step creates, whatever an eager segment does (it runs on every replay), and code
the interpreter runs on its own in the middle of the step (a gc callback, a finalizer). A write of the value already there
(`self.flag = True` when it was True, an equal number) changes nothing.

How: an opcode tracer (`guards/tracing.py`: `sys.settrace`, or on Python >= 3.12 `sys.monitoring` with
instruction events on those code objects only) on judged frames that contain stores or calls of
containers' mutating methods (`append`, `update`, ...); the target of each comes from the bytecode
(`targets.py`) and is compared before and after the instruction. `sys.settrace` chains to the tracer
installed before (local tracers included) and puts it back after; no profile function is installed,
so trusted code pays one trace call per Python frame it enters (with `sys.monitoring`, one event per
code object) and nothing per C call. What existed before is a census of the collector's objects taken
when the watch starts (tensors left out; `values.Census`).

Limits: user Python that autograd runs on its own threads (a custom backward on CUDA) is not watched;
writes through `setattr()`, `object.__setattr__`, `vars(obj)[...]`, a C function handed a container
(`heapq.heappush`), a method called unbound (`list.append(xs, x)`) or kept in a variable, or a user
container type's own `__setitem__` implemented in C are not seen; a store
whose target the bytecode analysis does not follow (an attribute of a call's result) is not judged; a
library's write into a dict of plain numbers that the collector does not track is not seen (the first
look skips objects missing from the census, most of which the step made).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import linecache
import logging
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..backends import segments
from ..errors import PythonWriteError
from ..guards import tracing
from ..guards.compiling import unseen
from . import targets, trusted, values
from .library_writes import LibraryWrites

log = logging.getLogger("graphstep")

_LOGGING_FILE = os.path.abspath(logging.__file__)
_LOGGING_CALLS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "log"})
_SEGMENTS_FILE = os.path.abspath(segments.__file__)


def site(frame: types.FrameType, line: int = 0) -> str:
    """`file:line in function: \\`source\\``, as graphstep's other errors name the user's line."""
    code, line = frame.f_code, line or frame.f_lineno
    source = linecache.getline(code.co_filename, line).strip()
    return f"{code.co_filename}:{line} in {code.co_name}: `{source}`"


# -- the watch ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Write:
    """One refused write: where, what, and how to take it back."""

    where: str
    what: str
    undo: Callable[[], None]
    attribute: tuple[int, str] | None = None
    """(id of the object, attribute name) of an attribute write."""
    module: Any = None
    """For a library's write: the innermost module whose `forward` was running (a graph break there
    would repeat the write on every call)."""


@dataclasses.dataclass
class _Pending:
    """A store about to run, with what its target held before."""

    kind: str
    obj: Any
    name: Any
    before: Any
    text: str
    line: int = 0
    """The store's line (the frame may be on the next one when the store is judged)."""


class WriteWatch:
    """Watches one capturing run of the step: `with watch: step(...)`.

    On leaving without an error, refused writes are taken back and raised as `PythonWriteError`
    (unless `allow`); on leaving with an error, they are taken back and the error goes on. `roll_back`
    takes them back later too (a capture that failed after the step ran). Enters once: a body that is
    run again (the eager backend's replays) is not watched again. `report=True` (explain's dry run):
    the writes that would be refused are taken back and listed in `found`, nothing raised or logged.
    """

    def __init__(self, step_name: str, *, allow: bool = False, enabled: bool = True, report: bool = False):
        self.step_name = step_name
        self.allow = allow
        self.enabled = enabled
        self.report = report
        self.found: list[str] = []
        """With `report`: `where: what` of each write a capture would refuse."""
        self.found_attributes: set[tuple[int, str]] = set()
        """With `report`: (id of the object, name) of the attributes among them."""
        self.writes: list[Write] = []
        self.prints: list[str] = []
        """Sites of `print` and `logging` calls in user frames."""
        self._used = False
        self._active = False
        self._census: values.Census | None = None
        self._code = trusted.CodeKinds()
        self._library = LibraryWrites()
        self._pending: dict[types.FrameType, _Pending] = {}
        self._tracer: tracing.Settrace | tracing.Monitoring | None = None
        self._redone: set[tuple[int, str | None]] = set()
        """(id of the object, attribute name or None for its contents) of places an integration sets
        again on every replay."""

    # -- entering and leaving --------------------------------------------------------------------

    def __enter__(self) -> WriteWatch:
        if not self.enabled or self._used:
            return self
        self._used = True
        previous = sys.gettrace()
        if previous is not None and not callable(previous) and tracing.chosen() == "settrace":
            return _unwatched(self, "a C-level tracer is active")
        # The census decides what to refuse and what a failed capture takes back: allowed writes too,
        # or objects it made and something still holds lose their attributes (a torch op entry).
        self._census = values.Census()
        try:
            self._tracer = tracing.start(self, wrap=unseen)  # (hooks run in compiled models: not compiled)
        except BaseException:
            self._census.drop()  # (its collector callback goes with it)
            raise
        if self._tracer is None:
            self._census.drop()
            return _unwatched(
                self, "other tools hold sys.monitoring's free tool ids, and a C-level tracer is active"
            )
        self._active = True
        _watching.append(self)
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if not self._active:
            return
        self._tracer.stop()
        self._active = False
        _watching.remove(self)
        for frame in list(self._pending):
            self.finish(frame)
        self.writes += [Write(*found) for found in self._library.changed(self._redone)]
        self.writes = [w for w in self.writes if w.attribute is None or w.attribute not in self._redone]
        self._census.drop()
        if kind is not None:
            self.roll_back()
            return
        if self.report:
            self.found = list(dict.fromkeys(f"{w.where}: {w.what}" for w in self.writes))
            self.found_attributes = {w.attribute for w in self.writes if w.attribute is not None}
            self.roll_back()
            return
        if self.writes and not self.allow:
            error = _refused(self.step_name, self.writes)
            self.roll_back()
            raise error
        if self.writes:
            log.debug(
                "graphstep: %s writes Python state at capture (allowed by Config(allow_python_writes=True)); "
                "replays will not write it again:\n%s",
                self.step_name,
                "\n".join(f"  - {w.where}: {w.what}" for w in self.writes),
            )
        if self.prints:
            log.warning(
                "graphstep: %s prints or logs from inside the step; that runs only while the step's Python "
                "runs (warm-up and capture), not on replays. Return the values and print them after the "
                "call instead:\n%s",
                self.step_name,
                "\n".join(f"  - {p}" for p in self.prints),
            )

    def roll_back(self) -> None:
        """Put back what the refused (or allowed) writes changed (newest first), and all library writes."""
        writes, self.writes = self.writes, []
        for write in reversed(writes):
            write.undo()
        self._library.undo_all()

    # -- the hooks ------------------------------------------------------------------------------

    def frame_kind(self, frame: types.FrameType) -> tracing.Kind:
        """Whether the tracer follows a frame that starts: judged code that can write (stores, or
        calls of containers' mutating methods) instruction by instruction; a `logging` call, to see
        who called it; anything else not at all."""
        code = frame.f_code
        if code.co_filename == _LOGGING_FILE:
            return tracing.Kind.LOGGING if code.co_name in _LOGGING_CALLS else tracing.Kind.SKIP
        if not self._code.is_judged(frame) or not targets.stores(code):
            return tracing.Kind.SKIP
        return tracing.Kind.TRACE

    def logging_call(self, frame: types.FrameType) -> None:
        caller = frame.f_back
        if caller is not None and self._code.is_user(caller.f_code):
            self._note_print(caller)

    def _note_print(self, frame: types.FrameType) -> None:
        where = site(frame)
        if where not in self.prints:
            self.prints.append(where)

    # -- stores ---------------------------------------------------------------------------------

    def opcode(self, frame: types.FrameType, offset: int) -> None:
        """Before the instruction at `offset` of `frame`: the store before it has run."""
        pending = self._pending.pop(frame, None)
        if pending is not None:
            self._complete(pending, frame)
        store = targets.stores(frame.f_code).get(offset)
        if store is not None:
            self._begin(frame, store)

    def finish(self, frame: types.FrameType) -> None:
        pending = self._pending.pop(frame, None)
        if pending is not None:
            self._complete(pending, frame)

    def _begin(self, frame: types.FrameType, store: targets.Store) -> None:
        self._begin_store(frame, store)
        pending = self._pending.get(frame)
        if pending is not None:
            pending.line = frame.f_lineno

    def _begin_store(self, frame: types.FrameType, store: targets.Store) -> None:
        kind, name = store.kind, store.name
        if kind == "print":
            if self._code.is_user(frame.f_code):
                self._note_print(frame)
        elif kind == "global":
            namespace = frame.f_globals
            self._pending[frame] = _Pending(kind, namespace, name, namespace.get(name, values.MISSING), name)
        elif kind == "cell":
            self._pending[frame] = _Pending(kind, None, name, frame.f_locals.get(name, values.MISSING), name)
        elif kind in ("attr", "item", "call"):
            obj = targets.evaluate(store.target, frame, frame.f_locals)
            if obj is targets.UNKNOWN or isinstance(obj, torch.Tensor):
                return
            if not self._code.is_user(frame.f_code) and not self._census.existed(obj, thorough=False):
                return  # library code mostly writes objects the step made: skip those cheaply
            text = targets.render(store.target)
            if kind == "attr":
                state = values.attr_state(obj, name)
                if state is not None:
                    self._pending[frame] = _Pending(kind, obj, name, state, f"{text}.{name}")
            elif kind == "call" and name in values.mutators(type(obj)):
                self._pending[frame] = _Pending(
                    "item", obj, None, values.contents(obj), f"{text}.{name}(...)"
                )
            elif kind == "item" and values.mutators(type(obj)):
                key = f"[{targets.render(store.key)}]" if store.key is not None else ""
                self._pending[frame] = _Pending(kind, obj, None, values.contents(obj), text + key)

    def _complete(self, p: _Pending, frame: types.FrameType) -> None:
        if not self._code.is_user(frame.f_code):
            self._note_library(p, frame)
        elif p.kind == "global":
            now = p.obj.get(p.name, values.MISSING)
            if values.same(p.before, now):
                return
            what = f"global {p.name!r} of {os.path.basename(p.obj.get('__file__', '?'))}"
            what += f": {values.shown(p.before)} -> {values.shown(now)}"
            self._refuse(frame, p.line, what, values.undo_global(p.obj, p.name, p.before))
        elif p.kind == "cell":
            now = frame.f_locals.get(p.name, values.MISSING)
            cell = None if values.same(p.before, now) else values.find_cell(frame.f_code, p.name, now)
            if cell is not None and self._census.existed(cell):
                what = f"closure variable {p.name!r} of {frame.f_code.co_name}: {values.shown(p.before)} -> {values.shown(now)}"
                self._refuse(frame, p.line, what, values.undo_cell(cell, p.before))
        elif p.kind == "attr":
            now = values.attr_state(p.obj, p.name)
            if now is not None and now[0] == p.before[0] and values.same(p.before[1], now[1]):
                return
            if self._census.existed(p.obj):
                what = f"`{p.text}`, attribute {p.name!r} of {values.described(p.obj)}"
                what += f": {values.shown(p.before[1])} -> {values.shown(values.MISSING if now is None else now[1])}"
                undo = functools.partial(values.restore_attr, p.obj, p.name, p.before)
                self._refuse(frame, p.line, what, undo, attribute=(id(p.obj), p.name))
        elif not values.unchanged(p.obj, p.before) and self._census.existed(p.obj):
            what = f"`{p.text}` changes {values.described(p.obj)} in place"
            self._refuse(frame, p.line, what, functools.partial(values.restore_contents, p.obj, p.before))

    def _note_library(self, p: _Pending, frame: types.FrameType) -> None:
        """A library's store: remembered with the value before, judged by its net effect at the end."""
        obj = p.obj
        if p.kind == "cell":  # a closure variable: its cell, if it existed before the capture
            now = frame.f_locals.get(p.name, values.MISSING)
            obj = None if values.same(p.before, now) else values.find_cell(frame.f_code, p.name, now)
            if obj is None:
                return
        if not self._census.existed(obj):  # a global: of a module imported during the capture?
            return

        def where() -> tuple[str, Any] | None:  # the first write to a place only: these walk the stack
            if _in_segment(frame) or _asynchronous(frame):
                return None
            return self._where(frame, p.line), _module_around(frame)

        self._library.note(p.kind, obj, p.name, p.before, p.text, where)

    def _where(self, frame: types.FrameType, line: int) -> str:
        """The store's site; for a library's, the user's line that led there too."""
        where = site(frame, line)
        if not self._code.is_user(frame.f_code):
            caller = self._code.users_caller(frame)
            where = f"{where} (library code{f', reached from {site(caller)}' if caller is not None else ''})"
        return where

    def _refuse(
        self,
        frame: types.FrameType,
        line: int,
        what: str,
        undo: Callable[[], None],
        attribute: tuple[int, str] | None = None,
    ) -> None:
        if _in_segment(frame):  # an eager segment runs on every replay: its writes are repeated
            return
        if _asynchronous(frame):  # not the step's work, though it ran during it
            return
        self.writes.append(Write(self._where(frame, line), what, undo, attribute))


def _unwatched(watch: WriteWatch, why: str) -> WriteWatch:
    log.warning(
        "graphstep: %s, so %s's capture cannot watch its writes to Python state (nothing is refused "
        "this time).",
        why,
        watch.step_name,
    )
    return watch


_watching: list[WriteWatch] = []
"""The watches of the captures running now, innermost last."""


def redone_on_replays(obj: Any, name: str | None = None) -> None:
    """Attribute `name` of `obj` (None: the contents of container `obj`) is set by an integration on
    every replay, to what the capture's Python left there (the DeepSpeed integration's hand-over to
    `engine.step()`'s segment): the capture running now does not refuse its Python's writes to it."""
    if _watching:
        _watching[-1]._redone.add((id(obj), name))


def _refused(step_name: str, writes: list[Write]) -> PythonWriteError:
    error = PythonWriteError(refusal(step_name, writes))
    # Where every write is a library's inside a module, running that module eagerly repeats them.
    error.modules = [w.module for w in writes] if all(w.module for w in writes) else []
    return error


def refusal(step_name: str, writes: list[Write]) -> str:
    """The text of the `PythonWriteError` that refuses `writes`."""
    listed = []
    for w in writes:
        line = f"  - {w.where}: {w.what}"
        if line not in listed:
            listed.append(line)
    hints = [
        hint
        for (path, function), hint in _HINTS.items()
        if any(path in w.where and function in w.where for w in writes)
    ]
    return (
        f"capturing {step_name} refused: its code writes Python state that outlives the call:\n"
        + "\n".join(listed)
        + "".join(f"\n{hint}" for hint in hints)
        + "\nA replay runs the captured GPU work only, no Python: eagerly these writes happen on every "
        "call, with graphstep only in warm-up and at capture, then never again, and the results would "
        "differ from eager without a word.\n"
        "Instead: keep the value in a device tensor updated in place (a buffer: "
        '`self.register_buffer("seen", torch.zeros((), dtype=torch.long))` and `self.seen.add_(1)`), '
        "move the write out of the step (after the call returns), or return the value from the step. "
        "A write that changes nothing the step computes may be allowed with "
        "graphstep.Config(allow_python_writes=True).\n"
        "Nothing was lost: the model, optimizer, inputs and the Python state written are as they were "
        "before this call."
    )


_DEEPSPEED_ENGINE = os.path.join("deepspeed", "runtime", "engine.py")
_HINTS = {
    (_DEEPSPEED_ENGINE, " in "): (
        "These are DeepSpeed's engine counters and timers: capture the step with "
        "graphstep.integrations.deepspeed.capture_engine_step(engine, step), which runs engine.step() as "
        "an eager segment (its counters with it) and keys the graph on the accumulation position."
    ),
    (os.path.join("accelerate", "accelerator.py"), " in _do_sync: "): (
        "This is accelerate's gradient-accumulation counter, advanced by `accelerator.accumulate(model)`: "
        "capture the step with graphstep.integrations.huggingface.capture_accelerated(accelerator, step, "
        "model=..., optimizer=...), which makes accelerate's decision before every call and keeps one "
        "graph per phase (accumulate only, or sync and step)."
    ),
}
"""(file path part, function part) of a library write's site -> what to do instead."""


def _asynchronous(frame: types.FrameType | None) -> bool:
    """`frame` runs inside code the interpreter called on its own in the middle of the step: a garbage
    collector callback (a test framework's timer, a profiler's), a finalizer (`__del__`, a
    `weakref.finalize`: an object that existed before the capture may die during it, graphstep's own
    guards among them)."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code in callbacks or code is _FINALIZE_CALL:
            return True
        frame = frame.f_back
    return False


_FINALIZE_CALL = weakref.finalize.__call__.__code__


def _module_around(frame: types.FrameType | None) -> Any:
    while frame is not None:
        module = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(module, torch.nn.Module):
            return module
        frame = frame.f_back
    return None


def _in_segment(frame: types.FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        if code.co_name == "plainly" and os.path.abspath(code.co_filename) == _SEGMENTS_FILE:
            return True
        frame = frame.f_back
    return False
