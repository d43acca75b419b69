"""Write barriers: a cheap notice of writes to the Python state of modules, instead of a scan.

A replay checks that nothing a graph baked in changed. Scanning every module's mode and
attributes before each replay costs O(modules); most replays follow no change at all. So
graphstep learns about writes when they happen:

- registrations: torch's global parameter, buffer and submodule registration hooks (and
  `del module.weight`) bump `structure_epoch`;
- attributes: `torch.nn.Module.__setattr__` and `__delattr__` are wrapped, once, when the
  first guard is made (never at import). A write that gives a *watched* module's `__dict__`
  entry another object (`drop.p = 0.0`, `module.training = False` from `train()`/`eval()`)
  is added to the dirty set of every `ModuleWatch` watching that module. A replay then pays
  one truthiness test; only the written names are compared with what the graph saw.

Writes that bypass `Module.__setattr__` are not seen: `object.__setattr__(m, ...)`,
`m.__dict__[name] = ...`, `vars(m).update(...)`, writes to class attributes, and module
classes that override `__setattr__` without calling `nn.Module.__setattr__` (those modules
are scanned on every replay instead). `Config(check="strict")` scans every module on every
replay and trusts no barrier.
"""

from __future__ import annotations

import enum
import itertools
import numbers
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .compiling import compiling

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "(absent)"})()
"""The value of an attribute that does not exist."""

_epoch = itertools.count(1)
structure_epoch = 0
"""Bumped by every parameter, buffer or submodule (re-)registration or deletion in the process."""

_watchers: dict[int, list[set]] = {}
"""id(module) -> the dirty sets of the `ModuleWatch`es watching it."""
_listeners: list[Callable[[nn.Module, str], None]] = []
"""Called with (module, name) for every attribute write that changed the object (ReadWatch)."""

_installed = False
_original_setattr: Callable | None = None
_original_delattr: Callable | None = None
_internal_names: frozenset[str] = frozenset()
"""`__dict__` entries every module has (hook tables, `_parameters`, `training`, ...)."""


def _bump_structure_epoch(*_: Any) -> None:
    # A torch.compile'd model may register modules while dynamo traces it (transformers slices
    # its ModuleList of layers: a new ModuleList every forward). Traced, this hook would make
    # dynamo guard on the counter's value, which every call advances: a recompile on every call,
    # the capture included (where inductor cannot run). Those modules are the traced code's own
    # temporaries; registrations a replay depends on happen in eager code between calls.
    if compiling():
        return
    global structure_epoch
    structure_epoch = next(_epoch)


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    if compiling():  # traced, the bookkeeping would make dynamo guard on graphstep's tables
        return _original_setattr(self, name, value)
    dirty = _watchers.get(id(self))
    if dirty is None and not _listeners:
        return _original_setattr(self, name, value)
    d = self.__dict__
    old = d.get(name, MISSING)
    _original_setattr(self, name, value)
    if d.get(name, MISSING) is not old:  # `model.train()` on a model in train mode writes nothing new
        _noted(self, name, dirty)


def _delattr(self: nn.Module, name: str) -> None:
    registered = any(name in self.__dict__.get(t, ()) for t in ("_parameters", "_buffers", "_modules"))
    dirty = _watchers.get(id(self))
    old = self.__dict__.get(name, MISSING)
    _original_delattr(self, name)
    if registered:
        _bump_structure_epoch()
    elif old is not MISSING:
        _noted(self, name, dirty)


def _noted(module: nn.Module, name: str, dirty: list[set] | None) -> None:
    for s in dirty or ():
        s.add((id(module), name))
    for listener in _listeners:
        listener(module, name)


def install() -> None:
    """Install the registration hooks and the attribute barrier. Idempotent."""
    global _installed, _original_setattr, _original_delattr, _internal_names
    if _installed:
        return
    from torch.nn.modules import module

    for name in (
        "register_module_parameter_registration_hook",
        "register_module_buffer_registration_hook",
        "register_module_module_registration_hook",
    ):
        register = getattr(module, name, None)
        if register is not None:
            register(_bump_structure_epoch)  # returns None: the registration goes ahead unchanged
    _internal_names = frozenset(nn.Module().__dict__)
    _original_setattr, _original_delattr = nn.Module.__setattr__, nn.Module.__delattr__
    _setattr.__wrapped__ = _original_setattr  # type: ignore[attr-defined]
    _delattr.__wrapped__ = _original_delattr  # type: ignore[attr-defined]
    nn.Module.__setattr__ = _setattr
    nn.Module.__delattr__ = _delattr
    _installed = True


def intact() -> bool:
    """False once somebody replaced `nn.Module.__setattr__` after us: then scan instead."""
    return nn.Module.__setattr__ is _setattr and nn.Module.__delattr__ is _delattr


def add_listener(listener: Callable[[nn.Module, str], None]) -> None:
    install()
    _listeners.append(listener)


def remove_listener(listener: Callable[[nn.Module, str], None]) -> None:
    _listeners.remove(listener)


# -- values ----------------------------------------------------------------------------------

_SIMPLE = (
    numbers.Number,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def is_simple(value: Any) -> bool:
    """A Python value a graph can bake in and that is compared by value: a number, bool,
    string, None, dtype, device, enum member, or a tuple/frozenset of those."""
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (*_SIMPLE, enum.Enum)):
        return True
    return type(value) in (tuple, frozenset) and all(map(is_simple, value))


def is_input_value(value: Any) -> bool:
    """An attribute value that is an input of the step, copied in per call rather than guarded: a
    FlexAttention `BlockMask` built per batch (see `module_inputs.py`)."""
    kind = type(value)
    return kind.__name__ == "BlockMask" and kind.__module__ == "torch.nn.attention.flex_attention"


