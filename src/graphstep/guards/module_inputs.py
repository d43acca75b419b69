"""Inputs kept on modules: a FlexAttention `BlockMask` the training loop sets on a module before each
call (`model.attn.block_mask = create_block_mask(doc_mask, ...)`), built anew for every batch.

Such an attribute is an input like a tensor argument, not state a graph bakes in: the module watch
does not guard it (`barriers.is_input_value`), and instead

- at capture, every such attribute of the step's modules gets a static copy of itself (its tensors,
  and the tensors its mask function closes over, in buffers: see `signature.py`), set on the module
  while the step is captured and taken off after, so that the graph reads the buffers;
- before every replay, the object the attribute holds now is flattened and compared with what was
  captured: the same mask function (code), block size, sequence lengths and tensor shapes fit, and its
  tensors are copied into the buffers; anything else is a change of the guard, and the lifecycle
  captures a variant for it (another mask function, another block size).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import signature as sig
from .barriers import MISSING, attribute_items, is_input_value
from .change import Change


@dataclasses.dataclass(eq=False)
class _Held:
    label: str
    """Where it is: `model.attn.block_mask`."""
    module: nn.Module
    name: str
    signature: sig.Signature
    buffers: list[torch.Tensor]
    static: Any
    """The object over the buffers the graph reads, set on the module during the capture."""


class ModuleInputs:
    """The input-like attributes of a step's modules, as one capture saw them."""

    def __init__(self, held: list[_Held]):
        self.held = held
        self._now: list[list[torch.Tensor]] | None = None
        """The tensors of the attributes' current objects, from the last `fit()` that held."""

    @classmethod
    def found(
        cls, named_modules: list[tuple[str, nn.Module]], new_buffer: Callable[[torch.Tensor], torch.Tensor]
    ) -> ModuleInputs | None:
        """Those of `named_modules` (each module once), with buffers made by `new_buffer`; None if none."""
        held = []
        seen: set[int] = set()
        for prefix, module in named_modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, value in list(attribute_items(module)):
                if is_input_value(value):
                    signature, leaves = sig.Signature.of((value,), {})
                    made: dict[int, torch.Tensor] = {}  # one buffer per tensor object, as for arguments
                    buffers = [made.setdefault(id(t), new_buffer(t)) for t in leaves]
                    static = sig.unflatten(signature.spec, buffers)[0][0]
                    held.append(_Held(f"{prefix}.{name}", module, name, signature, buffers, static))
        return cls(held) if held else None

    def fit(self) -> bool:
        """Each attribute holds an object a replay can load (the tensors are kept for `load`)."""
        now = []
        for h in self.held:
            value = h.module.__dict__.get(h.name, MISSING)
            if not is_input_value(value):
                return False
            signature, leaves = sig.Signature.of((value,), {})
            if signature != h.signature:
                return False
            now.append(leaves)
        self._now = now
        return True

    def changes(self) -> list[Change]:
        if self.fit():
            return []
        found = []
        for h in self.held:
            value = h.module.__dict__.get(h.name, MISSING)
            if not is_input_value(value):
                text = (
                    f"{h.label}: a {type(value).__qualname__} now (captured with a {type(h.static).__name__})"
                )
            elif sig.Signature.of((value,), {})[0] != h.signature:
                text = (
                    f"{h.label}: a {type(value).__name__} of another mask function, block size, sequence "
                    "length or shape than captured"
                )
            else:
                continue
            found.append(Change(text, variant=True))
        return found

    def load(self) -> None:
        """Copy the attributes' current tensors into the buffers the graph reads."""
        if self._now is None and not self.fit():
            raise RuntimeError(
                "graphstep: an attribute input does not fit its graph"
            )  # the guard said it did
        targets, sources = [], []
        for h, leaves in zip(self.held, self._now):
            for buffer, t in zip(h.buffers, leaves):
                if t is not buffer:
                    targets.append(buffer)
                    sources.append(t)
        self._now = None
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The static objects on the modules while the step is captured; the caller's put back after.
        Written straight into `__dict__`: a swap and its undo are not a write of the step's."""
        users = [h.module.__dict__[h.name] for h in self.held]
        for h in self.held:
            h.module.__dict__[h.name] = h.static
        try:
            yield
        finally:
            for h, user in zip(self.held, users):
                h.module.__dict__[h.name] = user
