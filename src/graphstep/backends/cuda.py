"""`CudaGraphBackend`: CUDA graphs in one private memory pool, warm-up on the capture stream inside it."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from .base import CaptureBody, PartsRecording, Recording, empty_like_strided
from .compiled import no_compiling
from .libraries import as_captured
from .segments import Splitter
from .sync_free import counts_on_device


# The allocator's pool-routing calls are private and were renamed across releases; the
# names below exist from torch 2.6 on (end: 2.6-2.7 spell it `...CurrentStreamToPool`).
def _allocator_calls() -> tuple[Callable, Callable, Callable]:
    C = torch._C
    end = getattr(C, "_cuda_endAllocateToPool", None) or C._cuda_endAllocateCurrentStreamToPool
    return C._cuda_beginAllocateToPool, end, C._cuda_releasePool


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _end_routing(index: int, pool: tuple[int, int]) -> bool:
    """End the allocator's routing to the pool of a capture that failed: True when it was still on,
    which is when the capture failed inside CUDA (a host sync: every graph break) before the
    allocator's end of the capture. Then its graph still holds its reference to the pool (`reset`
    gives it back only after a capture that ended)."""
    try:
        _allocator_calls()[1](index, pool)
    except Exception:  # the capture got past the allocator's end: its graph's reset released it
        return False
    return True


def _hand_back(index: int, pool: tuple[int, int], *, used: bool) -> None:
    """Drop the reference a failed capture's graph left on its (abandoned) pool, and hand the pool's
    free segments back. That pool holds the warm-ups' cached blocks, a whole eager step's peak; kept,
    a step with a graph break reserved two pools of an eager step's size (issue 42: 2.2x eager's
    peak). Segments holding live tensors (an optimizer state made in a warm-up) stay; `used`: an
    earlier graph lives in the pool, which keeps it whole."""
    with contextlib.suppress(Exception):
        _allocator_calls()[2](index, pool)
    if not used:
        torch.cuda.empty_cache()


def pool_ranges(index: int, pools: Collection[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) of each segment the allocator holds for one of `pools` on device `index`.

    Listed of the one pool alone and without the allocator's recorded history where this torch's
    `memory_snapshot` takes those arguments (`mempool_id`, `include_traces`): while a user records the
    history (`_record_memory_history`), a full listing converts every entry of it, seconds with a long
    one, at each boundary of a capture."""
    pools = {tuple(p) for p in pools}
    arguments = _parameters(torch.cuda.memory_snapshot)
    options: dict[str, Any] = {"include_traces": False} if "include_traces" in arguments else {}
    alone = next(iter(pools)) if len(pools) == 1 and "mempool_id" in arguments else None
    if alone is not None:
        options["mempool_id"] = alone
    return [
        (s["address"], s["address"] + s["total_size"])
        for s in torch.cuda.memory_snapshot(**options)
        if s.get("device", index) == index and tuple(s.get("segment_pool_id", alone or ())) in pools
    ]


@functools.lru_cache(maxsize=4)
def _parameters(fn: Callable) -> frozenset[str]:
    """The names `fn` takes (`stats.pool_bytes` may be read every step: its signature is read once)."""
    return frozenset(inspect.signature(fn).parameters)


def _pool_members(index: int, pool: tuple[int, int], tensors: list[torch.Tensor]) -> list[bool]:
    """Which of `tensors` live in `pool` on device `index` now (one listing of the allocator's segments)."""
    ranges = pool_ranges(index, [pool])
    return [
        t.device.type == "cuda" and any(a <= t.untyped_storage().data_ptr() < b for a, b in ranges)
        for t in tensors
    ]


def _nothing() -> None:
    pass


