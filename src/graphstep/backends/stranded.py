"""Tensors a failed capture left in its pool, moved out (issue 42).

A failed capture abandons its pool and later warm-ups and captures take a fresh one (`cuda.py`):
after a host sync inside CUDA (every graph break) torch's allocator keeps the pool marked as capturing;
after a failure raised before CUDA saw one (the models suite's `grouped_mm` experts) it is renewed all
the same. Whatever the warm-ups made there that lives on stays: the optimizer state made lazily in the
first warm-up (AdamW's moments, two copies of the parameters) and gradients kept between steps. Those
tensors kept the pool's segments from the driver, and the free blocks beside them from every other
allocation: the MoE row held 0.18 GiB in such a pool, 0.15 GiB with `grouped_mm` experts (whose
abandoned pool this module did not look at before: only a pool left capturing was). Here they get fresh
memory, in place (the same tensor objects, the same values), and the abandoned pool, empty, goes back.
"""

from __future__ import annotations

from typing import Any

import torch

from .cuda import pool_ranges


def move_out(backend: Any, tensors: list[torch.Tensor]) -> int:
    """After a failed capture: copy those of `tensors` (the training state's, `TrainingState.tensors_kept`)
    that live in a pool `backend` abandoned with no graph in it out of that pool, and hand the pool's
    segments back. Returns the bytes moved (0, and no device sync, when no pool was abandoned)."""
    if not backend.stranded:
        return 0
    pools, backend.stranded = set(backend.stranded), []
    groups = storages_within(pool_ranges(backend.index, pools), tensors)
    if not groups:
        return 0
    torch.cuda.synchronize(backend.index)
    # First the pool's segments that hold nothing (the warm-ups' cached activations): the copies below
    # made beside them were the step's peak (grouped_mm row, 2026-11-27: 0.48 GiB against 0.40 at replays).
    torch.cuda.empty_cache()
    with backend._on_capture_stream():  # where the warm-ups and the graphs use them
        moved = relocate(groups)
    torch.cuda.synchronize(backend.index)
    torch.cuda.empty_cache()  # nothing lives in the pool now: its segments go back to the driver
    return moved


def storages_within(ranges: list[tuple[int, int]], tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` whose memory lies within one of `ranges` ([start, end) addresses), grouped by storage."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            continue  # a wrapper subclass (FSDP2's DTensor state) has no storage of its own: left where it is
        ptr = t.untyped_storage().data_ptr()
        if any(start <= ptr < end for start, end in ranges):
            group = groups.setdefault(ptr, [])
            if not any(t is u for u in group):
                group.append(t)
    return list(groups.values())


def relocate(groups: list[list[torch.Tensor]]) -> int:
    """Give each group of tensors (one storage each) a fresh copy of its storage, in place: the same
    tensor objects, views of one storage still one storage. Returns the bytes copied."""
    moved = 0
    with torch.no_grad():
        for group in groups:
            old = group[0].untyped_storage()
            new = torch.empty(old.nbytes(), dtype=torch.uint8, device=old.device).untyped_storage()
            new.copy_(old)
            for t in group:
                t.set_(new, t.storage_offset(), t.size(), t.stride())
            moved += old.nbytes()
    return moved
