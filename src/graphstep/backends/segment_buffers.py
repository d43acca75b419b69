"""How an eager segment on the autograd path (`autograd_segments.py`) holds the buffers that cross its
boundary: its results and the graph outputs it reads, the gradients of its results and its gradient slots.

In a CUDA capture they live in the graphs' pool, made by the graph before the segment and held without
being owned (`unowned`): autograd owns them, and where it lets go of one at capture, as eager frees an
activation, later graphs reuse its memory; a replay writes and reads each in capture order, within the
replay, as a graph does its scratch. Held for good beside the graphs, they took 56 MiB on the models
suite's MoE row and 176 MiB with `grouped_mm` experts (issue 42). Elsewhere (the recording backend runs
the step while it captures) they are owned as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from . import segments


def made_by_ending_part(splitter: segments.Splitter, make: Callable[[], list]) -> list:
    """End the capture's part and make the buffers a segment writes: in a capture into a pool (CUDA) by
    the part that ends, in its pool, owned by autograd (`unowned`); where deterministic mode fills new
    memory, the fill is that graph's, before the segment writes them (made in the next part, its fill
    ran after, over the segment's results). Elsewhere after the part, where no recording sees them."""
    made = make() if splitter.in_pool is not None else None
    splitter.end_part()
    return made if made is not None else make()


def unowned_in_pool(tensors: list, splitter: segments.Splitter) -> list:
    """Each of `tensors` that lives in the capture's pool (CUDA) as a tensor over its memory that does not
    own it; the others (and None) as they are. Called between two parts of the capture."""
    if splitter.in_pool is None:
        return list(tensors)
    inside = iter(splitter.in_pool([t for t in tensors if t is not None]))
    return [t if t is None or not next(inside) else unowned(t) for t in tensors]


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep it allocated (torch's cudagraph trees rebuild their
    outputs so), for a buffer in the step's pool that segments read or write between two graphs of a
    replay. Owned, it was held for good beside eager's peak (issue 42: each segment's results, inputs and
    gradients, 0.1-0.2 GiB on the MoE row). Unowned, it is freed at capture where autograd or the graphs
    let go of it, as eager frees an activation, and later parts of the capture reuse its memory: a
    replay writes and reads it in capture order, within the replay, as a graph does its scratch. The
    pool keeps the memory for the step's graphs."""
    storage = t.untyped_storage()
    return _over(
        t, torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    )


def alias(t: torch.Tensor) -> torch.Tensor:
    """Another tensor over `t`'s memory that holds no reference to `t` (a view would hold its base).

    The segment's backward writes each gradient through the alias, and autograd gets `t` itself with no
    other reference held to it: accumulating a parameter's gradient into a `.grad` that is None, it makes
    `t` the `.grad` (as eager's autograd takes the fresh gradient) instead of a copy of it in the graph's
    pool, which held every segment parameter's gradient twice at the step's peak (issue 42)."""
    return _over(t, t.untyped_storage())


def _over(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A new tensor of `t`'s dtype, offset, shape and strides over `storage`."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.size(), t.stride()
    )


def onto_buffers(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Copy a replay's segment results into the buffers the next graph reads; then each result nothing
    else holds takes its buffer's memory, and its own goes back now rather than at the segment's
    backward, which needs only its autograd node: the results were held twice until then (issue 42:
    40 MiB of the grouped_mm row). A result its own node saved (`exp`, say) keeps that memory in the
    node, as eagerly. Left as they are: a view; a result the segment kept (a module's cache: another
    Python reference), whose values must not follow the buffer's; a result a node inside the segment
    saved as its input (a reference from C++: torch 2.13 counts it among the Python object's references;
    the tensor's own `_use_count` counts it whatever the release), which the segment's backward reads
    after the next graph may have reused the buffer's memory."""
    for i in range(len(tensors)):
        buffers[i].copy_(tensors[i].detach())
    alone = sys.getrefcount(_PROBE[0]) + 1  # an object held by one list and a local name, seen alike
    for i in range(len(tensors)):
        t = tensors[i]
        if t._base is None and getattr(t, "_use_count", lambda: 0)() == 1 and sys.getrefcount(t) == alone:
            t.data = buffers[i]
        del t


_PROBE = [object()]
