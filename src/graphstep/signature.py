"""Pytrees of a step's arguments and results, and the key that picks a graph.

A call's arguments are flattened into tensor leaves and a hashable *spec* (the structure
with every non-tensor value inside it). The key of a graph is the spec plus each tensor's
shape, dtype, device, stride and requires_grad: two calls with the same key can replay the
same graph, any difference needs another graph. Tuples, lists, dicts, namedtuples and
dataclasses are containers; everything else that is not a tensor is a Python value that
becomes part of the key, so it must be hashable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from .errors import UnsupportedInputError, UnsupportedOutputError

_TENSOR = "<tensor>"  # a spec's placeholder for a tensor leaf
TENSOR_SPEC = _TENSOR
"""The spec of a tree that is one tensor (a step returning its loss): `spec is TENSOR_SPEC`."""
_FLAT_SPECS: dict[int, Any] = {}  # the spec of `step(t1, ..., tn)`, by n
_PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, nn.Parameter))


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


def _flatten(node: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        leaves.append(node)
        return _TENSOR
    kind = type(node)
    if kind is tuple or kind is list:
        return (kind, tuple(_flatten(child, leaves) for child in node))
    if kind is dict:
        return (dict, tuple(node), tuple(_flatten(child, leaves) for child in node.values()))
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
        return (kind, tuple(_flatten(child, leaves) for child in node))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        names = tuple(f.name for f in dataclasses.fields(node) if f.init)
        return (kind, names, tuple(_flatten(getattr(node, n), leaves) for n in names))
    # A Python value: kept in the key with its type, so that 1, 1.0 and True differ.
    return ("value", kind, node)


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
    if dataclasses.is_dataclass(kind):
        return kind(**{n: _unflatten(child, leaves) for n, child in zip(spec[1], spec[2])})
    return kind(*(_unflatten(child, leaves) for child in spec[1]))  # namedtuple


def paths(spec: Any, root: str) -> Iterator[tuple[str, Any]]:
    """Yield `(path, leaf_spec)` for every leaf, paths written the way Python would index them."""
    if spec is _TENSOR or spec[0] == "value":
        yield root, spec
        return
    kind = spec[0]
    if kind is dict:
        for k, child in zip(spec[1], spec[2]):
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
                    "understands (tuple, list, dict, namedtuple, dataclass), nor hashable. Python values "
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
