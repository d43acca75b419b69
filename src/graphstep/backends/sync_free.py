"""Counting without a host read while a CUDA stream captures: `torch.bincount` given its length.

torch's CUDA `bincount` reads the largest value on the host to size its result, so a capture stops there
(a graph break). MoE code counts tokens per expert this way: transformers up to 5.17 in every family's
load-balancing loss, `torch.bincount(selected_experts.reshape(-1), minlength=num_experts)`. When the caller
gives `minlength` and every value lies in `[0, minlength)` — an expert index, a class label — the result
has `minlength` entries whatever the data, and graphstep counts on the device into a result of that size:
each value compared with every bin and the matches summed, integer sums in a fixed order, exactly what
`bincount` returns. A value outside `[0, minlength)` would have made eager's result longer (or raised):
there the replay stops with a CUDA device-side assert (`torch._assert_async`) instead of returning a
shorter result. That error ends the process's CUDA context; it is loud, not silent.

Only while a CUDA stream captures on this thread, for a 1-D integer CUDA input without weights, with
`minlength > 0` and at most `_MOST_CELLS` comparisons; anything else is torch's own `bincount` (and a
host read there still breaks the graph as before). In warm-ups (not capturing) it is torch's own, a host
read allowed: the counts are the same integers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch

_MOST_CELLS = 1 << 27
"""Values x bins compared at once (128 Mi booleans); a larger count keeps torch's `bincount`."""

_original = torch.bincount


def counted_on_device(values: torch.Tensor, minlength: int) -> torch.Tensor:
    """`torch.bincount(values, minlength=minlength)` for values in `[0, minlength)`, with no host read;
    a device-side assert stops the stream if a value is outside."""
    values = values.long()  # compared as int64: uint8 bins past 255 would wrap
    inside = (values >= 0) & (values < minlength)
    torch._assert_async(inside.all(), "bincount: a value outside [0, minlength) under graphstep's capture")
    bins = torch.arange(minlength, device=values.device)
    return (values.unsqueeze(-1) == bins).sum(dim=0)


def _fits(values: torch.Tensor, weights: torch.Tensor | None, minlength: int) -> bool:
    return (
        weights is None
        and minlength > 0
        and values.is_cuda
        and values.dim() == 1
        and not values.is_floating_point()
        and not values.is_complex()
        and values.dtype is not torch.bool
        and values.numel() * minlength <= _MOST_CELLS
        and torch.cuda.is_current_stream_capturing()
    )


def _bincount(input: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    if isinstance(input, torch.Tensor) and _fits(input, weights, minlength):
        return counted_on_device(input, minlength)
    return _original(input, weights, minlength)


_installed: list = []
"""The function put in `torch.bincount`'s place: one object for the life of the process (torch.compile
guards on the functions it met), made with compiling off once torch.compile is in use, so that a compiled
model calls it as it is, in warm-ups and capture alike, instead of compiling it at capture."""


def _replacement() -> Callable:
    compiling = "torch._dynamo" in sys.modules
    if not _installed or (compiling and _installed[0] is _bincount):
        _installed[:] = [torch.compiler.disable(_bincount) if compiling else _bincount]
    return _installed[0]


@contextlib.contextmanager
def counts_on_device() -> Iterator[None]:
    """While inside (graphstep's warm-ups and captures): `torch.bincount` with a `minlength` counts on the
    device while a stream captures (module docstring); the warm-ups call the same function, which is
    torch's own there, so a compiled model meets one function in both."""
    if torch.bincount is not _original:  # nested, or someone else's patch: leave it
        yield
        return
    torch.bincount = _replacement()
    try:
        yield
    finally:
        torch.bincount = _original
