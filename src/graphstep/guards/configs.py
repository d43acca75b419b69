"""Config objects of libraries, read by content: what a walk (walk.py) reads from each, and what a
replay compares to know that nothing changed.

A step that reads `cfg.loss.smoothing` from an OmegaConf `DictConfig` reaches the number through
OmegaConf's own Python: the read watch (reads.py) sees the user's code load the global `cfg` and
attributes named `loss` and `smoothing`, and nothing else. So the walk reads such objects whole, as
the step would read them, entry by entry, and nested configs with them:

- OmegaConf `DictConfig` and `ListConfig`: every entry through `cfg[key]`, so an interpolation
  (`${loss.smoothing}`) is frozen as the value it resolves to. A replay compares the storage
  (`_content`, and each value node's `_val`) by identity, in C with the helper. An interpolation
  depends on nodes anywhere in its config's tree (`LOSS = cfg.loss` reading `${train.scale}`): one
  without a resolver call adds the storage of the whole tree, compared the same way; one with a
  resolver call (`${oc.env:SCALE}`, a resolver of the user's), whose value can change with no write
  to the config, is resolved again on every replay (OmegaConf parses it each time: about 190 us on
  the CPU of benchmarks/results/cpu_2026-11-25_config-guard-cost.json).
- ml_collections `ConfigDict` and `FrozenConfigDict`: the `_fields` dict by identity, each
  `FieldReference` read again (its value can change without the dict changing).
- any other `collections.abc.Mapping` (`types.MappingProxyType`, `UserDict`, `ChainMap`) or
  `Sequence` (`UserList`, `array.array`): through the protocol, its keys and values compared with
  the ones seen (an equal number or string read afresh holds). A mapping proxy through the live views
  of the dict behind it.
- data objects read by field: attrs classes (`__attrs_attrs__`), pydantic models (their declared
  fields and any extra ones), `argparse.Namespace` (its `__dict__`, like `SimpleNamespace`); walk.py
  reads them as it reads dataclasses.

No library is imported here: a type is recognised through `sys.modules` (an object of a library's
class exists only once the library was imported). OmegaConf's and ml_collections' storage is read
directly because their public reads cost microseconds each (about 120 us per replay for 20 keys of a
`DictConfig` through the Mapping protocol; about 1 us through `_content`, or 0.2 us in the helper's
identity pass); where it is not laid out as expected (another version), a `DictConfig` is read through
the protocol instead, and a `ConfigDict` (no Mapping) is named as an object no guard can see into.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import operator
import sys
import types
from collections.abc import Callable
from typing import Any

from .barriers import is_simple

_NOT_SEQUENCES = (str, bytes, bytearray, memoryview, range)
"""Sequences that are not settings: strings are values, byte buffers and memory views data, a range
is harmless (see walk.py)."""


class Unreadable:
    """An entry whose read raised (an OmegaConf `???`, an interpolation to a missing key): frozen as
    the kind of error, so that a read that starts to work is a change."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = type(error).__name__


def _same(now: Any, was: Any) -> bool:
    """The object seen, or an equal simple value (an interpolation builds a new string per read)."""
    if now is was:
        return True
    if isinstance(was, Unreadable):
        return isinstance(now, Unreadable) and now.error == was.error
    return type(now) is type(was) and is_simple(now) and bool(now == was)


