"""`CudaGraphBackend` never captures into a pool whose last graph was released (CPU, no GPU needed).

torch's pinned-memory allocator (CachingHostAllocator, 2.11 on) counts a pool's graphs from their
`capture_begin` to their `reset`; at zero it marks the pool freeable and a later `capture_begin` into
that pool fails its internal assert (`use_count > 0`). On two GPUs a rank whose own capture succeeded
but whose peer's failed released its graph, the pool's last, and captured into the same pool on the
next call: that assert. Here `torch.cuda.CUDAGraph` is a fake that models the allocator's count and
raises as torch does, so every path that lets graphs go is checked without a GPU.
"""

from __future__ import annotations

import contextlib
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
    noop = lambda *a: None  # noqa: E731
    monkeypatch.setattr(cuda, "_allocator_calls", lambda: (noop, noop, noop))
    b = CudaGraphBackend.__new__(CudaGraphBackend)
    b.index, b.graphs, b.users, b._graphs_in_pool = 0, 0, 0, {}
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
