"""Named ranges for profilers: warm-up, capture, replay and eager segments show up in
`torch.profiler` traces and in Nsight Systems (NVTX)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def ranged(name: str) -> Iterator[None]:
    with torch.profiler.record_function(name):
        yield
