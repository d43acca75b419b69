"""`CudaGraphBackend` never captures into a pool whose last graph was released (CPU, no GPU needed).

torch's pinned-memory allocator (CachingHostAllocator, 2.11 on) counts a pool's graphs from their
`capture_begin` to their `reset`; at zero it marks the pool freeable and a later `capture_begin` into
that pool fails its internal assert (`use_count > 0`). On two GPUs a rank whose own capture succeeded
but whose peer's failed released its graph, the pool's last, and captured into the same pool on the
next call: that assert. Here `torch.cuda.CUDAGraph` is a fake that models the allocator's count and
raises as torch does, so every path that lets graphs go is checked without a GPU. Below, the device
allocator's count: a pool that a capture stopped by a host sync leaves behind is handed back (issue 42).
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import pytest
import torch

from graphstep.backends import cuda
from graphstep.backends.cuda import CudaGraphBackend


class HostAllocator:
    """What torch's pinned-memory allocator does with graph pools, as far as the assert goes."""

    def __init__(self) -> None:
        self.use_count: dict[tuple[int, int], int] = {}
        self.captured_into: list[tuple[int, int]] = []

    def begin(self, pool: tuple[int, int]) -> None:
        if pool in self.use_count and self.use_count[pool] <= 0:
            raise RuntimeError(
                f"INTERNAL ASSERT FAILED: use_count > 0 (pool {pool} captured into after its last graph)"
            )
        self.use_count[pool] = self.use_count.get(pool, 0) + 1
        self.captured_into.append(pool)

    def release(self, pool: tuple[int, int]) -> None:
        self.use_count[pool] -= 1  # stays known at 0: "freeable", as torch keeps it


@pytest.fixture
def backend(monkeypatch):
    host = HostAllocator()
    handles = itertools.count(1)

    class FakeGraph:
        def __init__(self) -> None:
            self.pool = None

        def register_generator_state(self, generator) -> None:
            pass

        def capture_begin(self, pool, capture_error_mode) -> None:
            host.begin(pool)
            self.pool = pool

        def capture_end(self) -> None:
            pass

        def replay(self) -> None:
            pass

        def reset(self) -> None:
            if self.pool is not None:
                host.release(self.pool)
                self.pool = None

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**40, 2**40))  # (all free)
    noop = lambda *a: None  # noqa: E731
    monkeypatch.setattr(cuda, "_allocator_calls", lambda: (noop, noop, noop))
    b = CudaGraphBackend.__new__(CudaGraphBackend)
    b.index, b.graphs, b.users, b._graphs_in_pool, b.stranded = 0, 0, 0, {}, []
    b.pool = b._new_pool()
    b._on_capture_stream = contextlib.nullcontext
    b._make_room = lambda: None
    b._end_generator_capture = lambda generators: None
    b.host = host
    return b


def capture(backend: CudaGraphBackend, fails: bool = False):
    def body(splitter, *args, **kwargs):
        if fails:
            raise RuntimeError("the step failed while capturing")
        return torch.zeros(1)

    if fails:
        with pytest.raises(RuntimeError, match="failed while capturing"):
            backend.capture(body, (), {})
        return None
    return backend.capture(body, (), {})


def test_a_graph_released_as_its_pools_last_is_followed_by_a_capture_into_a_fresh_pool(backend):
    """A rank whose capture succeeded while its peer's failed: it releases that graph, then captures
    again on a later call (the assert on two H100s before the fix)."""
    first = capture(backend)
    pool = backend.pool
    first.release()
    assert backend.pool != pool
    capture(backend).release()
    capture(backend)
    assert len(set(backend.host.captured_into)) == 3


def test_a_pool_with_a_graph_left_is_kept(backend):
    """Graphs of a pool released while another lives there (an evicted variant): the pool stays."""
    a, b = capture(backend), capture(backend)
    pool = backend.pool
    a.release()
    c = capture(backend)
    assert backend.pool == pool and backend.host.captured_into == [pool] * 3
    b.release()
    c.release()
    assert backend.pool != pool and backend.graphs == 0
    capture(backend)


def test_a_failed_capture_is_followed_by_a_capture_into_a_fresh_pool(backend):
    old = capture(backend)
    capture(backend, fails=True)
    pool = backend.pool
    assert pool != backend.host.captured_into[0]
    old.release()  # a graph of the abandoned pool: the current pool has no graph yet, and stays
    assert backend.pool == pool
    capture(backend).release()
    capture(backend)
    assert backend.graphs == 1