def _end_capture(graph: torch.cuda.CUDAGraph) -> bool:
    """End `graph`'s capture: True when it captured no work. torch warns of an empty graph as of one
    captured on the wrong device or stream; between two eager segments of a step, or after the last one
    (an optimizer step run eagerly, then `zero_grad`), a part is empty by design: it is not replayed (its
    random generators' offsets advance by nothing) and not warned of. Other warnings pass on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.capture_end()
    empty = False
    for warning in caught:
        if str(warning.message).startswith("The CUDA Graph is empty"):
            empty = True
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return empty


@contextlib.contextmanager
def _segments_at_replay(backend: CudaGraphBackend) -> Iterator[None]:
    """Around a replay's graphs and eager segments: the library path their warm-ups and capture took
    (`as_captured`), on the capture stream they warmed up on. On the caller's stream, a segment's cuBLAS
    calls made that stream's workspaces (one per thread that runs them, forward and backward: 64 MiB
    with CUBLAS_WORKSPACE_CONFIG=:4096:8), kept for the life of the process beside the capture stream's
    (issue 42), and took none of the blocks its warm-ups had cached on the capture stream."""
    with as_captured(), backend._on_capture_stream():
        yield


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The side stream graphstep warms up and captures on, one per CUDA device for the process.

    Construct DistributedDataParallel under it (`with torch.cuda.stream(graphstep.capture_stream()):`):
    DDP keeps each parameter's gradient accumulator for good, and autograd runs it on the stream
    it was made on. Made there, backward needs no cross-stream hop; made on the default stream,
    no graph can capture it.
    """
    index = torch.cuda._utils._get_device_index(device, optional=True)
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device=index)
    return _capture_streams[index]


def _collect_garbage(index: int) -> None:
    """Before a capture: the warm-ups' garbage, by a collection of the younger generations
    (milliseconds). A full one walks every object (130-200 ms in a process of 300,000; torch's own
    capture dropped it), and is made only when the driver has less than a quarter of the device free:
    then the memory that dead reference cycles hold may be what the capture needs."""
    gc.collect(1)
    free, total = torch.cuda.mem_get_info(index)
    if free < total // 4:
        gc.collect()


