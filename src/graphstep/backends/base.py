"""The backend protocol: what warm-up, capture and replay mean on a machine, and the
`Recording` a capture hands out (one captured step, replayable and releasable).

- `CudaGraphBackend` (`cuda.py`): warm-up runs eagerly on a side stream with every allocation routed into
  the step's private memory pool; capture records the step into `torch.cuda.CUDAGraph`s in
  that pool (it executes nothing); a replay launches the graphs on the caller's stream.
- `EagerBackend` (`eager.py`): the step simply runs, every call. Used where there is no CUDA device or the
  step's tensors live on the CPU, so the same code runs everywhere with the same bookkeeping.
- `RecordingBackend` (`recording.py`): a CPU stand-in for a CUDA graph for tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .segments import Segment, Splitter


class Recording(Protocol):
    """One captured step."""

    outputs: Any
    """The step's outputs as captured: for a graph, the buffers every replay writes into."""
    ring: Any
    """The output ring the outputs are handed out of (see `output_ring.py`), or None: copies."""

    def replay(self, args: tuple, kwargs: dict) -> Any:
        """Perform one step and return its outputs (for a graph: `self.outputs`, refreshed)."""
        ...

    def release(self) -> None: ...


class PartsRecording:
    """A captured step as parts (graphs, or lists of recorded operations) with eager segments
    between them (see `segments.py`); without segments, one part."""

    def __init__(self, parts: list[Callable[[], None]], release: Callable[[], None]):
        self.parts = parts
        self._release = release
        self.outputs: Any = None
        self.segments: list[Segment] = []
        self.cuda_graphs: list[torch.cuda.CUDAGraph] = []
        """The graphs of the parts, for a CUDA backend (their pool can be asked for)."""
        self.grads_after: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        """`.grad`s as the capture left them, put back after every replay: the grads a step leaves
        attached (its optimizer runs outside it) that the user set to None since; with segments,
        which attach the grads they read, every parameter's."""
        self.host_draws: list[Callable[[], None]] = []
        """Host random draws whose values the step ignores, redone after every replay so that the
        host generators advance as eager's do (see `effects/host_random.py`)."""
        self.ring: Any = None
        """The output ring the last part writes (see `output_ring.py`), or None."""
        self.segment_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """What the eager segments run under at replay: what the backend's warm-ups and capture ran under
        (CUDA: `libraries.as_captured`, so that transformers code in a segment takes the path its warm-ups
        took, the one the graphs around it replay)."""
        self.undo: Callable[[], None] | None = None
        """Takes back the tensor writes of a capture that executed the step (the recording backend),
        should the capture fail after the backend returned (another rank failed, a refused read);
        None once the capture is accepted, or where the capture executed nothing (CUDA)."""

    def launch(self) -> None:
        """The parts alone, for a step without eager segments: the output ring's turn (the slot the
        graph writes is taken back from the caller first), then the graph. Code that launches a
        captured step's graphs by hand (benchmarks) calls this, so that the ring keeps count."""
        if self.ring is not None:
            self.ring.before_replay()
        for part in self.parts:
            part()

    def replay(self, args: tuple, kwargs: dict) -> Any:
        parts = self.parts
        if not self.segments:
            self.launch()
            for p, g in self.grads_after:  # grads the step leaves attached, set to None since
                p.grad = g
            for draw in self.host_draws:
                draw()
            return self.outputs
        with self.segment_context():
            for part, segment in zip(parts, self.segments):
                part()
                segment.run()
        if self.ring is not None:  # the last part writes the ring (a segment may have raised before)
            self.ring.before_replay()
        parts[-1]()
        for p, g in self.grads_after:
            p.grad = g
        for draw in self.host_draws:
            draw()
        return self.outputs

    def release(self) -> None:
        if self.parts:
            self._release()
        self.parts, self.segments, self.grads_after, self.outputs = [], [], [], None
        self.host_draws, self.ring = [], None


CaptureBody = Callable[[Splitter], Any]
"""The step as a backend captures it: called once with the backend's splitter, returns the outputs."""


class Backend(Protocol):
    name: str
    graphs: int
    """Graphs alive in this backend's pool (CUDA; 0 elsewhere)."""
    cuda_devices: tuple[int, ...]
    """The CUDA device the step runs on, whose RNG a snapshot must save; empty elsewhere."""
    users: int
    """Captured steps using this backend."""
    static_buffers: bool
    """Replays read fixed input buffers, so each call's tensors must be copied into them, and
    write fixed output buffers, which the next replay overwrites."""
    capture_executes: bool
    """Capturing also performs the step (eager, recording). A CUDA capture does not: the call
    that captures must replay once to take its step."""

    def warmup(self, fn: Callable, args: tuple, kwargs: dict, *, in_pool: bool = True) -> Any:
        """Run the step eagerly. `in_pool=False` once graphs exist: memory a graph uses as
        scratch between its replays must not hold tensors that outlive an eager call."""
        ...

    def outside_pool(self) -> contextlib.AbstractContextManager:
        """Within a warm-up: allocate as a replay's eager segments do (CUDA: outside the pool)."""
        ...

    def capture(
        self,
        body: CaptureBody,
        args: tuple,
        kwargs: dict,
        generators: list = (),
        *,
        split_in_backward: bool = False,
    ) -> Recording:
        """Record `body` (the step). `args, kwargs`: the call's (the eager backend replays with a
        call's own arguments). `generators`: the step's own CUDA `torch.Generator`s, which a
        graph must know to advance them on every replay as eager would. `split_in_backward`: an
        eager segment on the autograd path splits the capture inside autograd's backward thread too."""
        ...

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An empty tensor with `like`'s shape, dtype, device and stride, for a static input."""
        ...

    def pool_bytes(self) -> int: ...

    def renew_pool(self) -> None:
        """Capture later graphs into a fresh pool (after every graph was released)."""
        ...

    def close(self) -> None: ...


def empty_like_strided(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)


class HostBackend:
    """What the backends that run on the host share (eager, recording): no memory pool, no CUDA
    device, warm-up as a plain call."""

    graphs = 0  # no pool to share: these never change
    users = 0
    cuda_devices: tuple[int, ...] = ()

    def warmup(self, fn: Callable, args: tuple, kwargs: dict, *, in_pool: bool = True) -> Any:
        return fn(*args, **kwargs)

    def outside_pool(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return empty_like_strided(like)

    def pool_bytes(self) -> int:
        return 0

    def renew_pool(self) -> None:
        pass

    def close(self) -> None:
        pass
