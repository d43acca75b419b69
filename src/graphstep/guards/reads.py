"""What the step's Python reads: globals and closure cells of every user function it runs.

A graph replays kernels; the Python that chose them and the numbers it passed do not run
again. A module-level `TEMPERATURE` read by a loss helper the step calls is baked into the
graph as surely as the step's own globals. `ReadWatch` watches one run of the step (a
warm-up, or the capture itself) with `sys.setprofile` and notes, for every *user* function
that ran (not torch's, not an installed package's, not the standard library's, not graphstep's
own; graphstep's demo counts as user code), the globals its bytecode loads and its closure
cells. `ReadGuard` then compares them before each replay: numbers, bools, strings, None
and tuples of those by value, anything else by identity, and the fields of dataclass (and
`SimpleNamespace`) instances found there by value.

What the watch also notes, for `graphstep.explain` rather than for the guard: globals and
closure cells the step assigns, and module attributes the step writes (a replay does not
write them); these are left out of the guard, since a replay cannot honour them anyway and
two graphs would undo each other's writes.

Limits: the profiler sees the calling thread only, so user Python that autograd runs on its
own threads (a custom `autograd.Function.backward` or a tensor hook during a CUDA backward) is
not watched; builtins are not guarded; a global's bytecode is read statically, so a branch not
taken still counts as read; the contents of lists, dicts and other plain objects are not
guarded (explain lists them); a C-level profiler (cProfile) active at the watch suspends it.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import gc
import logging
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from . import barriers
from .barriers import MISSING, describe, is_simple, same

log = logging.getLogger("graphstep")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # graphstep/, above guards/
_DEMO_DIR = os.path.join(_PACKAGE_DIR, "demo")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {os.path.dirname(os.path.abspath(torch.__file__)), _PACKAGE_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    try:
        dirs.update(os.path.abspath(p) for p in site.getsitepackages())
        dirs.add(os.path.abspath(site.getusersitepackages()))
    except AttributeError:  # a virtualenv's old site module
        pass
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs))


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """User code: not torch, an installed package, the standard library or graphstep (its demo
    is user code, like a training script)."""
    if filename.startswith("<frozen"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_DEMO_DIR + os.sep):
        return True
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return False
    return not path.startswith(_library_dirs())


@dataclasses.dataclass(frozen=True)
class _CodeFacts:
    globals_read: tuple[str, ...]
    globals_written: frozenset[str]
    cells_written: frozenset[str]
    module_attributes: tuple[tuple[str, str], ...]
    """(global, attribute) for `config.TEMPERATURE`: a global followed by an attribute load."""


@functools.lru_cache(maxsize=8192)
def _facts(code: types.CodeType) -> _CodeFacts:
    read, written, cells, attributes = [], set(), set(), []
    previous = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval not in read:
            read.append(ins.argval)
        elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            written.add(ins.argval)
        elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in code.co_freevars:
            cells.add(ins.argval)
        elif (
            ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and previous is not None
            and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME")
            and (previous.argval, ins.argval) not in attributes
        ):
            attributes.append((previous.argval, ins.argval))
        if ins.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL"):
            previous = ins
    return _CodeFacts(tuple(read), frozenset(written), frozenset(cells), tuple(attributes))


def _user_module_namespace(value: Any) -> dict | None:
    """The namespace of a user's Python module (a `config.py` imported as `config`), else None."""
    if not isinstance(value, types.ModuleType):
        return None
    file = getattr(value, "__file__", None)
    return vars(value) if isinstance(file, str) and is_user_file(file) else None


def _global_locations(code: types.CodeType, namespace: dict) -> Iterator[tuple[dict, str]]:
    """Where `code` loads globals from: its module's namespace, and user modules' attributes."""
    facts = _facts(code)
    for name in facts.globals_read:
        yield namespace, name
    for name, attribute in facts.module_attributes:
        module_namespace = _user_module_namespace(namespace.get(name))
        if module_namespace is not None and attribute in module_namespace:
            yield module_namespace, attribute


def _file_label(namespace: dict) -> str:
    file = namespace.get("__file__")
    return os.path.basename(file) if isinstance(file, str) else str(namespace.get("__name__", "?"))