def same(now: Any, was: Any, by_value: bool) -> bool:
    """`now` is what the graph saw: the same object, or an equal simple value of the same type."""
    return now is was or (by_value and type(now) is type(was) and bool(now == was))


def describe(value: Any) -> str:
    if value is MISSING or is_simple(value):
        return repr(value)
    return f"<{type(value).__qualname__} object>"


def change(label: str, was: Any, now: Any, by_value: bool) -> tuple[str, bool] | None:
    """How a value a graph read differs now, as `(text, is_value_change)`; None when it does not."""
    if same(now, was, by_value):
        return None
    if by_value and (now is MISSING or is_simple(now)):
        return f"{label}: {describe(was)} -> {describe(now)}", True
    return f"{label}: now refers to another object ({describe(now)})", False


# -- the watch over a step's modules ------------------------------------------------------------


def attribute_items(module: nn.Module) -> Iterable[tuple[str, Any]]:
    """A module's own Python attributes: its `__dict__` less torch's bookkeeping and `training`."""
    return ((k, v) for k, v in module.__dict__.items() if k not in _internal_names)


class ModuleWatch:
    """Modes and Python attributes of modules, as a graph saw them, checked through the barrier.

    Simple values (see `is_simple`) are compared by value, other attributes by identity.
    `skip`: (id(module), name) pairs not guarded (written by the step itself: a replay does not
    write them, and two graphs would undo each other's writes). Attributes that hold an input
    (`is_input_value`) are not guarded either: `module_inputs.py` loads and checks them.
    """

    def __init__(
        self,
        named_modules: list[tuple[str, nn.Module]],
        *,
        scan: bool,
        skip: frozenset[tuple[int, str]] = frozenset(),
    ):
        install()
        seen: set[int] = set()
        unique = [(n, m) for n, m in named_modules if not (id(m) in seen or seen.add(id(m)))]
        self.names = [n for n, _ in unique]
        self.modules = [m for _, m in unique]
        self.index = {id(m): i for i, m in enumerate(self.modules)}
        self.training = [m.training for m in self.modules]
        inputs = {(id(m), k) for m in self.modules for k, v in attribute_items(m) if is_input_value(v)}
        self.skip = skip | inputs if inputs else skip
        self.attrs = [self._attrs_of(m) for m in self.modules]
        self.sizes = [len(m.__dict__) for m in self.modules]
        self.scan = scan
        # Classes that override __setattr__ may write without the barrier: scan those always.
        self.scanned = [i for i, m in enumerate(self.modules) if type(m).__setattr__ is not _setattr]
        self.dirty: set[tuple[int, str]] = set()
        ids = list(self.index)
        for i in ids:
            _watchers.setdefault(i, []).append(self.dirty)
        weakref.finalize(self, _unwatch, ids, self.dirty)

    def _attrs_of(self, m: nn.Module) -> dict[str, tuple[Any, bool]]:
        mid = id(m)
        return {k: (v, is_simple(v)) for k, v in attribute_items(m) if (mid, k) not in self.skip}

    def _attr_holds(self, i: int, name: str) -> bool:
        if name == "training":
            return self.modules[i].training == self.training[i]
        if (id(self.modules[i]), name) in self.skip:
            return True
        was, by_value = self.attrs[i].get(name, (MISSING, True))
        return same(self.modules[i].__dict__.get(name, MISSING), was, by_value)

    def _module_holds(self, i: int) -> bool:
        """A scan of one module: its mode, every recorded attribute, and no attribute added."""
        m = self.modules[i]
        d = m.__dict__
        if m.training != self.training[i] or len(d) != self.sizes[i]:
            return False
        for k, (was, by_value) in self.attrs[i].items():
            now = d.get(k, MISSING)
            if now is not was and not (by_value and type(now) is type(was) and now == was):
                return False
        return True

    def holds(self) -> bool:
        """Cheap unless a watched module was written since the last check (or cannot be trusted)."""
        if self.scan or not intact():
            return all(map(self._module_holds, range(len(self.modules))))
        if self.dirty:
            if not all(self._attr_holds(self.index[mid], name) for mid, name in self.dirty):
                return False
            self.dirty.clear()  # written, but back to (or still at) what the graph saw
        return not self.scanned or all(map(self._module_holds, self.scanned))

    def changes(self) -> list[tuple[str, bool]]:
        """(text, is_value_change) for every difference, by qualified name. A full scan."""
        found = []
        for name, m, was_training, recorded in zip(self.names, self.modules, self.training, self.attrs):
            if m.training != was_training:
                mode = "train" if m.training else "eval"
                found.append(
                    (
                        f"{name}: switched to {mode} mode (captured in {'train' if was_training else 'eval'})",
                        True,
                    )
                )
            now = self._attrs_of(m)
            for key in sorted(recorded.keys() | now.keys()):
                was, by_value = recorded.get(key, (MISSING, True))
                differs = change(f"{name}.{key}", was, now.get(key, (MISSING, True))[0], by_value)
                if differs is not None:
                    found.append(differs)
        if not found:  # nothing the graph depends on: adopt what was written
            self.dirty.clear()
            self.sizes = [len(m.__dict__) for m in self.modules]
        return found


def _unwatch(ids: list[int], dirty: set) -> None:
    for i in ids:
        sets = _watchers.get(i)
        if sets is None:
            continue
        sets[:] = [s for s in sets if s is not dirty]
        if not sets:
            del _watchers[i]


def cell_value(cell: types.CellType) -> Any:
    """What a closure cell holds, or MISSING while it is not assigned yet."""
    try:
        return cell.cell_contents
    except ValueError:
        return MISSING
