"""`EagerBackend`: the step runs eagerly on every call, for CPU tensors or machines without CUDA."""

from __future__ import annotations

from typing import Any

from .base import CaptureBody, HostBackend, Recording
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
        self.ring = None

    def replay(self, args: tuple, kwargs: dict) -> Any:
        return self.body(_NO_SPLIT, *args, **kwargs)

    def release(self) -> None:
        self.outputs = None


class EagerBackend(HostBackend):
    """Runs the step eagerly on every call: for CPU tensors, or machines without CUDA."""

    name = "eager"
    static_buffers = False
    capture_executes = True

    def capture(
        self,
        body: CaptureBody,
        args: tuple,
        kwargs: dict,
        generators: list = (),
        *,
        split_in_backward: bool = False,
    ) -> Recording:
        # The step runs here; if it (or the check of its outputs) fails, take its writes back.
        undo = UndoLog()
        try:
            with undo:
                outputs = body(_NO_SPLIT, *args, **kwargs)
        except BaseException:
            undo.roll_back()
            raise
        return _EagerRecording(body, outputs)