def _read(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:  # the step would have met it too; a later read that works is a change
        return Unreadable(exc)


class Resolved:
    """A replay's check of an entry a config computes when read (an interpolation, a FieldReference):
    reading it again gives what the graph saw."""

    __slots__ = ("read", "seen")

    def __init__(self, read: Callable[[], Any], seen: Any):
        self.read, self.seen = read, seen

    def __call__(self) -> bool:
        return _same(_read(self.read), self.seen)


class SameItems:
    """A replay's check of a Mapping's keys or values, or a Sequence's items, read through its
    protocol: the objects seen, or equal simple values (a read may build them afresh)."""

    __slots__ = ("items", "seen")

    def __init__(self, items: Any, seen: tuple):
        self.items, self.seen = items, seen

    def __call__(self) -> bool:
        try:
            now = tuple(self.items)
        except Exception:
            return False
        if len(now) != len(self.seen):
            return False
        return all(map(operator.is_, now, self.seen)) or all(map(_same, now, self.seen))


@dataclasses.dataclass
class View:
    """What a walk reads from a config object, and what a replay compares."""

    tag: str
    """How its entries are named in a path: "a" as attributes (`.loss`), "d" by key (`['loss']`),
    "s" by index (`[0]`)."""
    entries: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    """(key, value) as the step reads them (interpolations resolved)."""
    dicts: list[dict] = dataclasses.field(default_factory=list)
    """Plain dicts holding its entries: their keys and values compared by identity."""
    stores: list[tuple[dict, str]] = dataclasses.field(default_factory=list)
    """(an object's `__dict__`, name): an attribute of its storage (a node's value), by identity."""
    seqs: list[Any] = dataclasses.field(default_factory=list)
    """Lists (or live views) holding its entries: their items compared by identity."""
    calls: list[Callable[[], bool]] = dataclasses.field(default_factory=list)
    """Checks that read again what the config computes when read; each answers True while it holds."""
    trees: list[tuple[Any, Resolved]] = dataclasses.field(default_factory=list)
    """(root, check) per interpolation without a resolver call: it holds while the storage of the
    tree under `root` does (`storage`); `check` where that tree is too large to compare."""


def field_names(value: Any) -> tuple[str, ...] | None:
    """The fields of an attrs instance or a pydantic model (its extra fields as one entry), else None."""
    cls = type(value)
    declared = getattr(cls, "__attrs_attrs__", None)
    if declared is not None and not isinstance(value, type):
        return tuple(a.name for a in declared)
    base = getattr(sys.modules.get("pydantic.main"), "BaseModel", None)
    if base is not None and isinstance(value, base):
        names = tuple(getattr(cls, "__pydantic_fields__", None) or getattr(cls, "__fields__", None) or ())
        if isinstance(getattr(value, "__pydantic_extra__", None), dict):
            names += ("__pydantic_extra__",)
        return names
    return None


def is_namespace(value: Any) -> bool:
    """An `argparse.Namespace` (read like a SimpleNamespace, by its `__dict__`)."""
    namespace = getattr(sys.modules.get("argparse"), "Namespace", None)
    return namespace is not None and isinstance(value, namespace)


def kind(value: Any) -> str | None:
    """ "omegaconf", "ml_collections", "mapping" or "sequence" for an object `view()` reads; else None.
    Plain containers (dict, list, tuple, ...) are walk.py's own and answer "mapping"/"sequence" too."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(value, omegaconf.Container):
        return "omegaconf"
    ml_collections = sys.modules.get("ml_collections")
    config_dict = getattr(ml_collections, "ConfigDict", None)
    if config_dict is not None and isinstance(value, config_dict):
        return "ml_collections"
    if isinstance(value, collections.abc.Mapping):
        return "mapping"
    if isinstance(value, collections.abc.Sequence) and not isinstance(value, _NOT_SEQUENCES):
        return "sequence"
    return None


def view(value: Any) -> View | None:
    """How to read `value` by content, if it is a config object, a Mapping or a Sequence."""
    found = kind(value)
    if found == "omegaconf":
        return _omegaconf(value, sys.modules["omegaconf"]) or _protocol(value)
    if found == "ml_collections":
        return _config_dict(value, sys.modules["ml_collections"])
    if found is not None:
        return _protocol(value)
    return None


def _omegaconf(cfg: Any, omegaconf: Any) -> View | None:
    """A DictConfig or ListConfig through its storage: `_content` (a dict or list of nodes), each
    value node's `_val`, each container node's `_content`. None: not laid out so (another version)."""
    own = vars(cfg)
    content = own.get("_content")
    if isinstance(content, dict):
        out, nodes = View("a", dicts=[content]), list(content.items())
    elif isinstance(content, list):
        out, nodes = View("s", seqs=[content]), list(enumerate(content))
    elif "_content" in own:  # None, "???" or an interpolation: the node is a value, which its parent reads
        return View("a", stores=[(own, "_content")])
    else:
        return None
    out.stores.append((own, "_content"))
    is_interpolation = omegaconf.OmegaConf.is_interpolation
    get_root = getattr(cfg, "_get_root", None)
    for key, node in nodes:
        storage = "_content" if isinstance(node, omegaconf.Container) else "_val"
        node_dict = getattr(node, "__dict__", None)
        if node_dict is None or storage not in node_dict:
            return None
        out.stores.append((node_dict, storage))
        read = functools.partial(operator.getitem, cfg, key)
        value = _read(read)
        if is_interpolation(cfg, key):
            check = Resolved(read, value)
            raw = node_dict[storage]
            if get_root is not None and isinstance(raw, str) and ":" not in raw:  # node references only
                out.trees.append((get_root(), check))
            else:
                out.calls.append(check)
        out.entries.append((key, value))
    return out


def storage(root: Any, limit: int) -> View | None:
    """The storage of a whole OmegaConf tree (every container's `_content`, every value node's `_val`),
    which every interpolation in it without a resolver call depends on; None past `limit` nodes, or
    where a node is not laid out so."""
    container = sys.modules["omegaconf"].Container
    out, stack, count = View("a"), [root], 0
    while stack:
        own = getattr(stack.pop(), "__dict__", None)
        if own is None or "_content" not in own:
            return None
        out.stores.append((own, "_content"))
        content = own["_content"]
        if isinstance(content, dict):
            out.dicts.append(content)
            nodes = list(content.values())
        elif isinstance(content, list):
            out.seqs.append(content)
            nodes = list(content)
        else:
            continue
        count += len(nodes)
        if count > limit:
            return None
        for node in nodes:
            if isinstance(node, container):
                stack.append(node)
                continue
            node_dict = getattr(node, "__dict__", None)
            if node_dict is None or "_val" not in node_dict:
                return None
            out.stores.append((node_dict, "_val"))
    return out


def _config_dict(cfg: Any, ml_collections: Any) -> View | None:
    """A ConfigDict through its `_fields` dict; a FieldReference in it is read again on every replay."""
    own = vars(cfg)
    fields = own.get("_fields")
    if type(fields) is not dict:
        return None
    reference = getattr(ml_collections, "FieldReference", ())
    out = View("a", dicts=[fields], stores=[(own, "_fields")])
    for key, raw in fields.items():
        read = functools.partial(operator.getitem, cfg, key)
        value = _read(read)
        if isinstance(raw, reference):
            out.calls.append(Resolved(read, value))
        out.entries.append((key, value))
    return out


def _protocol(value: Any) -> View:
    """Any Mapping (its keys and `m[key]`) or Sequence (its items), compared by `SameItems`."""
    if isinstance(value, collections.abc.Mapping):
        keys = tuple(value)
        out = View("d", entries=[(k, _read(functools.partial(operator.getitem, value, k))) for k in keys])
        values = tuple(v for _, v in out.entries)
        if type(value) is types.MappingProxyType:  # live views of the dict behind it: read in C
            out.seqs += [value.keys(), value.values()]
        else:
            out.calls += [
                SameItems(collections.abc.KeysView(value), keys),
                SameItems(collections.abc.ValuesView(value), values),
            ]
        return out
    items = tuple(value)
    return View("s", entries=list(enumerate(items)), calls=[SameItems(value, items)])
