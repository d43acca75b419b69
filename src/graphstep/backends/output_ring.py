"""Small outputs handed out of a ring the graph writes, instead of a copy made per call.

A replay's outputs live in the graph's own buffers, which the next replay overwrites, so by default
(`Config(outputs="clone")`) each call hands out copies. On a CUDA device that copy is a launch of its
own, which costs the host about as much as the graph's launch when the GPU queue is deep (the loop
that does not wait for the GPU: benchmarks/replay_stages.py). Instead, the graph itself copies its
outputs into one of two slots, alternating (a device flag picks the slot; two `where` kernels per
output and one to flip the flag, recorded at the end of the capture), and each call hands out tensors
over the slot just written, in storages of their own. Before a replay writes a slot again, any of
those storages the caller still holds (a view or `detach()` of a result included) is moved to a copy:
a result never changes while held, and one the caller let go costs nothing. The same contract as a
copy per call, without the copy in the common loop (`loss = step(x)`, the previous loss dropped).

Used for outputs of at most `MAX_BYTES` in all, contiguous, on the graph's device, shaped as at the
last warm-up, when the C++ helper is built (`guards/fastcheck.py`): the ring holds two more copies of
them. Anything else is copied per call as before.
"""

from __future__ import annotations

from typing import Any

import torch

from ..guards.fastcheck import helper
from ..signature import TensorMeta

SLOTS = 2
MAX_BYTES = 1 << 20
"""Outputs larger than this in all are copied per call (the ring would keep two more copies)."""


class Slots:
    """The ring's memory, made before the capture from the outputs' shapes at the last warm-up: made
    inside the capture it would come from the graph's pool, where the graph's own temporaries (and
    other graphs of the pool) reuse memory, and a held result would be overwritten."""

    def __init__(self, metas: list[tuple[torch.Size, torch.dtype]], device: torch.device):
        self.metas = metas
        self.flag = torch.zeros((), dtype=torch.bool, device=device)
        """Which slot the next replay writes (False: the first); the graph flips it."""
        self.slots = [
            [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas] for _ in range(SLOTS)
        ]


def prepare(outputs: list[TensorMeta] | None, device: torch.device | str) -> Slots | None:
    """Before the capture: the ring for outputs like `outputs` (the last warm-up's), or None where
    they do not suit one, or the C++ helper is missing."""
    if getattr(helper(), "OutputRing", None) is None or not outputs:
        return None
    device = torch.device(device)
    if not all(m.device == device and m.dtype in _DTYPES and not m.requires_grad for m in outputs):
        return None
    if sum(m.shape.numel() * m.dtype.itemsize for m in outputs) > MAX_BYTES:
        return None
    return Slots([(m.shape, m.dtype) for m in outputs], device)


def record(prepared: Slots | None, tensors: list[torch.Tensor], *, written: bool) -> Any:
    """Inside the capture, after the step: record the copies of `tensors` into the slots and the flip
    of the flag. Returns the ring (`before_replay()`, `hand_out()`), or None where the outputs are
    not like the warm-up's (nothing is recorded then). `written`: the capture runs what it records
    (the recording backend), so the first slot is written now."""
    if prepared is None or [(t.shape, t.dtype) for t in tensors] != prepared.metas:
        return None
    if not all(_suits(t, prepared.flag.device) for t in tensors):
        return None
    flag, (first, second) = prepared.flag, prepared.slots
    for t, a, b in zip(tensors, first, second):
        torch.where(flag, a, t, out=a)  # flag False: this replay writes the first slot
        torch.where(flag, t, b, out=b)
    torch.logical_not(flag, out=flag)
    ring = helper().OutputRing(prepared.slots, flag)  # holds the slots and the flag the graph writes
    if written:
        ring.before_replay()
    return ring


_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool}
_DTYPES |= {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def _suits(t: torch.Tensor, device: torch.device) -> bool:
    return (
        t.device == device
        and t.dtype in _DTYPES
        and t.layout is torch.strided
        and t.is_contiguous()
        and not t.requires_grad
    )