def test_releasing_after_close_makes_no_pool(backend):
    graph = capture(backend)
    backend.close()
    graph.release()
    assert backend.pool is None


# -- the device allocator's count: a pool a failed capture leaves behind is handed back ---------------


class DeviceAllocator:
    """torch's CUDA caching allocator as far as graph pools go: `begin` counts a reference and routes
    allocations to the pool, `end` stops the routing (raises when none), `release` drops a reference; at
    zero the pool is freeable and `empty_cache` hands its free segments back."""

    def __init__(self) -> None:
        self.use_count: dict[tuple[int, int], int] = {}
        self.underway: set[tuple[int, int]] = set()

    def begin(self, index: int, pool: tuple[int, int]) -> None:
        if pool in self.underway:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.use_count[pool] = self.use_count.get(pool, 0) + 1
        self.underway.add(pool)

    def end(self, index: int, pool: tuple[int, int]) -> None:
        if pool not in self.underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.underway.discard(pool)

    def release(self, index: int, pool: tuple[int, int]) -> None:
        self.use_count[pool] -= 1
        assert self.use_count[pool] >= 0, f"INTERNAL ASSERT FAILED: uc >= 0 (pool {pool})"


@pytest.fixture
def device(monkeypatch):
    """A backend whose graphs count their pool's references as torch 2.11's `CUDAGraph` does: `capture_begin`
    takes one; `capture_end` stops the routing and marks the capture ended, unless the capture was
    invalidated (a host sync), where it raises first; `reset` gives the reference back only after an end."""
    dev = DeviceAllocator()
    state = {"invalidated": False, "emptied": 0}
    handles = itertools.count(1)

    class FakeGraph:
        def __init__(self) -> None:
            self.pool, self.ended = None, False

        def register_generator_state(self, generator) -> None:
            pass

        def capture_begin(self, pool, capture_error_mode) -> None:
            dev.begin(0, pool)
            self.pool = pool

        def capture_end(self) -> None:
            if state["invalidated"]:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            dev.end(0, self.pool)
            self.ended = True

        def replay(self) -> None:
            pass

        def reset(self) -> None:
            if self.ended:
                dev.release(0, self.pool)
                self.ended = False

    def empty_cache() -> None:
        state["emptied"] += 1

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**40, 2**40))  # (all free)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(cuda, "_allocator_calls", lambda: (dev.begin, dev.end, dev.release))
    b = CudaGraphBackend.__new__(CudaGraphBackend)
    b.index, b.graphs, b.users, b._graphs_in_pool, b.stranded = 0, 0, 0, {}, []
    b.pool = b._new_pool()
    b._on_capture_stream = contextlib.nullcontext
    b._make_room = lambda: None
    b._end_generator_capture = lambda generators: None
    b.dev, b.state = dev, state
    return b


def test_a_capture_a_host_sync_stopped_hands_its_pool_back(device):
    """A graph break: the capture was invalidated inside CUDA, so its graph never gave its reference back.
    The abandoned pool must reach zero references (freeable) and the cache be emptied once, or it keeps
    the warm-ups' cached blocks for good (issue 42: a step with a break reserved 2.2x eager's peak)."""
    pool = device.pool
    device.state["invalidated"] = True
    capture(device, fails=True)
    device.state["invalidated"] = False
    assert device.dev.use_count[pool] == 0 and pool not in device.dev.underway
    assert device.state["emptied"] == 1 and device.pool != pool
    capture(device)  # the fresh pool works as before
    assert device.dev.use_count[device.pool] == 2  # the backend's own reference and the graph's


def test_a_capture_the_step_stopped_in_python_is_not_released_twice(device):
    """A failure the step raised while the capture was still valid: `capture_end` succeeded and `reset`
    gave the graph's reference back; one more release would take the count below zero."""
    pool = device.pool
    capture(device, fails=True)
    assert device.dev.use_count[pool] == 0 and device.state["emptied"] == 0


def test_an_abandoned_pool_that_earlier_graphs_still_use_is_kept(device):
    """A re-capture that failed in a pool where an earlier variant's graph lives: that graph keeps it."""
    first = capture(device)
    pool = device.pool
    device.state["invalidated"] = True
    capture(device, fails=True)
    device.state["invalidated"] = False
    assert device.dev.use_count[pool] == 1 and device.state["emptied"] == 0
    first.release()
    assert device.dev.use_count[pool] == 0


