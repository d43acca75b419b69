"""The core on a real GPU: a GPT trained bitwise equal to eager, shapes, output modes, failures, memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from gpu_common import (
    SMALL,
    assert_same_losses,
    assert_same_params,
    batches,
    deterministic,
    gpt_pair,
    needs_cuda,
    run,
    train_step,
)

import graphstep
from graphstep.errors import HostSyncError
from graphstep.guards import fastcheck

pytestmark = needs_cuda


def test_gpt_30_steps_bitwise_equal_to_eager():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(30)
    with deterministic():
        eager = run(train_step(m_e, o_e), data)
        with graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g) as step:
            graphed = run(step, data)
            stats = step.stats
    assert step.backend_name == "cuda"
    assert (stats.warmup_calls, stats.captures, stats.replays) == (3, 1, 27)
    assert_same_losses(eager, graphed)
    assert_same_params(m_e, m_g)
    assert eager[-1] < eager[0], f"the GPT did not learn: {eager[0].item()} -> {eager[-1].item()}"


def test_shape_change_captures_a_second_graph_in_the_same_pool():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    small, large = batches(12, batch_size=2), batches(12, batch_size=4, seed=1)
    data = [b for pair in zip(small, large) for b in pair]  # alternate the two shapes
    with deterministic():
        eager = run(train_step(m_e, o_e), data)
        step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g)
        graphed = run(step, data)
    assert step.stats.graphs_alive == 2 and step.stats.captures == 2
    pools = {
        g.pool() for life in step._lives.values() for v in life.variants for g in v.recording.cuda_graphs
    }
    assert pools == {step._ctx.backend.pool}, f"graphs in pools {pools}, step pool {step._ctx.backend.pool}"
    assert_same_losses(eager, graphed)
    assert_same_params(m_e, m_g)
    step.close()


@pytest.mark.parametrize("mode", ["clone", "graph"])
def test_output_modes(mode):
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(8)
    with deterministic():
        eager = run(train_step(m_e, o_e), data)
        step = graphstep.capture(
            train_step(m_g, o_g), model=m_g, optimizer=o_g, config=graphstep.Config(outputs=mode)
        )
        kept = []
        for x, y in data:
            kept.append(step(x, y))
            if mode == "graph" and len(kept) >= 5:
                # Graph-owned: valid now, the very same buffer as the previous replay's result.
                assert torch.equal(kept[-1], eager[len(kept) - 1])
                assert kept[-1].data_ptr() == kept[-2].data_ptr()
    if mode == "clone":
        assert_same_losses(eager, kept)  # every result kept its own value
    else:
        # Replays overwrote the shared buffer: all results from replays now show the last loss.
        assert all(torch.equal(t, eager[-1]) for t in kept[4:])
        assert not torch.equal(kept[4], eager[4]) or torch.equal(eager[4], eager[-1])
    step.close()


def test_results_let_go_at_once_come_from_the_output_ring_without_copies():
    """The loop that never waits for the GPU: each loss summed on the device and dropped. The
    graph writes its loss into two alternating slots; nothing is copied, and every sum is eager's."""
    if getattr(fastcheck.helper(), "OutputRing", None) is None:
        pytest.skip("the output ring is the C++ guard helper's (graphstep imported without it built)")
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(12)
    with deterministic():
        eager_sum = torch.zeros((), device="cuda")
        for x, y in data:
            eager_sum += train_step(m_e, o_e)(x, y)
        step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g)
        graphed_sum, addresses = torch.zeros((), device="cuda"), set()
        for x, y in data:
            loss = step(x, y)
            graphed_sum += loss
            if step.stats.replays:
                addresses.add(loss.data_ptr())
        del loss
        held = [step(x, y) for x, y in data[:4]]  # held: each moves to a copy before its slot is rewritten
        eager_held = [train_step(m_e, o_e)(x, y) for x, y in data[:4]]
    (life,) = step._lives.values()
    ring = life.current.recording.ring
    assert ring is not None and len(addresses) == 2
    assert torch.equal(eager_sum, graphed_sum)
    assert_same_losses(eager_held, held)
    assert ring.copies == 2
    step.close()


def test_a_result_the_caller_drops_is_freed_at_once_from_the_first_call_on():
    """No call leaves a reference cycle behind: a frame kept until the next garbage collection holds
    its callers' locals (the capture call's result, its buffers)."""
    _, (m_g, o_g) = gpt_pair()
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g)
    gc.disable()
    try:
        for i, (x, y) in enumerate(batches(6)):
            result = weakref.ref(step(x, y))
            assert result() is None, (
                f"call {i} ({step.stats}): its result outlives the caller's last reference"
            )
    finally:
        gc.enable()
    assert step.stats.captures == 1
    step.close()