@dataclasses.dataclass
class Reads:
    """Where a step's Python read values (a guard reads the values themselves when it is made)."""

    globals: list[tuple[str, dict, str]] = dataclasses.field(default_factory=list)
    """(label, namespace, name): a global some user function loads."""
    cells: list[tuple[str, types.CellType]] = dataclasses.field(default_factory=list)
    """(label, cell): a closure variable of a user function that ran."""
    functions: list[str] = dataclasses.field(default_factory=list)
    """The user functions that ran, as `qualname (file:line)`."""
    written: list[str] = dataclasses.field(default_factory=list)
    """Globals and closure variables the step assigns (labels); left out of `globals`/`cells`."""
    module_writes: frozenset[tuple[int, str]] = frozenset()
    """(id(module), attribute) pairs the step wrote through `Module.__setattr__`."""
    complete: bool = True
    """False when the watch could not run (another profiler was active)."""

    @classmethod
    def of_function(cls, fn: Callable) -> Reads:
        """The step function's own globals and closure cells, from its bytecode alone (no run)."""
        code = getattr(fn, "__code__", None)
        if code is None:
            return cls()
        reads = cls(functions=[_describe_code(code)])
        namespace = getattr(fn, "__globals__", {})
        codes = [code, *(c for c in code.co_consts if isinstance(c, types.CodeType))]
        written = set().union(*(_facts(c).globals_written for c in codes))
        for c in codes:
            for ns, name in _global_locations(c, namespace):
                label = f"global {name!r} in {_file_label(ns)}"
                if ns is namespace and name in written:
                    reads.written.append(label)
                elif name in ns and all(name != n or ns is not other for _, other, n in reads.globals):
                    reads.globals.append((label, ns, name))
        cells_written = _facts(code).cells_written
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            label = f"closure variable {name!r} of {fn.__qualname__}"
            if name in cells_written:
                reads.written.append(label)
            elif name != "__class__":
                reads.cells.append((label, cell))
        return reads


def _describe_code(code: types.CodeType) -> str:
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


class ReadWatch:
    """Watches one run of the step: `with ReadWatch() as watch: step(...)`, then `watch.reads`.

    Installs a profile function on the calling thread for the duration (restoring the previous
    one after), and a listener on module attribute writes.
    """

    def __init__(self) -> None:
        self.reads = Reads()
        self._codes: dict[types.CodeType, bool] = {}  # code -> is user code
        self._namespaces: dict[tuple[int, str], tuple[dict, str]] = {}
        self._written_globals: set[tuple[int, str]] = set()
        self._closures: dict[types.CodeType, set[tuple[int, ...]]] = {}
        """Codes of closures that ran, with the ids of their cells' contents in each run."""
        self._found: dict[types.CodeType, list[types.FunctionType]] = {}
        """Functions of those runs, found where their caller holds them."""
        self._module_writes: set[tuple[int, str]] = set()
        self._previous: Any = None
        self._chain: Callable | None = None

    def __enter__(self) -> ReadWatch:
        self._previous = sys.getprofile()
        if self._previous is not None and not callable(self._previous):
            log.warning(
                "graphstep: a profiler (%s) is active, so graphstep cannot watch which globals the step's "
                "helpers read; only the step function's own are guarded for this capture.",
                type(self._previous).__name__,
            )
            self.reads.complete = False
            return self
        self._chain = self._previous
        barriers.add_listener(self._on_write)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.reads.complete:
            return
        sys.setprofile(self._previous)
        barriers.remove_listener(self._on_write)
        if exc[0] is None:
            self._finish()

    def _on_write(self, module: nn.Module, name: str) -> None:
        self._module_writes.add((id(module), name))

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self._chain is not None:
            self._chain(frame, event, arg)
        if event != "call":
            return
        code = frame.f_code
        user = self._codes.get(code)
        if user is None:
            user = self._codes[code] = is_user_file(code.co_filename)
            if user:
                self._first_call(frame, code)
        if user and code in self._closures:
            local = frame.f_locals
            values = tuple(id(local.get(n, MISSING)) for n in code.co_freevars)
            if values not in self._closures[code]:
                self._closures[code].add(values)
                found = _caller_function(frame, code, values)
                if found is not None:
                    self._found.setdefault(code, []).append(found)

    def _first_call(self, frame: types.FrameType, code: types.CodeType) -> None:
        facts = _facts(code)
        namespace = frame.f_globals
        for ns, name in _global_locations(code, namespace):
            self._namespaces.setdefault((id(ns), name), (ns, name))
        self._written_globals.update((id(namespace), n) for n in facts.globals_written)
        if [n for n in code.co_freevars if n != "__class__"]:
            self._closures[code] = set()
        self.reads.functions.append(_describe_code(code))

    def _finish(self) -> None:
        reads = self.reads
        for key, (namespace, name) in self._namespaces.items():
            label = f"global {name!r} in {_file_label(namespace)}"
            if key in self._written_globals:
                reads.written.append(label)
            elif name in namespace:  # otherwise a builtin
                reads.globals.append((label, namespace, name))
        reads.module_writes = frozenset(self._module_writes)
        if not self._closures:
            return
        # A frame does not know its function object. Most were found in their caller's names;
        # the others are looked for among every object (one pass over the heap, tens of ms).
        functions = {
            c: self._found[c] for c in self._closures if len(self._found.get(c, ())) == len(self._closures[c])
        }
        lost = [c for c in self._closures if c not in functions]
        for c in lost:
            functions[c] = []
        for ref in gc.get_referrers(*lost) if lost else ():
            if isinstance(ref, types.FunctionType) and ref.__code__ in functions:
                functions[ref.__code__].append(ref)
        seen_cells: set[int] = set()
        for code, fns in functions.items():
            written = _facts(code).cells_written
            for fn in fns:
                contents = tuple(id(_contents(c)) for c in fn.__closure__ or ())
                if len(fns) > 1 and contents not in self._closures[code]:
                    continue  # another closure of the same code, not run by the step
                for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
                    label = f"closure variable {name!r} of {fn.__qualname__}"
                    if name == "__class__" or id(cell) in seen_cells:
                        continue
                    seen_cells.add(id(cell))
                    if name in written:
                        reads.written.append(label)
                    else:
                        reads.cells.append((label, cell))


