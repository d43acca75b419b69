"""Pytrees of a step's arguments and results, and the key that picks a graph.

A call's arguments are flattened into tensor leaves and a hashable *spec* (the structure
with every non-tensor value inside it). The key of a graph is the spec plus each tensor's
shape, dtype, device, stride and requires_grad: two calls with the same key can replay the
same graph, any difference needs another graph. Tuples, lists, dicts, namedtuples,
dataclasses, any `Mapping` (transformers' `BatchEncoding`, `UserDict`), any type registered with
torch's pytree, and FlexAttention's `BlockMask` are containers, rebuilt with the caller's type;
everything else that is not a tensor is a Python value that becomes part of the key, so it must
be hashable.

A `BlockMask` is built per batch: its tensors, and the tensors its `mask_mod` closes over (a
document-id tensor in a closure cell, at any depth of nested closures and partials), are inputs
copied in per call; the mask function's code, block size and sequence lengths are the key. (A
function anywhere else is a Python value: compared by identity.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import UnsupportedInputError, UnsupportedOutputError

_TENSOR = "<tensor>"  # a spec's placeholder for a tensor leaf
TENSOR_SPEC = _TENSOR
"""The spec of a tree that is one tensor (a step returning its loss): `spec is TENSOR_SPEC`."""
_FLAT_SPECS: dict[int, Any] = {}  # the spec of `step(t1, ..., tn)`, by n
_PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, nn.Parameter))
_VALUES = frozenset((int, float, bool, str, bytes, type(None), torch.dtype, torch.device))
"""Types that are values however they are registered: the common non-tensor argument, decided at once."""
_EMPTY_CELL: Any = type("EmptyCell", (), {"__repr__": lambda self: "(empty cell)"})()


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        # tuple.__new__: the namedtuple's own __new__ is a Python function, and this runs per call.
        return tuple.__new__(cls, (t.shape, t.dtype, t.device, t.stride(), t.requires_grad))

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{dtype}{list(self.shape)} on {self.device}{grad}"


def flat_spec(n: int) -> Any:
    """The spec of a call `step(t1, ..., tn)` with plain tensors: one object per n, shared by the
    Signatures of such calls (`spec is flat_spec(n)` tells them apart from any other)."""
    spec = _FLAT_SPECS.get(n)
    if spec is None:
        spec = _FLAT_SPECS[n] = flatten((tuple(torch.empty(0) for _ in range(n)), {}))[1]
    return spec


def flatten(tree: Any) -> tuple[list[torch.Tensor], Any]:
    """Split `tree` into its tensor leaves (in order) and a hashable spec of everything else."""
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(tree, leaves)


def _flatten(node: Any, leaves: list[torch.Tensor], fns: bool = False) -> Any:
    """`fns`: inside a `BlockMask`, where a function is a container of its closure (see the module)."""
    if isinstance(node, torch.Tensor):
        leaves.append(node)
        return _TENSOR
    kind = type(node)
    if kind is tuple or kind is list:
        return (kind, tuple(_flatten(child, leaves, fns) for child in node))
    if kind is dict:
        return (dict, tuple(node), tuple(_flatten(child, leaves, fns) for child in node.values()))
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
        return (kind, tuple(_flatten(child, leaves, fns) for child in node))
    if kind in _VALUES:
        return ("value", kind, node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        names = tuple(f.name for f in dataclasses.fields(node) if f.init)
        return (kind, names, tuple(_flatten(getattr(node, n), leaves, fns) for n in names))
    if kind.__name__ == "BlockMask" and kind.__module__ == "torch.nn.attention.flex_attention":
        # Before pytree: some torch versions register it, with its mask function in the context.
        names = tuple(node.__dict__)
        return ("object", kind, names, tuple(_flatten(node.__dict__[n], leaves, True) for n in names))
    if fns and kind is types.FunctionType:
        return _flatten_function(node, leaves)
    if fns and kind is functools.partial:
        parts = (node.func, node.args, node.keywords)
        return ("partial", kind, _flatten(parts, leaves, True))
    registered = pytree.SUPPORTED_NODES.get(kind)
    if registered is not None:
        children, context = registered.flatten_fn(node)
        return ("pytree", kind, _Context(context), tuple(_flatten(c, leaves, fns) for c in children))
    if isinstance(node, Mapping) and kind.__hash__ is None:  # (a hashable one stays a value, as it was)
        return _flatten_mapping(node, kind, leaves, fns)
    # A Python value: kept in the key with its type, so that 1, 1.0 and True differ.
    return ("value", kind, node)


def _flatten_function(fn: types.FunctionType, leaves: list[torch.Tensor]) -> Any:
    """A mask function by its code; what its closure cells and defaults hold is flattened."""
    cells = tuple(_flatten(_cell(c), leaves, True) for c in fn.__closure__ or ())
    extras = (fn.__defaults__, fn.__kwdefaults__, fn.__dict__ or None)
    defaults = _flatten(extras, leaves, True) if any(extras) else None
    return ("function", fn.__code__, _Identity(fn.__globals__), fn.__qualname__, defaults, cells)


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet
        return _EMPTY_CELL


def _flatten_mapping(node: Mapping, kind: type, leaves: list[torch.Tensor], fns: bool) -> Any:
    """A Mapping of the caller's type: its items, and the other attributes of a dict or UserDict."""
    extra: dict[str, Any] = {}
    if isinstance(node, (dict, collections.UserDict)):
        extra = {k: v for k, v in getattr(node, "__dict__", {}).items() if k != "data"}
    encodings = _is_batch_encoding(kind) and extra.pop("_encodings", None) is not None
    items = tuple(_flatten(v, leaves, fns) for v in node.values())
    return ("mapping", kind, tuple(node), items, _flatten(extra, leaves, fns), encodings)


