"""The static input buffers of one signature's graphs.

A graph reads its inputs from fixed addresses, so each call's tensors are copied into buffers made
at the first capture (none when the caller passes the buffers themselves: see
`CapturedStep.input_buffers`). CPU inputs of a CUDA step get pinned host buffers, which a graph can
copy from; a replay must then wait for the previous one before overwriting them.
"""

from __future__ import annotations

import contextlib

import torch

from .base import Backend


class InputBuffers:
    """One buffer per tensor leaf of a signature, made on first use."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.tensors: list[torch.Tensor] | None = None
        self.host_staged = False
        """Some buffers are pinned host memory (CPU inputs of a CUDA step): loading them must wait."""
        self.need_grad = False
        """Some buffers require grad: loading them must not be recorded by autograd."""

    def like(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers for tensors like `leaves`, made the first time."""
        if self.tensors is None:
            # One buffer per tensor object: leaves that are the same tensor (the signature keeps
            # such calls apart) share one, as they share memory in eager.
            made: dict[int, torch.Tensor] = {}
            for t in leaves:
                if id(t) not in made:
                    made[id(t)] = self.backend.new_buffer(t)
            self.tensors = [made[id(t)] for t in leaves]
            for buffer, t in zip(self.tensors, leaves):
                buffer.requires_grad_(t.requires_grad and t.is_leaf)
            self.host_staged = any(b.is_pinned() for b in self.tensors)
            self.need_grad = any(b.requires_grad for b in self.tensors)
        return self.tensors

    def load(self, leaves: list[torch.Tensor]) -> None:
        """Copy the call's tensors into the buffers (none when they are the buffers)."""
        if self.host_staged:  # the previous replay may still be reading a host buffer
            torch.cuda.current_stream(self.backend.index).synchronize()
        with torch.no_grad() if self.need_grad else contextlib.nullcontext():
            for buffer, t in zip(self.tensors, leaves):
                if t is not buffer:
                    buffer.copy_(t)
