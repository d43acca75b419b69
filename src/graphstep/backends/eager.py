"""`EagerBackend`: the step runs eagerly on every call, for CPU tensors or machines without CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import CaptureBody, Recording, empty_like_strided
from .segments import Splitter
from .undo import UndoLog


def _no_split() -> None:
    pass


_NO_SPLIT = Splitter(_no_split, _no_split, executes=True)
"""The eager backend never splits: no segment session is active while it runs a step."""


class _EagerRecording:
    def __init__(self, body: CaptureBody, outputs: Any):
        self.body = body
        self.outputs = outputs

    def replay(self, args: tuple, kwargs: dict) -> Any:
        return self.body(_NO_SPLIT, *args, **kwargs)

    def release(self) -> None:
        self.outputs = None


class EagerBackend:
    """Runs the step eagerly on every call: for CPU tensors, or machines without CUDA."""

    name = "eager"
    static_buffers = False
    capture_executes = True
    graphs = 0  # no pool to share: these never change
    users = 0
    cuda_devices = ()

    def warmup(self, fn: Callable, args: tuple, kwargs: dict, *, in_pool: bool = True) -> Any:
        return fn(*args, **kwargs)

    def capture(self, body: CaptureBody, args: tuple, kwargs: dict, generators: list = ()) -> Recording:
        # The step runs here; if it (or the check of its outputs) fails, take its writes back.
        undo = UndoLog()
        try:
            with undo:
                outputs = body(_NO_SPLIT, *args, **kwargs)
        except BaseException:
            undo.roll_back()
            raise
        return _EagerRecording(body, outputs)

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return empty_like_strided(like)

    def pool_bytes(self) -> int:
        return 0

    def renew_pool(self) -> None:
        pass

    def close(self) -> None:
        pass