def _is_batch_encoding(kind: type) -> bool:
    return kind.__name__ == "BatchEncoding" and kind.__module__.startswith("transformers")


class _Context:
    """A pytree context in a key: compared by value, hashed by a hashable rendering of it."""

    __slots__ = ("_hash", "value")

    def __init__(self, value: Any):
        self.value = value
        self._hash = hash(_frozen(value))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Context):
            return NotImplemented
        try:
            return self.value is other.value or bool(self.value == other.value)
        except Exception:  # a context whose == does not give a bool (tensors in it)
            return False


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(map(_frozen, value))
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    try:
        hash(value)
    except TypeError:
        return type(value)
    return value


class _Identity(NamedTuple):
    """An object in a key by identity (a function's globals)."""

    value: Any

    __hash__ = lambda self: id(self.value)  # noqa: E731
    __eq__ = lambda self, other: isinstance(other, _Identity) and other.value is self.value  # noqa: E731


def unflatten(spec: Any, leaves: list[torch.Tensor] | Iterator[Any]) -> Any:
    """Rebuild the tree of `spec`, taking tensor leaves from `leaves` in order."""
    return _unflatten(spec, iter(leaves))


def _unflatten(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec is _TENSOR:
        return next(leaves)
    kind = spec[0]
    if kind == "value":
        return spec[2]
    if kind is tuple or kind is list:
        return kind(_unflatten(child, leaves) for child in spec[1])
    if kind is dict:
        return {k: _unflatten(child, leaves) for k, child in zip(spec[1], spec[2])}
    if kind in _REBUILD:
        return _REBUILD[kind](spec, leaves)
    if dataclasses.is_dataclass(kind):
        return kind(**{n: _unflatten(child, leaves) for n, child in zip(spec[1], spec[2])})
    return kind(*(_unflatten(child, leaves) for child in spec[1]))  # namedtuple


def _rebuild_object(spec: Any, leaves: Iterator[Any]) -> Any:
    _, kind, names, children = spec
    obj = kind.__new__(kind)
    obj.__dict__.update(zip(names, (_unflatten(c, leaves) for c in children)))
    return obj


def _rebuild_function(spec: Any, leaves: Iterator[Any]) -> Any:
    _, code, namespace, qualname, defaults_spec, cells = spec
    contents = [_unflatten(c, leaves) for c in cells]
    extras = (None,) * 3 if defaults_spec is None else _unflatten(defaults_spec, leaves)
    defaults, kwdefaults, attributes = extras
    closure = tuple(types.CellType() if v is _EMPTY_CELL else types.CellType(v) for v in contents)
    fn = types.FunctionType(code, namespace.value, code.co_name, defaults, closure or None)
    fn.__qualname__ = qualname
    fn.__kwdefaults__ = kwdefaults
    fn.__dict__.update(attributes or {})
    return fn


def _rebuild_partial(spec: Any, leaves: Iterator[Any]) -> Any:
    func, args, keywords = _unflatten(spec[2], leaves)
    return functools.partial(func, *args, **keywords)


def _rebuild_pytree(spec: Any, leaves: Iterator[Any]) -> Any:
    _, kind, context, children = spec
    return pytree.SUPPORTED_NODES[kind].unflatten_fn([_unflatten(c, leaves) for c in children], context.value)


def _rebuild_mapping(spec: Any, leaves: Iterator[Any]) -> Any:
    _, kind, keys, items, extra_spec, encodings = spec
    data = dict(zip(keys, (_unflatten(c, leaves) for c in items)))
    extra = _unflatten(extra_spec, leaves)
    if encodings:  # the tokenizer's host-side alignment: not an input a graph can follow
        extra["_encodings"] = _NoEncodings()
    if issubclass(kind, (dict, collections.UserDict)):
        obj = kind.__new__(kind)
        obj.__dict__.update(extra)
        if issubclass(kind, dict):
            dict.update(obj, data)
        else:
            obj.data = data
        return obj
    try:
        return kind(data)
    except Exception as exc:
        raise UnsupportedInputError(
            f"graphstep cannot rebuild a {kind.__qualname__} (a Mapping) from its items: {kind.__qualname__}(dict) "
            f"raised {type(exc).__name__}: {exc}. Register the type with torch.utils._pytree.register_pytree_node "
            "so that graphstep knows how to rebuild it, or pass a dict."
        ) from exc


class _NoEncodings:
    """A captured step's `BatchEncoding.encodings`: a replay runs no Python, so what the step read from
    the tokenizer's per-sequence encodings (word_ids, offsets) would stay as it was at capture."""

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise UnsupportedInputError(
            "the step reads the tokenizer's encodings of a BatchEncoding argument (word_ids(), "
            "token_to_chars(), .encodings, ...). They live on the host and change with every batch, and "
            "a replay runs no Python, so the graph would keep the values of the capture. Compute what you "
            "need from them before the call and pass it as a tensor."
        )

    __getitem__ = __len__ = __iter__ = __bool__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (copy, pickle and walks probe for these)
            raise AttributeError(name)
        return self._refuse()


_REBUILD = {
    "object": _rebuild_object,
    "function": _rebuild_function,
    "partial": _rebuild_partial,
    "pytree": _rebuild_pytree,
    "mapping": _rebuild_mapping,
}


def paths(spec: Any, root: str) -> Iterator[tuple[str, Any]]:
    """Yield `(path, leaf_spec)` for every leaf, paths written the way Python would index them."""
    if spec is _TENSOR or spec[0] == "value":
        yield root, spec
        return
    kind = spec[0]
    if kind is dict:
        for k, child in zip(spec[1], spec[2]):
            yield from paths(child, f"{root}[{k!r}]")
    elif kind == "mapping":
        for k, child in zip(spec[2], spec[3]):
            yield from paths(child, f"{root}[{k!r}]")
        for name, child in zip(spec[4][1], spec[4][2]):
            yield from paths(child, f"{root}.{name}")
    elif kind == "object":
        for n, child in zip(spec[2], spec[3]):
            yield from paths(child, f"{root}.{n}")
    elif kind == "function":
        for name, child in zip(spec[1].co_freevars, spec[5]):
            yield from paths(child, f"{root}.<closure {name}>")
        if spec[4] is not None:
            yield from paths(spec[4], f"{root}.<defaults>")
    elif kind == "partial":
        yield from paths(spec[2], f"{root}.<partial>")
    elif kind == "pytree":  # keyed where the context names the children (OrderedDict, ModelOutput)
        keys = spec[2].value
        if not (isinstance(keys, (list, tuple)) and len(keys) == len(spec[3])):
            keys = range(len(spec[3]))
        for k, child in zip(keys, spec[3]):
            yield from paths(child, f"{root}[{k!r}]")
    elif dataclasses.is_dataclass(kind):
        for n, child in zip(spec[1], spec[2]):
            yield from paths(child, f"{root}.{n}")
    else:
        for i, child in enumerate(spec[1]):
            yield from paths(child, f"{root}[{i}]")


def non_tensor_arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(path, value) of every non-tensor leaf of a call's arguments (`args[1]`, `kwargs['cfg']`)."""
    _, spec = flatten((args, kwargs))
    return [
        (f"argument {path}", value_of(leaf))
        for path, leaf in argument_paths(spec)
        if not is_tensor_leaf(leaf)
    ]


def is_tensor_leaf(leaf_spec: Any) -> bool:
    return leaf_spec is _TENSOR


def value_of(leaf_spec: Any) -> Any:
    """The Python value of a non-tensor leaf spec."""
    return leaf_spec[2]


class Signature:
    """What makes two calls replayable by one graph: the arguments' spec and their tensors' metadata.

    Hashable and compared by value; the hash is computed once (a signature is looked up every call).
    """

    __slots__ = ("_hash", "aliases", "spec", "tensors")

    def __init__(self, spec: Any, tensors: tuple[TensorMeta, ...], aliases: tuple[int, ...] | None = None):
        self.spec = spec
        self.tensors = tensors
        self.aliases = aliases
        """None when every tensor leaf is its own object; else, per leaf, the index of the first leaf
        that is the same tensor (`step(ids, labels=ids)`). Two calls that alias differently get
        different graphs: a graph reads an aliased pair from one buffer, and a compiled model guards
        on the aliasing too (it would compile again inside the capture)."""
        try:
            self._hash = hash((spec, tensors, aliases))
        except TypeError:
            raise UnsupportedInputError(_unhashable_message(spec)) from None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Signature):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.tensors == other.tensors
            and self.aliases == other.aliases
            and self.spec == other.spec
        )

    def __repr__(self) -> str:
        return f"Signature({self.describe()})"

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> tuple[Signature, list[torch.Tensor]]:
        if not kwargs and all(map(_PLAIN_TENSOR_TYPES.__contains__, map(type, args))):
            leaves = list(args)  # the common call, step(x, y): no tree to walk
            spec = _FLAT_SPECS.get(len(leaves)) or flat_spec(len(leaves))
        else:
            leaves, spec = flatten((args, kwargs))
        aliases = None
        n = len(leaves)
        if n > 1 and (leaves[0] is leaves[1] if n == 2 else len(set(map(id, leaves))) != n):
            first: dict[int, int] = {}
            aliases = tuple(first.setdefault(id(t), i) for i, t in enumerate(leaves))
        return cls(spec, tuple(map(TensorMeta.of, leaves)), aliases), leaves

    def describe(self) -> str:
        """One line per leaf: `x: bfloat16[8, 64] on cuda:0`, `n: int 4`."""
        metas = iter(self.tensors)
        paths_of_leaves: list[str] = []
        parts = []
        for path, leaf in argument_paths(self.spec):
            if is_tensor_leaf(leaf):
                i = len(paths_of_leaves)
                paths_of_leaves.append(path)
                same = self.aliases[i] if self.aliases is not None and self.aliases[i] != i else None
                parts.append(
                    f"{path}: {next(metas)}"
                    + (f" (the same tensor as {paths_of_leaves[same]})" if same is not None else "")
                )
            else:
                parts.append(f"{path}: {type(value_of(leaf)).__name__} {value_of(leaf)!r}")
        return ", ".join(parts) or "(no arguments)"