def _caller_function(frame: types.FrameType, code: types.CodeType, values: tuple[int, ...]) -> Any:
    """The function running in `frame`, if its caller holds it by a name (a local, a closure
    variable, a global, a bound method or a partial there); None otherwise."""
    caller = frame.f_back
    if caller is None:
        return None
    candidates = [*caller.f_locals.values(), frame.f_globals.get(code.co_name)]
    for value in candidates:
        fn = value.__func__ if isinstance(value, types.MethodType) else value
        fn = fn.func if isinstance(fn, functools.partial) else fn
        if (
            isinstance(fn, types.FunctionType)
            and fn.__code__ is code
            and tuple(id(_contents(c)) for c in fn.__closure__ or ()) == values
        ):
            return fn
    return None


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet
        return MISSING


# -- the guard --------------------------------------------------------------------------------

_IDENTITY_OK = (
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
"""Objects whose identity is all a graph depends on (their own state is guarded elsewhere,
or is code)."""


def _plain_fields(obj: Any) -> list[str] | None:
    """The field names of a mutable dataclass instance or a SimpleNamespace; None otherwise."""
    if isinstance(obj, types.SimpleNamespace):
        return sorted(vars(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if obj.__dataclass_params__.frozen:
            return []
        return [f.name for f in dataclasses.fields(obj)]
    return None


def _user_class(cls: type) -> bool:
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return isinstance(file, str) and is_user_file(file)


class ReadGuard:
    """The values behind a `Reads`, as they are now, and the check that they still are."""

    def __init__(self, reads: Reads):
        self.globals = [
            (label, ns, name, value, is_simple(value))
            for label, ns, name in reads.globals
            for value in [ns.get(name, MISSING)]
        ]
        self.cells = [
            (label, cell, value, is_simple(value))
            for label, cell in reads.cells
            for value in [_contents(cell)]
        ]
        self.fields: list[tuple[str, Any, str, Any]] = []
        """(label, object, field, value): simple fields of dataclass instances read by the step."""
        self.unguarded: list[str] = []
        """Objects read whose contents nothing guards (lists, dicts, other plain objects)."""
        for label, value in self.objects():
            self._add_fields(label, value, depth=0)

    def objects(self) -> list[tuple[str, Any]]:
        return [(label, value) for label, _, _, value, _ in self.globals] + [
            (label, value) for label, _, value, _ in self.cells
        ]

    def watch_fields(self, label: str, value: Any) -> None:
        """Guard the fields of a dataclass instance held elsewhere (a module's `self.config`):
        nothing else sees a write to them."""
        if _plain_fields(value) and all(value is not obj for _, obj, _, _ in self.fields):
            self._add_fields(label, value, depth=0)

    def _add_fields(self, label: str, value: Any, depth: int) -> None:
        if is_simple(value) or value is MISSING or isinstance(value, _IDENTITY_OK):
            return
        names = _plain_fields(value)
        if names is None:
            if isinstance(value, (dict, list, set, bytearray)) or _user_class(type(value)):
                self.unguarded.append(f"{label} ({type(value).__qualname__}): its contents are not guarded")
            return
        for name in names:
            field = getattr(value, name, MISSING)
            if is_simple(field):
                self.fields.append((label, value, name, field))
            elif depth < 2:
                self._add_fields(f"{label}.{name}", field, depth + 1)

    def holds(self) -> bool:
        for _, ns, name, value, by_value in self.globals:
            now = ns.get(name, MISSING)
            if now is not value and not (by_value and type(now) is type(value) and now == value):
                return False
        for _, cell, value, by_value in self.cells:
            try:
                now = cell.cell_contents
            except ValueError:
                return False
            if now is not value and not (by_value and type(now) is type(value) and now == value):
                return False
        for _, obj, name, value in self.fields:
            now = getattr(obj, name, MISSING)
            if now is not value and not (type(now) is type(value) and now == value):
                return False
        return True

    def changes(self) -> list[tuple[str, bool]]:
        """(text, is_value_change) per difference."""
        found = []
        current = [
            (label, ns.get(name, MISSING), value, by_value)
            for label, ns, name, value, by_value in self.globals
        ]
        current += [(label, _contents(cell), value, by_value) for label, cell, value, by_value in self.cells]
        for label, now, value, by_value in current:
            if same(now, value, by_value):
                continue
            if by_value and (now is MISSING or is_simple(now)):
                found.append((f"{label}: {describe(value)} -> {describe(now)}", True))
            else:
                found.append((f"{label}: now refers to another object", False))
        for label, obj, name, value in self.fields:
            now = getattr(obj, name, MISSING)
            if not same(now, value, True):
                found.append((f"{label}, field {name!r}: {describe(value)} -> {describe(now)}", True))
        return found