def test_segments_replay_on_the_path_and_the_stream_their_warm_ups_took(backend):
    """transformers computes differently while a stream captures (explicit masks, no host checks), and
    graphstep's warm-ups and capture take that path (`libraries.as_captured`): a segment that replays its
    transformers code must take it too, or its replays compute another function than its warm-ups. And
    on the capture stream, where it warmed up: on the caller's, its cuBLAS calls made that stream's
    workspaces too, held for good beside the capture stream's (issue 42)."""
    import_utils = pytest.importorskip("transformers.utils.import_utils")

    recording = capture(backend)
    streams = []

    @contextlib.contextmanager
    def on_capture_stream():
        streams.append("in")
        yield
        streams.append("out")

    backend._on_capture_stream = on_capture_stream
    seen = []

    class Segment:
        def run(self) -> None:
            seen.append((import_utils.is_cuda_stream_capturing(), streams[-1]))

    recording.parts, recording.segments = [lambda: None, lambda: None], [Segment()]
    recording.replay((), {})
    assert seen == [(True, "in")] and streams == ["in", "out"]
    assert import_utils.is_cuda_stream_capturing() is False


def test_a_segments_forward_warms_up_outside_the_pool(device):
    """A replay runs eager segments in the default pool (the pool's free blocks are the graphs' scratch);
    their warm-ups allocate there too, or the pool keeps blocks only they used, and the segments take as
    much again at replay. The pool's routing stops around the segment's forward and resumes after it,
    its count even."""
    from graphstep.backends import autograd_segments, segments

    seen = {}
    routed = lambda: device.pool in device.dev.underway  # noqa: E731

    def piece(x):
        seen["segment"] = routed()
        return x * 2

    segment = autograd_segments.eager_segment(piece)

    def step(x):
        seen["before"] = routed()
        y = segment(x)
        seen["after"] = routed()
        return y.sum()

    with segments.watching_warmup(device.outside_pool):
        device.warmup(step, (torch.ones(2, requires_grad=True),), {})
    assert seen == {"before": True, "segment": False, "after": True}
    assert device.dev.use_count[device.pool] == 1 and not routed()
    with device.outside_pool():  # outside a warm-up in the pool: nothing to stop
        assert device.dev.use_count[device.pool] == 1


def test_a_pools_live_tensors_move_out_in_place_and_the_pool_goes_back(device, monkeypatch):
    """The tensors the warm-ups made in a pool a graph break abandoned (optimizer state made in the
    first warm-up) kept its segments for good (issue 42): they get fresh memory, as the same tensor
    objects with the same values (views of one storage stay one storage), and the cache is emptied once
    more; tensors elsewhere stay where they are."""
    from graphstep.backends import stranded

    inside, view, outside = torch.arange(6.0), None, torch.ones(3)
    view = inside[2:4]
    start = inside.untyped_storage().data_ptr()
    segments = [{"address": start, "total_size": 24, "segment_pool_id": device.pool, "device": 0}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    device.state["invalidated"] = True
    capture(device, fails=True)  # abandons the pool the fake segment belongs to
    device.state["invalidated"] = False
    assert device.stranded and device.state["emptied"] == 1
    before = {id(t) for t in (inside, view, outside)}
    sparse = torch.ones(2).to_sparse()  # no storage to move: left alone
    moved = stranded.move_out(device, [inside, view, outside, inside, sparse])
    assert moved == 24 and {id(t) for t in (inside, view, outside)} == before
    assert inside.untyped_storage().data_ptr() != start
    assert view.untyped_storage().data_ptr() == inside.untyped_storage().data_ptr()
    assert torch.equal(inside, torch.arange(6.0)) and torch.equal(view, torch.tensor([2.0, 3.0]))
    assert device.state["emptied"] == 3 and not device.stranded  # before the copies and after
    assert stranded.move_out(device, [inside]) == 0  # once: nothing abandoned since


def test_a_pool_a_failure_in_python_abandoned_gives_its_tensors_back_too(device, monkeypatch):
    """A capture the step stopped before CUDA saw a sync (the models suite's `grouped_mm` experts) renews
    the pool as a host sync does: the optimizer state its warm-ups made there moves out as well (it
    did not: 0.15 GiB stayed reserved in that pool on the H100, 2026-11-27)."""
    from graphstep.backends import stranded

    inside = torch.arange(4.0)
    start = inside.untyped_storage().data_ptr()
    segments = [{"address": start, "total_size": 16, "segment_pool_id": device.pool, "device": 0}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    pool = device.pool
    capture(device, fails=True)
    assert device.stranded == [pool] and device.dev.use_count[pool] == 0
    copying = []
    relocate = stranded.relocate
    monkeypatch.setattr(
        stranded, "relocate", lambda groups: copying.append(device.state["emptied"]) or relocate(groups)
    )
    assert stranded.move_out(device, [inside]) == 16 and inside.untyped_storage().data_ptr() != start
    # the pool's empty segments (the warm-ups' cached blocks) go back before the copies are made beside them
    assert copying == [1] and device.state["emptied"] == 2
    assert torch.equal(inside, torch.arange(4.0)) and not device.stranded


def test_no_pool_abandoned_moves_nothing_and_syncs_nothing(device, monkeypatch):
    from graphstep.backends import stranded

    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: pytest.fail("no snapshot needed"))
    capture(device)  # captured: its pool stays the step's
    assert not device.stranded and stranded.move_out(device, [torch.ones(2)]) == 0


@pytest.mark.parametrize("free_of_total", [0.2, 0.5])
def test_a_full_collection_before_a_capture_only_when_the_device_is_short(free_of_total, monkeypatch):
    """A collection of the younger generations before every capture (milliseconds); a full one, which
    frees what dead reference cycles hold, only with less than a quarter of the device free."""
    collected = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free_of_total * 2**30), 2**30))
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    cuda._collect_garbage(0)
    assert collected == ([1, 2] if free_of_total < 0.25 else [1])