def argument_paths(spec: Any) -> Iterator[tuple[str, Any]]:
    """Paths of a call's `(args, kwargs)` spec, named `args[0]...` and `kwargs['x']...`."""
    args_spec, kwargs_spec = spec[1]
    yield from paths(args_spec, "args")
    yield from paths(kwargs_spec, "kwargs")


def tensor_paths(spec: Any) -> list[str]:
    """The paths of a call's tensor arguments, in the order of its tensor leaves."""
    return [path for path, leaf in argument_paths(spec) if is_tensor_leaf(leaf)]


def changing_number(signatures: list[Signature]) -> tuple[str, list[Any]] | None:
    """The Python number argument (path, values) that takes a different value in each of
    `signatures` while everything else about them is the same; None if there is none."""
    first = signatures[0]
    if any(s.tensors != first.tensors for s in signatures):
        return None
    leaves = [list(argument_paths(s.spec)) for s in signatures]
    if any([p for p, _ in found] != [p for p, _ in leaves[0]] for found in leaves):
        return None
    changing = []
    for i, (path, leaf) in enumerate(leaves[0]):
        column = [found[i][1] for found in leaves]
        if all(c == leaf for c in column):
            continue
        values = [value_of(c) if not is_tensor_leaf(c) and c[0] == "value" else None for c in column]
        numbers = all(type(v) in (int, float) for v in values)
        if not numbers or len(set(values)) != len(values):
            return None
        changing.append((path, values))
    return changing[0] if len(changing) == 1 else None


