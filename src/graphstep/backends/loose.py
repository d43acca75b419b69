"""Arguments used only inside eager segments: not part of the graph's key, handed to the segment as
they are on every call.

A detector's targets (a list of dicts whose box count changes with every image) go only to the code
that matches boxes and computes the loss, which runs as an eager segment (`graphstep.eager_segment`,
or a graph break). Keyed by shape, every batch would need a graph of its own; but no graph reads
them, so their shapes need not be in the key, nor their tensors in static buffers.

- learning: a warm-up notes the argument tensors handed to segments (`segments.Warmup.passed`). Those
  whose shape changes between two calls of one structure (nothing else changing) are *loose* for that
  structure from then on (`LooseArguments`): keyed by dtype and device only (`LooseMeta`), handed to
  the segments as they are, never copied.
- the check, at capture: the graph gets a `Placeholder` in its place, a tensor without data that
  raises as soon as anything outside a segment uses it (an operation, `.shape`, `len()`, ...), and a
  segment reached with it gets the call's real tensor. A capture that touched one stops
  (`LooseArgumentRead`), nothing is lost (the call runs as one more warm-up), and that argument is
  keyed by its shape again from then on: a replay never reads a stale tensor.
- at replay: each placeholder holds the call's tensor (`Placeholder.gs_now`, set where the other
  arguments are copied in), and each segment reads it from there (`resolve`).
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, NamedTuple

import torch

from .. import signature as sig
from ..diagnostics import user_frame_of
from ..errors import WarmUpAgain

log = logging.getLogger("graphstep")
_REMEMBERED = 64  # argument structures whose segment-only tensors are remembered


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
        return _use(func, args, kwargs or {}, getattr(func, "__name__", str(func)))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _use(func, args, kwargs or {}, str(func))

    def __repr__(self) -> str:  # (no torch function: an error message may name it)
        return f"<graphstep placeholder for {self.gs_path}>"


def _use(func: Any, args: tuple, kwargs: dict, what: str) -> Any:
    """A use of a placeholder: refused while a capture runs; outside one (a verifying reference run that
    reads the static inputs), the call's own tensor stands in."""
    held = placeholders((args, kwargs))
    if not held[0][1].gs_owner.capturing:
        args, kwargs = resolve((args, kwargs), held)
        return func(*args, **kwargs)
    raise _used(held[0][1], what)


def _used(found: Placeholder, what: str) -> LooseArgumentRead:
    frame = user_frame_of(traceback.extract_stack()[:-2])
    line = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "an unknown line"
    message = (
        f"the argument {found.gs_path} changes shape from call to call and is handed to an eager segment, "
        f"but the step also uses it outside the segments ({what} at {line}); a graph would keep the "
        "tensor of its capture. It is keyed by its shape again: a graph per shape. To keep one graph, use it "
        "only inside the segment (move that line into the segment's code)."
    )
    found.gs_owner.read(found.gs_spec, found.gs_index, message)
    return LooseArgumentRead(message)


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
        """Spec -> the leaves a warm-up handed to segments, and the last call's signature (by shape)."""
        self._keyed: dict[Any, set[int]] = {}
        """Spec -> leaves a capture found used outside the segments: never loose again."""
        self.reads = 0
        """Placeholders used outside a segment so far (a capture that swallowed the error fails too)."""
        self.capturing = False
        """A capture runs: a placeholder used now is refused (`capturing.py` sets it)."""

    def rekey(self, signature: sig.Signature) -> sig.Signature:
        """`signature` with its loose tensors keyed by dtype and device only."""
        if not self._candidates:  # most steps
            return signature
        spec = signature.spec
        noted = self._candidates.get(spec)
        if noted is not None:
            self._vary(signature, *noted)
        loose = self.loose.get(spec)
        if not loose:
            return signature
        metas = tuple(
            LooseMeta(m.dtype, m.device) if i in loose else m for i, m in enumerate(signature.tensors)
        )
        return sig.Signature(spec, metas, signature.aliases)

    def _vary(self, signature: sig.Signature, candidates: frozenset[int], before: sig.Signature) -> None:
        """Tensors handed to segments whose shapes changed since the last call of this structure (and
        nothing else did) are loose from now on."""
        self._candidates[signature.spec] = (candidates, signature)
        now, then = signature.tensors, before.tensors
        if now == then or signature.aliases is not None or before.aliases is not None:
            return
        differ = {i for i, (a, b) in enumerate(zip(now, then)) if a != b}
        if not differ <= candidates:
            return
        if any(now[i].dtype != then[i].dtype or now[i].device != then[i].device for i in differ):
            return
        self.loose[signature.spec] = self.loose.get(signature.spec, frozenset()) | differ

    def after_warmup(self, signature: sig.Signature, args: tuple, kwargs: dict, passed: set[int]) -> None:
        """Note the argument tensors a warm-up handed to eager segments (`passed`: their ids)."""
        if not passed:
            return
        leaves, _ = sig.flatten((args, kwargs))
        keyed = self._keyed.get(signature.spec, ())
        found = frozenset(
            i for i, t in enumerate(leaves) if id(t) in passed and not t.requires_grad and i not in keyed
        )
        noted = self._candidates.get(signature.spec)
        if noted is not None:  # (segments made since: a graph break)
            self._candidates[signature.spec] = (noted[0] | found, noted[1])
        elif found and not any(isinstance(m, LooseMeta) for m in signature.tensors):
            if len(self._candidates) >= _REMEMBERED:  # (a Python number argument makes a spec per value)
                del self._candidates[next(iter(self._candidates))]
            self._candidates[signature.spec] = (found, signature)

    def read(self, spec: Any, index: int, message: str) -> None:
        """A capture used leaf `index` outside the segments: this structure's loose arguments are keyed by
        shape from now on."""
        self.reads += 1
        log.warning("graphstep: %s", message)
        # All of this structure's, not that one alone: code that reads one target reads the others
        # (each would cost a capture to find out).
        keyed = self._keyed.setdefault(spec, set())
        keyed.update(self.loose.pop(spec, ()), (index,))
        noted = self._candidates.get(spec)
        if noted is not None:
            self._candidates[spec] = (noted[0] - keyed, noted[1])
