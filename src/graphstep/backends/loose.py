"""Arguments used only inside eager segments: not part of the graph's key, handed to the segment as
they are on every call.

A detector's targets (a list of dicts whose box count changes with every image) go only to the code
that matches boxes and computes the loss, which runs as an eager segment (`graphstep.eager_segment`,
or a graph break). Keyed by shape, every batch would need a graph of its own; but no graph reads
them, so their shapes need not be in the key, nor their tensors in static buffers.

- learning: a warm-up notes the tensors handed to segments (`segments.Warmup.passed`). Once the shapes
  of some of those argument tensors change between calls of one structure (and nothing else does),
  all of them are *loose* for that structure (`LooseArguments`): keyed by dtype and device only
  (`LooseMeta`), handed to the segments as they are, never copied.
- the check, at capture: the graph gets a `Placeholder` in its place, a tensor without data that
  raises as soon as anything outside a segment uses it (an operation, `.shape`, `len()`, ...), and a
  segment reached with it gets the call's real tensor. A capture that touched one stops
  (`LooseArgumentRead`), nothing is lost (the call runs as one more warm-up), and that argument is
  keyed by its shape again from then on: a replay never reads a stale tensor.
- at replay: each placeholder holds the call's tensor (`Placeholder.gs_now`, set where the other
  arguments are copied in), and each segment reads it from there (`resolve`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import signature as sig
from ..errors import WarmUpAgain


class LooseMeta(NamedTuple):
    """The key of a loose argument tensor: any shape and stride."""

    dtype: torch.dtype
    device: torch.device

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} of any shape on {self.device} (used in eager segments only)"


class LooseArgumentRead(WarmUpAgain):
    """A capture used a loose argument outside the eager segments: it is keyed by shape again."""

    def __init__(self, message: str):
        super().__init__(message, after_break=True)


class Placeholder(torch.Tensor):
    """What the graph gets for a loose argument at capture: no data, and an error on any use."""

    @staticmethod
    def __new__(
        cls, like: torch.Tensor, index: int, path: str, owner: LooseArguments, spec: Any
    ) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        t.gs_index, t.gs_path, t.gs_owner, t.gs_spec, t.gs_now = index, path, owner, spec, like
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise _used((args, kwargs or {}), getattr(func, "__name__", str(func)))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise _used((args, kwargs or {}), str(func))

    def __repr__(self) -> str:  # (no torch function: an error message may name it)
        return f"<graphstep placeholder for {self.gs_path}>"


def _used(tree: Any, what: str) -> LooseArgumentRead:
    tensors, _ = sig.flatten(tree)
    found = next(t for t in tensors if type(t) is Placeholder)
    found.gs_owner.read(found.gs_spec, found.gs_index)
    return LooseArgumentRead(
        f"the argument {found.gs_path} changes shape from call to call and was handed to an eager segment, but "
        f"the step also uses it outside the segments (`{what}`); a graph would keep the tensor of the "
        "capture. It is keyed by its shape again: a graph per shape."
    )


def placeholders(tree: Any) -> list[tuple[int, Placeholder]]:
    """(position among the flattened tensors, placeholder) of each placeholder in `tree`."""
    tensors, _ = sig.flatten(tree)
    return [(i, t) for i, t in enumerate(tensors) if type(t) is Placeholder]


def resolve(tree: Any, found: list[tuple[int, Placeholder]]) -> Any:
    """`tree` with each placeholder at its position replaced by the call's real tensor."""
    tensors, spec = sig.flatten(tree)
    for i, p in found:
        tensors[i] = p.gs_now
    return sig.unflatten(spec, tensors)


class LooseArguments:
    """One captured step's loose arguments, per argument structure (a signature's spec)."""

    def __init__(self) -> None:
        self.loose: dict[Any, frozenset[int]] = {}
        """Spec -> the indices of its loose tensor leaves."""
        self._candidates: dict[Any, tuple[frozenset[int], sig.Signature]] = {}
        """Spec -> the leaves the last warm-up handed to segments, and that call's signature."""
        self._keyed: dict[Any, set[int]] = {}
        """Spec -> leaves a capture found used outside the segments: never loose again."""
        self.reads = 0
        """Placeholders used outside a segment so far (a capture that swallowed the error fails too)."""

    def rekey(self, signature: sig.Signature) -> sig.Signature:
        """`signature` with its loose tensors keyed by dtype and device only."""
        if not self.loose and not self._candidates:  # most steps
            return signature
        loose = self.loose.get(signature.spec)
        if loose is None and self._candidates:
            loose = self._loosen(signature)
        if not loose:
            return signature
        metas = tuple(
            LooseMeta(m.dtype, m.device) if i in loose else m for i, m in enumerate(signature.tensors)
        )
        return sig.Signature(signature.spec, metas, signature.aliases)

    def _loosen(self, signature: sig.Signature) -> frozenset[int] | None:
        """A new signature that differs from the last warm-up's only in the shapes of tensors it
        handed to segments: those are loose from now on (for this call too)."""
        noted = self._candidates.get(signature.spec)
        if noted is None or signature.aliases is not None:
            return None
        candidates, before = noted
        now, then = signature.tensors, before.tensors
        differ = {i for i, (a, b) in enumerate(zip(now, then)) if a != b}
        if not differ or not differ <= candidates or before.aliases is not None:
            return None
        if any(now[i].dtype != then[i].dtype or now[i].device != then[i].device for i in differ):
            return None
        # All of them, not only those that changed this time: a box count changes in another image next.
        loose = self.loose[signature.spec] = candidates
        return loose

    def after_warmup(self, signature: sig.Signature, args: tuple, kwargs: dict, passed: set[int]) -> None:
        """Note the argument tensors a warm-up handed to eager segments (`passed`: their ids)."""
        if not passed or signature.spec in self.loose:
            return
        leaves, _ = sig.flatten((args, kwargs))
        keyed = self._keyed.get(signature.spec, ())
        found = frozenset(
            i for i, t in enumerate(leaves) if id(t) in passed and not t.requires_grad and i not in keyed
        )
        if found:
            self._candidates[signature.spec] = (found, signature)

    def read(self, spec: Any, index: int) -> None:
        """A capture used leaf `index` outside the segments: keyed by shape from now on."""
        self.reads += 1
        self._keyed.setdefault(spec, set()).add(index)
        loose = self.loose.get(spec, frozenset()) - {index}
        if loose:
            self.loose[spec] = loose
        else:
            self.loose.pop(spec, None)
        self._candidates.pop(spec, None)
