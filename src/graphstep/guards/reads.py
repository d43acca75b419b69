"""What the step's Python reads: globals and closure cells of every user function it runs.

A graph replays kernels; the Python that chose them and the numbers it passed do not run
again. A module-level `TEMPERATURE` read by a loss helper the step calls is baked into the
graph as surely as the step's own globals. `ReadWatch` watches one run of the step (a
warm-up, or the capture itself) with `sys.setprofile` (on Python >= 3.12 `sys.monitoring`'s
function starts instead, tracing.py's `Starts`) and notes, for every *user* function
that ran (not torch's, not an installed package's, not the standard library's, not graphstep's
own; graphstep's demo counts as user code), the globals its bytecode loads and its closure
cells, the attribute names it loads, the containers held by `self.x`-style attributes, and the
containers among its default arguments; and, before the step can write them, a snapshot of
every container it meets. `ReadGuard` then compares them before each replay: numbers, bools,
strings, None and tuples of those by value, containers and data objects by content (see
contents.py), anything else by identity.

What the watch also notes, for `graphstep.explain` rather than for the guard: globals and
closure cells the step assigns, and module attributes the step writes (a replay does not
write them); these are left out of the guard, since a replay cannot honour them anyway and
two graphs would undo each other's writes.

Limits: the profiler sees the calling thread only, so user Python that autograd runs on its
own threads (a custom `autograd.Function.backward` or a tensor hook during a CUDA backward) is
not watched; builtins are not guarded; a global's bytecode is read statically, so a branch not
taken still counts as read; default arguments are found only for functions their caller holds by
a name (or a global, or a method of their first argument); a C-level profiler (cProfile) active
at the watch suspends it.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import gc
import inspect
import linecache
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from . import barriers, contents, tracing
from .barriers import MISSING, cell_value
from .compiling import unseen
from .user_code import is_user_file

log = logging.getLogger("graphstep")


@dataclasses.dataclass(frozen=True)
class _CodeFacts:
    globals_read: tuple[str, ...]
    globals_written: frozenset[str]
    cells_written: frozenset[str]
    module_attributes: tuple[tuple[str, str], ...]
    """(global, attribute) for `config.TEMPERATURE`: a global followed by an attribute load."""
    attributes_read: frozenset[str]
    """Every attribute name the code loads (`x.weight`, `self.cfg`, `obj.method()`)."""
    object_attributes: tuple[tuple[str, str, str], ...]
    """(how, variable, attribute) for `self.cfg`, `model.weights`: how is "fast" (a local or an
    argument), "deref" (a closure variable) or "global"."""
    lines: dict[tuple[str, str], int] = dataclasses.field(compare=False)
    """The first line that loads a name: ("g", global), ("d", closure variable), ("a", attribute)."""


_LOADS = {"LOAD_GLOBAL": "global", "LOAD_NAME": "global", "LOAD_DEREF": "deref"}


def _loaded(ins: dis.Instruction) -> tuple[str, str] | None:
    """(how, name) of the variable an instruction pushes last, if it loads one."""
    if ins.opname in _LOADS:
        return _LOADS[ins.opname], ins.argval
    if ins.opname.startswith("LOAD_FAST"):  # LOAD_FAST_CHECK, LOAD_FAST_LOAD_FAST (3.13), _BORROW (3.14)
        name = ins.argval[-1] if isinstance(ins.argval, tuple) else ins.argval
        return ("fast", name) if isinstance(name, str) else None
    return None


_LINE_KINDS = {"LOAD_GLOBAL": "g", "LOAD_NAME": "g", "LOAD_DEREF": "d", "LOAD_ATTR": "a", "LOAD_METHOD": "a"}


@functools.lru_cache(maxsize=8192)
def _facts(code: types.CodeType) -> _CodeFacts:
    read, written, cells, attributes, loaded, pairs = [], set(), set(), [], set(), []
    previous, line, lines = None, code.co_firstlineno, {}
    for ins in dis.get_instructions(code):
        positions = getattr(ins, "positions", None)  # 3.11+; before, the line an instruction starts
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif type(ins.starts_line) is int:
            line = ins.starts_line
        if ins.opname in _LINE_KINDS and isinstance(ins.argval, str):
            lines.setdefault((_LINE_KINDS[ins.opname], ins.argval), line)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval not in read:
            read.append(ins.argval)
        elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            written.add(ins.argval)
        elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in code.co_freevars:
            cells.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(ins.argval, str):
            loaded.add(ins.argval)
            source = _loaded(previous) if previous is not None else None
            if source is not None and (*source, ins.argval) not in pairs:
                pairs.append((*source, ins.argval))
            if source is not None and source[0] == "global" and (source[1], ins.argval) not in attributes:
                attributes.append((source[1], ins.argval))
        if ins.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL"):
            previous = ins
    return _CodeFacts(
        tuple(read),
        frozenset(written),
        frozenset(cells),
        tuple(attributes),
        frozenset(loaded),
        tuple(pairs),
        lines,
    )


def site(code: types.CodeType, line: int) -> str:
    """`file:line in function: source`, as graphstep's errors name the user's line."""
    source = linecache.getline(code.co_filename, line).strip()
    return f"{code.co_filename}:{line} in {code.co_name}: `{source}`"


def _line(code: types.CodeType, kind: str, name: str) -> tuple[types.CodeType, int]:
    return code, _facts(code).lines.get((kind, name), code.co_firstlineno)


def _user_module_namespace(value: Any) -> dict | None:
    """The namespace of a user's Python module (a `config.py` imported as `config`), else None."""
    if not isinstance(value, types.ModuleType):
        return None
    file = getattr(value, "__file__", None)
    return vars(value) if isinstance(file, str) and is_user_file(file) else None