def _unhashable_message(spec: Any) -> str:
    for path, leaf in argument_paths(spec):
        if not is_tensor_leaf(leaf):
            try:
                hash(value_of(leaf))
            except TypeError:
                kind = type(value_of(leaf)).__name__
                return (
                    f"argument {path} is a {kind}, which is neither a tensor, a container graphstep "
                    "understands (tuple, list, Mapping, namedtuple, dataclass, a type registered with "
                    "torch.utils._pytree), nor hashable. Python values "
                    "are part of a graph's key, so they must be hashable: pass a tensor, a hashable "
                    "value, or close over the object instead of passing it."
                )
    return "the arguments cannot be hashed into a graph key"


def replayable_outputs(outputs: Any, step_name: str, *, device_only: bool) -> tuple[Any, list[torch.Tensor]]:
    """Split a step's outputs into spec and (detached) tensors, refusing what a replay cannot redo.

    A replay runs no Python, so a returned number or string would be frozen at its capture-time
    value; with `device_only`, so would a CPU tensor.
    """
    tensors, spec = flatten(outputs)
    metas = iter(tensors)
    for path, leaf in paths(spec, "output"):
        if is_tensor_leaf(leaf):
            t = next(metas)
            if device_only and t.device.type != "cuda":
                raise UnsupportedOutputError(
                    f"{step_name} returns a {t.device.type} tensor at {path}. A CUDA graph replays only "
                    "device work, so this value would stay what it was at capture. Return it on the GPU."
                )
        elif value_of(leaf) is not None:
            value = value_of(leaf)
            raise UnsupportedOutputError(
                f"{step_name} returns a {type(value).__name__} ({value!r}) at {path}. A replay runs no "
                "Python, so it cannot compute this value again: every replay would return the value "
                "from capture. Return a tensor instead (for example torch.as_tensor(x, device=...)), or "
                "compute the value outside the step."
            )
    return spec, [t.detach() for t in tensors]


def detached(tree: Any) -> Any:
    """`tree` with every tensor detached: a step's results are handed out without autograd history."""
    tensors, spec = flatten(tree)
    if not tensors:
        return tree
    return unflatten(spec, [t.detach() for t in tensors])
