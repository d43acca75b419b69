"""`EagerBackend`: the step runs eagerly on every call, for CPU tensors or machines without CUDA.

It runs the step exactly as plain eager does: under no Python dispatch mode. While any dispatch mode
is active, ATen treats every tensor as a subclass (`at::isTensorSubclassLike`), and some composite
operations and backward formulas then take another path (`prod`'s backward, for one), whose results
differ in the last bits: a pass-through mode alone changed Faster R-CNN's gradients. So the capture
here keeps no undo log (`undo.py` is one such mode). Nothing needs one: no watch refuses anything on
this backend and nothing retries a failed call; a step that raises leaves what it wrote as eager
would, and the capture's snapshot puts the model, the optimizer and the RNG back.
"""

from __future__ import annotations

from typing import Any

from .base import CaptureBody, HostBackend, Recording
from .segments import Splitter


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
        # The step runs here, as plain eager runs it (see the module's docstring: no dispatch mode).
        return _EagerRecording(body, body(_NO_SPLIT, *args, **kwargs))
