"""The static input buffers of one signature's graphs.

A graph reads its inputs from fixed addresses, so each call's tensors are copied into buffers made
at the first capture (none when the caller passes the buffers themselves: see
`CapturedStep.input_buffers`). CPU inputs of a CUDA step get pinned host buffers, which a graph can
copy from; a replay must then wait for the previous one before overwriting them.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import signature as sig
from ..errors import UnsupportedInputError
from .base import Backend
from .loose import LooseArguments, LooseMeta, Placeholder


class InputBuffers:
    """One buffer per tensor leaf of a signature, made on first use."""

    def __init__(
        self, backend: Backend, spec: Any = None, metas: tuple = (), loose: LooseArguments | None = None
    ):
        self.backend = backend
        self.spec = spec
        """The signature's spec, to name an argument that cannot be loaded."""
        self.loose_at = [i for i, m in enumerate(metas) if isinstance(m, LooseMeta)]
        """Leaves used only in eager segments (see `loose.py`): a placeholder each, no buffer."""
        self.owner = loose
        self._copied: list[torch.Tensor] = []
        self.tensors: list[torch.Tensor] | None = None
        self.host_staged = False
        """Some buffers are pinned host memory (CPU inputs of a CUDA step): loading them must wait."""
        self.need_grad = False
        """Some buffers require grad: loading them must not be recorded by autograd."""

    def like(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers for tensors like `leaves`, made the first time."""
        if self.tensors is None:
            loose = set(self.loose_at)
            for i, t in enumerate(leaves):
                why = "" if i in loose else unloadable(t, getattr(self.backend, "index", None))
                if why:
                    raise UnsupportedInputError(f"argument {self._name(i)} {why}")
            # One buffer per tensor object: leaves that are the same tensor (the signature keeps
            # such calls apart) share one, as they share memory in eager.
            made: dict[int, torch.Tensor] = {}
            for i, t in enumerate(leaves):
                if i in loose:
                    made[-1 - i] = Placeholder(t, i, self._name(i), self.owner, self.spec)
                elif id(t) not in made:
                    made[id(t)] = self.backend.new_buffer(t)
            self.tensors = [made[-1 - i if i in loose else id(t)] for i, t in enumerate(leaves)]
            self._copied = [b for i, b in enumerate(self.tensors) if i not in loose]
            for buffer, t in zip(self.tensors, leaves):
                if type(buffer) is not Placeholder:
                    buffer.requires_grad_(t.requires_grad and t.is_leaf)
            self.host_staged = any(b.is_pinned() for b in self._copied)
            self.need_grad = any(b.requires_grad for b in self._copied)
        return self.tensors

    def load(self, leaves: list[torch.Tensor], held: Any = None) -> None:
        """Copy the call's tensors into the buffers (none when they are the buffers). `held`: the
        graph's inputs kept on modules (`guards/module_inputs.py`), loaded too."""
        if held is not None:
            held.load()
        if self.loose_at:  # handed to the segments as they are
            for i in self.loose_at:
                if leaves[i] is not self.tensors[i]:  # (the placeholder itself, from `input_buffers`)
                    self.tensors[i].gs_now = leaves[i]
            loose = set(self.loose_at)
            leaves = [t for i, t in enumerate(leaves) if i not in loose]
        if self.host_staged:  # the previous replay may still be reading a host buffer
            torch.cuda.current_stream(self.backend.index).synchronize()
        if self.need_grad:
            with torch.no_grad():
                self._copy(leaves)
        else:  # the common call: no context to enter
            self._copy(leaves)

    def _copy(self, leaves: list[torch.Tensor]) -> None:
        targets, sources = [], []
        for buffer, t in zip(self._copied, leaves):
            if t is not buffer:
                targets.append(buffer)
                sources.append(t)
        if len(targets) > 1 and not self.host_staged:
            # One launch for all of them: in a deep GPU queue each CUDA call costs the host ~10 µs.
            try:
                torch._foreach_copy_(targets, sources)
                return
            except RuntimeError:
                pass  # copied one by one below, where a failure names its argument
        for i, (buffer, t) in enumerate(zip(self._copied, leaves)):
            if t is not buffer:
                try:
                    buffer.copy_(t)
                except RuntimeError as exc:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise UnsupportedInputError(
                        f"argument {self._name(i)} ({sig.TensorMeta.of(t)}) cannot be copied into the "
                        f"graph's input buffer: {first}. Pass a tensor that owns its memory "
                        "(`.contiguous()`, not an `expand`ed view), on the step's device."
                    ) from exc

    def _name(self, i: int) -> str:
        paths = sig.tensor_paths(self.spec) if self.spec is not None else []
        return paths[i] if i < len(paths) else f"#{i}"


def unloadable(t: torch.Tensor, graph_index: int | None) -> str:
    """Why a graph could not read `t` through an input buffer ("" when it can). `graph_index`: the
    CUDA device of the graph (None: a CPU stand-in). The warm-ups ran eagerly with `t`, so eager did
    not fail on it; a graph would."""
    device = t.device
    if device.type == "meta":
        return (
            "is a meta tensor: it has no data, so there is nothing to copy into the graph's input buffer "
            "and no work on it for a graph to record. Pass a tensor with data (materialise it with "
            "`.to_empty(device=...)` and fill it), or make this call outside the captured step."
        )
    if device.type == "cuda" and graph_index is not None and device.index != graph_index:
        return (
            f"is on {device}, but the step's graphs run on cuda:{graph_index}: a graph reads and writes "
            f"the memory of its own device only. Move it with `.to('cuda:{graph_index}')` before the "
            "call, or capture one step per device (one process per GPU)."
        )
    return ""