def _global_locations(code: types.CodeType, namespace: dict) -> Iterator[tuple[dict, str, tuple]]:
    """Where `code` loads globals from: its module's namespace, and user modules' attributes; each
    with the line that loads it first (`_line`)."""
    facts = _facts(code)
    for name in facts.globals_read:
        yield namespace, name, _line(code, "g", name)
    for name, attribute in facts.module_attributes:
        module_namespace = _user_module_namespace(namespace.get(name))
        if module_namespace is not None and attribute in module_namespace:
            yield module_namespace, attribute, _line(code, "a", attribute)


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
    attribute_names: frozenset[str] = frozenset()
    """Attribute names the user's code that ran loads: the attributes of user objects guarded."""
    attributes: list[tuple[Any, str]] = dataclasses.field(default_factory=list)
    """(object, name): containers held by modules' and objects' attributes that user code loads."""
    defaults: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    """(label, value): containers that are default arguments of user functions that ran."""
    arguments: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    """(label, value): the step's non-tensor arguments that are containers or objects."""
    modules: list[nn.Module] = dataclasses.field(default_factory=list)
    """Modules whose user-written methods ran (`self`), which the step may not name otherwise."""
    before: dict[int, Any] = dataclasses.field(default_factory=dict)
    """`contents.snapshot`s of the containers read, taken before the step could write them."""
    opaque: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    """(label, value): the step's non-tensor arguments whose contents no guard can see (`contents.opaque`)."""
    sites: dict[Any, tuple[types.CodeType, int]] = dataclasses.field(default_factory=dict)
    """Where user code first read a value: by label (globals, closure variables), or by
    (id(owner), name) for `reads.attributes`; (code, line) for `site()`."""

    @classmethod
    def of_function(cls, fn: Callable) -> Reads:
        """The step function's own globals and closure cells, from its bytecode alone (no run)."""
        code = getattr(fn, "__code__", None)
        if code is None:
            return cls()
        namespace = getattr(fn, "__globals__", {})
        codes = [code, *(c for c in code.co_consts if isinstance(c, types.CodeType))]
        names = frozenset().union(*(_facts(c).attributes_read for c in codes))
        reads = cls(functions=[_describe_code(code)], attribute_names=names)
        written = set().union(*(_facts(c).globals_written for c in codes))
        for c in codes:
            for ns, name, line in _global_locations(c, namespace):
                label = f"global {name!r} in {_file_label(ns)}"
                if ns is namespace and name in written:
                    reads.written.append(label)
                elif name in ns and all(name != n or ns is not other for _, other, n in reads.globals):
                    reads.globals.append((label, ns, name))
                    reads.sites[label] = line
        cells_written = _facts(code).cells_written
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            label = f"closure variable {name!r} of {fn.__qualname__}"
            if name in cells_written:
                reads.written.append(label)
            elif name != "__class__":
                reads.cells.append((label, cell))
                reads.sites[label] = _line(code, "d", name)
        return reads