@pytest.mark.parametrize("torch_has", ["pool and history", "pool", "neither"])
def test_pool_ranges_lists_one_pool_without_the_history_where_torch_can(torch_has, monkeypatch):
    """`pool_ranges` (each capture boundary, `stats.pool_bytes`, moving tensors out of an abandoned pool)
    asks the allocator for one pool's segments without its recorded history where this torch's
    `memory_snapshot` takes those arguments, and picks the same segments from a full listing elsewhere."""
    listing = [
        {"device": 0, "address": 100, "total_size": 10, "segment_pool_id": (0, 7)},
        {"device": 0, "address": 200, "total_size": 20, "segment_pool_id": (0, 0)},
        {"device": 1, "address": 300, "total_size": 30, "segment_pool_id": (0, 7)},
        {"device": 0, "address": 400, "total_size": 40, "segment_pool_id": (0, 8)},
    ]
    asked: list[dict] = []

    def pool_and_history(mempool_id=None, include_traces=True):
        asked.append({"mempool_id": mempool_id, "include_traces": include_traces})
        return [s for s in listing if mempool_id is None or s["segment_pool_id"] == mempool_id]

    def pool(mempool_id=None):
        asked.append({"mempool_id": mempool_id})
        return [s for s in listing if mempool_id is None or s["segment_pool_id"] == mempool_id]

    def neither():
        asked.append({})
        return listing

    monkeypatch.setattr(torch.cuda, "memory_snapshot", {"pool and history": pool_and_history, "pool": pool,
                                                         "neither": neither}[torch_has])  # fmt: skip
    assert cuda.pool_ranges(0, [(0, 7)]) == [(100, 110)]
    assert cuda.pool_ranges(0, [(0, 7), (0, 8)]) == [(100, 110), (400, 440)]
    one_pool = {"mempool_id": (0, 7)} if torch_has != "neither" else {}
    history = {"include_traces": False} if torch_has == "pool and history" else {}
    assert asked == [{**one_pool, **history}, {"mempool_id": None, **history} if one_pool else {}]


def test_an_empty_part_is_not_replayed_and_not_warned_of_and_other_warnings_pass_on():
    """torch warns of an empty graph as of a capture on the wrong stream; a part of a step after its last
    eager segment is empty by design. `_end_capture` tells it, swallows that warning alone."""
    import warnings

    class Graph:
        def __init__(self, *messages: str) -> None:
            self.messages, self.ended = messages, False

        def capture_end(self) -> None:
            self.ended = True
            for message in self.messages:
                warnings.warn(message, UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        empty = Graph(
            "The CUDA Graph is empty. This usually means that the graph was attempted to be captured"
        )
        assert cuda._end_capture(empty) and empty.ended
        assert not cuda._end_capture(Graph())
        assert not cuda._end_capture(Graph("something else"))
    assert [str(w.message) for w in caught] == ["something else"]