def test_failed_capture_leaves_everything_usable():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(10)
    sync = {"on": False}

    def step_fn(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m_g(x, y)
        loss.backward()
        if sync["on"]:
            print(loss.item())  # a host sync: capture must fail here
        torch.nn.utils.clip_grad_norm_(m_g.parameters(), 1.0)
        o_g.step()
        o_g.zero_grad()
        return loss

    with deterministic():
        eager = run(train_step(m_e, o_e), data[:3] + data[4:])  # the failing call takes no step
        step = graphstep.capture(step_fn, model=m_g, optimizer=o_g)
        graphed = run(step, data[:3])
        before = [p.detach().clone() for p in m_g.parameters()]
        state_before = {k: v.clone() for k, v in o_g.state[next(iter(m_g.parameters()))].items()}
        sync["on"] = True
        with pytest.raises(HostSyncError) as info:
            step(*data[3])
        message = str(info.value)
        assert "print(loss.item())" in message and "Nothing was lost" in message, message
        assert info.value.__cause__ is not None
        assert all(p.grad is None for p in m_g.parameters()), "capture left fresh grads attached"
        assert all(torch.equal(a, b) for a, b in zip(before, m_g.parameters()))
        state_after = o_g.state[next(iter(m_g.parameters()))]
        assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)
        torch.ones(4, device="cuda").sum().item()  # the stream is usable again
        sync["on"] = False
        graphed += run(step, data[4:])
    assert step.stats.captures == 1 and step.stats.replays == len(data) - 4
    assert_same_losses(eager, graphed)
    assert_same_params(m_e, m_g)
    step.close()


def test_close_gives_the_pool_memory_back():
    (_, _), (model, opt) = gpt_pair()
    data = batches(8, batch_size=16)
    fn = train_step(model, opt)
    fn(*data[0])  # optimizer state now exists outside the step's pool
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    step = graphstep.capture(fn, model=model, optimizer=opt)
    run(step, data)
    assert step.stats.graphs_alive == 1
    held, pool = step.stats.pool_bytes, step._ctx.backend.pool
    assert held > 0
    step.close()
    del step
    gc.collect()
    torch.cuda.empty_cache()
    left = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool]
    assert not left, f"the pool still holds {sum(s['total_size'] for s in left)} bytes after close"
    # What may stay is what PyTorch caches per stream for good: the cuBLAS and cuBLASLt
    # workspaces of the capture stream (CUBLAS_WORKSPACE_CONFIG=:4096:8 -> 32 MiB each).
    allowance = 2 * 32 * 2**20 + 2 * 2**20
    after = torch.cuda.memory_reserved()
    assert after <= baseline + allowance, (
        f"reserved {baseline} before, {after} after close (pool held {held})"
    )


def test_stats_count_every_call_once():
    (_, _), (model, opt) = gpt_pair(SMALL)
    step = graphstep.capture(train_step(model, opt), model=model, optimizer=opt)
    run(step, batches(7))
    s = step.stats
    assert s.warmup_calls + s.replays == 7 and s.captures == 1
    assert s.capture_s > 0 and s.warmup_s > 0 and s.replay_s > 0
    step.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_priming_makes_every_workspace_a_step_on_its_stream_needs(dtype):
    """After `_prime_library_workspaces` on a fresh stream, a linear layer's forward and backward there
    (cuBLAS on this thread and on autograd's, cuBLASLt for the bias) keeps nothing more allocated: had a
    workspace been left to the step, a warm-up would make it inside the pool, for good. And no warning
    (autograd's thread asked for its handle before it had a CUDA context: torch warns then)."""
    import warnings

    from graphstep.backends.cuda import _prime_library_workspaces

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        pytest.skip("this torch cannot drop cuBLAS's workspaces: a stream may have its own already")
    stream, device = torch.cuda.Stream(), torch.device("cuda", torch.cuda.current_device())
    gc.collect()  # no graph of an earlier test left to use a workspace dropped here
    torch.cuda.synchronize()
    clear()
    before = torch.cuda.memory_allocated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _prime_library_workspaces(device, stream)
    primed = torch.cuda.memory_allocated()
    assert not caught, [str(w.message) for w in caught]
    assert primed - before >= 2 * 4096 * 8 * 1024, "two cuBLAS workspaces (CUBLAS_WORKSPACE_CONFIG=:4096:8)"
    with torch.cuda.stream(stream):
        x = torch.randn(64, 32, device=device, dtype=dtype, requires_grad=True)
        layer = torch.nn.Linear(32, 16, device=device, dtype=dtype)
        layer(x).sum().backward()
        del x, layer
    stream.synchronize()
    assert torch.cuda.memory_allocated() == primed, "the step made a workspace of its own"