class _HandleInBackward(torch.autograd.Function):
    """Identity whose backward asks for autograd's device thread's cuBLAS handle on the forward's stream."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad + 0  # a kernel first: it makes the device's context current on this thread
        torch.cuda.current_blas_handle()
        return grad


def _prime_library_workspaces(device: torch.device, stream: torch.cuda.Stream) -> None:
    """Make cuBLAS allocate `stream`'s workspaces now, outside any pool.

    cuBLAS keeps one workspace per handle and stream for the life of the process (32 MiB on Hopper, or
    as CUBLAS_WORKSPACE_CONFIG says), and cuBLASLt one more (1 MiB). Made during a warm-up they would
    sit in the pool for good, and `close()` could never give the pool back. The forward runs on this
    thread, the backward on autograd's device thread: each has its own handle. Asking for a handle makes
    its workspace; only the cuBLASLt one needs a product (a linear layer with a bias), made in bfloat16,
    the usual autocast type, where the device has it: it loads kernels a model under autocast loads too
    (priming with float32 products cost a fresh process 0.16-0.20 s on an H200, most of a tiny GPT's
    time to steady state beyond a hand-written graph's).
    """
    with torch.cuda.device(device), torch.cuda.stream(stream):
        torch.cuda.current_blas_handle()
        _HandleInBackward.apply(torch.zeros(1, device=device, requires_grad=True)).sum().backward()
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
        w = torch.zeros(8, 8, device=device, dtype=dtype)
        torch.nn.functional.linear(w, w, w[0])
    stream.synchronize()


class CudaGraphBackend:
    """CUDA graphs in one private memory pool, with warm-up on the capture stream inside it."""

    name = "cuda"
    static_buffers = True
    capture_executes = False
    _routing = False  # a warm-up's allocations go to the pool now (`_in_pool`)

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.cuda_devices = (self.index,)
        self.stream = capture_stream(self.index)
        # One reference to the pool, held until close(), keeps it alive between warm-up and capture: an
        # `empty_cache` between cannot hand the warm-ups' cached blocks back, so the capture reuses them.
        self.pool = self._new_pool()
        self.graphs = 0
        """Graphs alive, of every step that shares this backend (in this pool or earlier ones)."""
        self._graphs_in_pool: dict[tuple[int, int], int] = {}
        """Graphs alive in each pool that still has some: a pool leaves when its last graph goes."""
        self.stranded: list[tuple[int, int]] = []  # pools a failed capture abandoned, no graph in them
        self.users = 0
        """Captured steps using this backend (`capture(share_pool_with=...)`); close() at the last."""
        _prime_library_workspaces(self.device, self.stream)
        # Allocated now: after a capture that ran out of memory, `_end_generator_capture` must not
        # allocate inside its capture (a failure there would leave the stream capturing).
        self._draw = torch.empty(1, device=device)

    def _new_pool(self) -> tuple[int, int]:
        pool = torch.cuda.graph_pool_handle()
        begin, end, _ = _allocator_calls()
        begin(self.index, pool)
        end(self.index, pool)
        return pool

    @contextlib.contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        caller = torch.cuda.current_stream(self.index)
        self.stream.wait_stream(caller)
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    @contextlib.contextmanager
    def _in_pool(self) -> Iterator[None]:
        begin, end, release = _allocator_calls()
        # Route every allocation on this device, the autograd engine's backward thread
        # included, into the pool while the warm-up runs.
        begin(self.index, self.pool)
        self._routing = True
        try:
            yield
        finally:
            self._routing = False
            end(self.index, self.pool)
            release(self.index, self.pool)

    @contextlib.contextmanager
    def outside_pool(self) -> Iterator[None]:
        """In a warm-up: an eager segment's forward allocates outside the pool, as at replay."""
        if not self._routing:
            yield
            return
        begin, end, release = _allocator_calls()
        end(self.index, self.pool)
        self._routing = False
        try:
            yield
        finally:
            begin(self.index, self.pool)  # counts a reference to the pool: the release evens it
            release(self.index, self.pool)
            self._routing = True

    def _make_room(self) -> None:
        """Give the allocator's unused cached blocks back to the driver when the driver has less free.

        Eagerly, an allocation that finds no free device memory makes the caching allocator hand its
        unused cached blocks back and try again. While allocations go to a pool (a warm-up, a capture)
        it cannot: a warm-up or capture would run out of memory where eager would not. Called before
        each, never on a replay.
        """
        free, _ = torch.cuda.mem_get_info(self.index)
        unused = torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index)
        if free < unused:
            with torch.cuda.device(self.index):
                torch.cuda.empty_cache()

    def warmup(self, fn: Callable, args: tuple, kwargs: dict, *, in_pool: bool = True) -> Any:
        self._make_room()
        # as_captured, counts_on_device: the path the graph replays, so a compiled model compiles it here.
        with (
            as_captured(),
            counts_on_device(),
            self._on_capture_stream(),
            self._in_pool() if in_pool else contextlib.nullcontext(),
        ):
            return fn(*args, **kwargs)

    def capture(
        self,
        body: CaptureBody,
        args: tuple,
        kwargs: dict,
        generators: list = (),
        *,
        split_in_backward: bool = False,
    ) -> Recording:
        graphs: list[torch.cuda.CUDAGraph] = []
        empty: set[int] = set()  # parts that captured no work
        capturing = False
        # A part begun in autograd's backward thread (an eager segment's backward) ends in the
        # caller's: CUDA lets only a "relaxed" capture end on another thread than it began on.
        mode = "relaxed" if split_in_backward else "thread_local"

        def begin_part() -> None:
            nonlocal capturing
            graph = torch.cuda.CUDAGraph()
            for generator in generators:
                graph.register_generator_state(generator)
            graphs.append(graph)
            graph.capture_begin(pool=self.pool, capture_error_mode=mode)
            capturing = True

        def end_part() -> None:
            nonlocal capturing
            capturing = False
            if _end_capture(graphs[-1]):
                empty.add(len(graphs) - 1)

        torch.cuda.synchronize(self.index)
        _collect_garbage(self.index)
        self._make_room()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a collection inside the capture could free memory a kernel is using
        try:
            # no_compiling: a compiled frame that would compile here raises; counts_on_device: sync_free.py.
            with as_captured(), no_compiling(), counts_on_device(), self._on_capture_stream():
                begin_part()
                try:
                    in_pool = functools.partial(_pool_members, self.index, self.pool)
                    splitter = Splitter(end_part, begin_part, executes=False, in_pool=in_pool)
                    outputs = body(splitter, *args, **kwargs)
                except BaseException:
                    # End the failed capture so the stream is usable again; its own error
                    # (capture invalidated) says less than the step's, which propagates. A
                    # failing capture_end skips un-routing the pool, so do that here too.
                    if capturing:
                        with contextlib.suppress(Exception):
                            graphs[-1].capture_end()
                    for graph in graphs:
                        with contextlib.suppress(Exception):
                            graph.reset()
                    self._abandon_pool()
                    self._end_generator_capture(generators)
                    raise
                end_part()
        finally:
            if gc_was_enabled:
                gc.enable()
        pool = self.pool
        self.graphs += 1
        self._graphs_in_pool[pool] = self._graphs_in_pool.get(pool, 0) + 1

        def release() -> None:
            for graph in graphs:
                graph.reset()
            self.graphs -= 1
            self._graphs_in_pool[pool] -= 1
            if not self._graphs_in_pool[pool]:
                del self._graphs_in_pool[pool]
                if pool == self.pool:
                    # Its last graph gone, torch's pinned-memory allocator has counted the pool out
                    # and asserts if it is captured into again: whoever released it (a re-capture, a
                    # rank whose peer failed its capture, a signature given up), capture anew.
                    self.renew_pool()

        parts = [_nothing if i in empty else graph.replay for i, graph in enumerate(graphs)]
        recording = PartsRecording(parts, release)
        recording.segment_context = functools.partial(_segments_at_replay, self)
        recording.cuda_graphs = graphs
        recording.outputs = outputs
        return recording

    def _end_generator_capture(self, generators: list) -> None:
        """A capture invalidated by the step (a host sync) makes `capture_end` fail before it tells
        the RNG generators the capture is over: each would then refuse every later random draw
        ("Offset increment outside graph capture"). A tiny capture of its own, in a pool of its
        own, begins and ends their capture again, cleanly."""
        with contextlib.suppress(Exception):
            graph = torch.cuda.CUDAGraph()
            for generator in generators:
                graph.register_generator_state(generator)
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
                try:
                    self._draw.uniform_()
                finally:
                    graph.capture_end()
            graph.reset()
            self.stream.synchronize()

    def _abandon_pool(self) -> None:
        """After a failed capture, later warm-ups and captures use a fresh pool (after a host sync torch 2.11
        keeps the old one marked as capturing); graphs captured earlier keep it alive while they live."""
        old, used = self.pool, bool(self._graphs_in_pool.get(self.pool))
        routed = _end_routing(self.index, old)
        self.renew_pool()
        if routed:  # a host sync: its graph still held a reference to the pool
            _hand_back(self.index, old, used=used)
        if not used:  # with no graph in it, the tensors it still holds move out (`stranded.py`)
            self.stranded.append(old)

    def renew_pool(self) -> None:
        """Start a fresh pool; the old one is freed once its graphs and tensors are gone.

        Needed too once every graph of a pool was released (`capture`'s `release` does it): torch's
        pinned-memory allocator (CachingHostAllocator, 2.11 on) counts each pool's graphs from their
        `capture_begin` to their `reset`; at zero it marks the pool freeable, and a later
        `capture_begin` into the same pool id fails its internal assert (`use_count > 0`).
        """
        if self.pool is None:  # closed
            return
        _allocator_calls()[2](self.index, self.pool)
        self.pool = self._new_pool()

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        if like.device.type == "cpu":
            # A graph can only copy from page-locked host memory.
            return empty_like_strided(like).pin_memory()
        return empty_like_strided(like)

    def pool_bytes(self) -> int:
        return sum(end - start for start, end in pool_ranges(self.index, [self.pool])) if self.pool else 0

    def close(self) -> None:
        # Graphs were reset already; dropping the last reference makes the pool's memory
        # free for the next `torch.cuda.empty_cache()`.
        if self.pool is not None:
            _allocator_calls()[2](self.index, self.pool)
            self.pool = None