def _describe_code(code: types.CodeType) -> str:
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


class ReadWatch:
    """Watches one run of the step: `with ReadWatch() as watch: step(...)`, then `watch.reads`.

    Installs a profile function on the calling thread for the duration (restoring the previous
    one after), and a listener on module attribute writes. `arguments`: (label, value) of the
    step's non-tensor arguments, whose contents are guarded too.
    """

    def __init__(self, arguments: list[tuple[str, Any]] = ()) -> None:
        self.reads = Reads(
            arguments=[(label, v) for label, v in arguments if contents.walkable(v, None)],
            opaque=[(label, v) for label, v in arguments if contents.opaque(v)],
        )
        self._names: set[str] = set()
        self._owners: dict[tuple[int, str], tuple[Any, str]] = {}
        self._modules: dict[int, nn.Module] = {}
        self._codes: dict[types.CodeType, bool] = {}  # code -> is user code
        self._namespaces: dict[tuple[int, str], tuple[dict, str]] = {}
        self._sites: dict[Any, tuple[types.CodeType, int]] = {}  # see `Reads.sites`
        self._written_globals: set[tuple[int, str]] = set()
        self._closures: dict[types.CodeType, set[tuple[int, ...]]] = {}
        """Codes of closures that ran, with the ids of their cells' contents in each run."""
        self._found: dict[types.CodeType, list[types.FunctionType]] = {}
        """Functions of those runs, found where their caller holds them."""
        self._module_writes: set[tuple[int, str]] = set()
        self._previous: Any = None
        self._chain: Callable | None = None
        self._starts: tracing.Starts | None = None

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
        for _, value in self.reads.arguments:
            contents.snapshot(value, self.reads.before)
        barriers.add_listener(self._on_write)
        # Hooks called inside compiled models too: not to be compiled.
        if tracing.chosen() == "monitoring":
            self._starts = tracing.Starts(self._started, unseen)
            if not self._starts.start():  # every tool id taken: the profile function instead
                self._starts = None
        if self._starts is None:
            sys.setprofile(unseen(self._profile))
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.reads.complete:
            return
        if self._starts is not None:
            self._starts.stop()
        else:
            sys.setprofile(self._previous)
        barriers.remove_listener(self._on_write)
        if exc[0] is None:
            self._finish()

    def _on_write(self, module: nn.Module, name: str) -> None:
        self._module_writes.add((id(module), name))

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self._chain is not None:
            self._chain(frame, event, arg)
        if event == "call":
            self._started(frame)

    def _started(self, frame: types.FrameType) -> bool:
        """A frame starts (or resumes). False: its code object needs no more looks in this watch (not
        the user's, or the user's without closure variables, whose first look is all)."""
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
        return user and code in self._closures

    def _first_call(self, frame: types.FrameType, code: types.CodeType) -> None:
        facts = _facts(code)
        namespace = frame.f_globals
        before = self.reads.before
        for ns, name, line in _global_locations(code, namespace):
            self._namespaces.setdefault((id(ns), name), (ns, name))
            self._sites.setdefault((id(ns), name), line)
            contents.snapshot(ns.get(name), before)
        self._written_globals.update((id(namespace), n) for n in facts.globals_written)
        local = frame.f_locals
        if [n for n in code.co_freevars if n != "__class__"]:
            self._closures[code] = set()
            for n in code.co_freevars:
                contents.snapshot(local.get(n), before)
        self._names |= facts.attributes_read
        for how, variable, attribute in facts.object_attributes:
            owner = namespace.get(variable) if how == "global" else local.get(variable)
            if how == "fast" or isinstance(owner, nn.Module):  # other objects are walked as globals or cells
                self._attribute(owner, attribute, _line(code, "a", attribute))
        if code.co_argcount or code.co_kwonlyargcount:
            self._defaults(frame, code)
        self.reads.functions.append(_describe_code(code))

    def _attribute(self, owner: Any, attribute: str, line: tuple[types.CodeType, int]) -> None:
        """`owner.attribute` loaded by user code (at `line`): a container there is guarded by content."""
        if isinstance(owner, nn.Module):
            self._modules.setdefault(id(owner), owner)
        elif owner is None or isinstance(owner, contents.IDENTITY_OK) or not hasattr(owner, "__dict__"):
            return
        value = vars(owner).get(attribute, MISSING)
        if contents.walkable(value, None) and (id(owner), attribute) not in self._owners:
            self._owners[(id(owner), attribute)] = (owner, attribute)
            self.reads.sites[(id(owner), attribute)] = line
            contents.snapshot(value, self.reads.before)

    def _defaults(self, frame: types.FrameType, code: types.CodeType) -> None:
        """Containers among the default arguments of the function running in `frame`, if found."""
        fn = _function_of(frame, code)
        if fn is None:
            return
        positional = code.co_varnames[: code.co_argcount]
        defaults = list(
            zip(positional[len(positional) - len(fn.__defaults__ or ()) :], fn.__defaults__ or ())
        )
        for name, value in defaults + list((fn.__kwdefaults__ or {}).items()):
            if contents.walkable(value, None):
                self.reads.defaults.append((f"default of {name!r} in {_describe_code(code)}", value))
                contents.snapshot(value, self.reads.before)

    def _finish(self) -> None:
        reads = self.reads
        for key, (namespace, name) in self._namespaces.items():
            label = f"global {name!r} in {_file_label(namespace)}"
            if key in self._written_globals:
                reads.written.append(label)
            elif name in namespace:  # otherwise a builtin
                reads.globals.append((label, namespace, name))
                reads.sites[label] = self._sites[key]
        reads.module_writes = frozenset(self._module_writes)
        reads.attribute_names = frozenset(self._names)
        reads.attributes = [a for key, a in self._owners.items() if key not in reads.module_writes]
        reads.modules = list(self._modules.values())
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
                contents = tuple(id(cell_value(c)) for c in fn.__closure__ or ())
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
                        reads.sites[label] = _line(code, "d", name)


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
            and tuple(id(cell_value(c)) for c in fn.__closure__ or ()) == values
        ):
            return fn
    return None


def _function_of(frame: types.FrameType, code: types.CodeType) -> Any:
    """The function running in `frame`, where it is cheap to find: a global of its name, a method
    of its first argument's class, or a name in its caller's frame. None otherwise."""
    candidates = [frame.f_globals.get(code.co_name)]
    if code.co_argcount:
        first = frame.f_locals.get(code.co_varnames[0])
        candidates.append(inspect.getattr_static(type(first), code.co_name, None))
    if frame.f_back is not None:
        candidates += frame.f_back.f_locals.values()
    for value in candidates:
        fn = getattr(value, "__func__", value)  # bound method, staticmethod, classmethod
        fn = fn.func if isinstance(fn, functools.partial) else fn
        if isinstance(fn, types.FunctionType) and fn.__code__ is code:
            return fn
    return None
