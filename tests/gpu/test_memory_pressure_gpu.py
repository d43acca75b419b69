"""Captures while the GPU is nearly full: a transformers GPT-2 step captured with a few MiB left is
bitwise equal to eager, and a capture that really runs out of memory runs that call as an eager step
and captures on the next (issue 40, item 7).

Run this file alone on its GPU (not beside other tests, nor with several xdist workers on one GPU): its tests
fill the GPU, and whatever else runs there runs out of memory."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from gpu_common import (
    assert_same_params,
    batches,
    deterministic,
    gpt_pair,
    needs_cuda,
    train_step,
    transformers_capture_path,
)

import graphstep
from graphstep.optim import make_capturable

pytestmark = needs_cuda


def fill_gpu_leaving(mib: float) -> torch.Tensor:
    """One allocation that leaves about `mib` MiB of the device free."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (graphstep's pool keeps its blocks)
    free, _ = torch.cuda.mem_get_info()
    return torch.empty(max(0, int(free - mib * 2**20)), dtype=torch.uint8, device="cuda")


def gpt2_case() -> tuple:
    """A transformers GPT-2 and its eager twin with AdamW, a step, and 10 batches with a padding mask."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=4096, n_positions=256, n_embd=256, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).cuda()
    pairs = []
    for m in (model, copy.deepcopy(model)):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
        make_capturable(opt, "cuda")
        pairs.append((m, opt))

    def make_step(m, opt):
        def step(input_ids, attention_mask):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss

        return step

    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(10):
        ids = torch.randint(cfg.vocab_size, (8, 256), generator=g)
        mask = torch.ones_like(ids)
        mask[0, 128:] = 0
        data.append((ids.cuda(), mask.cuda()))
    return pairs, make_step, data


def side_by_side(pairs: list, make_step, data: list, before_call=lambda i: None) -> graphstep.CapturedStep:
    """The eager twin's steps first (they never meet the memory the test takes), then graphstep's."""
    (m_g, o_g), (m_e, o_e) = pairs
    eager = make_step(m_e, o_e)
    step = graphstep.capture(make_step(m_g, o_g), model=m_g, optimizer=o_g)
    with deterministic(), transformers_capture_path():
        wanted = []
        for i, batch in enumerate(data):
            torch.manual_seed(i)  # GPT-2's dropout: the same masks
            wanted.append(eager(*batch).detach())
        for i, (batch, want) in enumerate(zip(data, wanted)):
            held = before_call(i)
            torch.manual_seed(i)
            got = step(*batch)
            del held
            assert torch.equal(want, got), f"call {i}: eager {want.item()!r} != graphstep {got.item()!r}"
    assert_same_params(m_e, m_g)
    return step


@pytest.mark.parametrize("left_mib", [256, 16, 4])
def test_a_gpt2_step_captured_with_the_gpu_nearly_full_equals_eager(left_mib):
    pairs, make_step, data = gpt2_case()
    # The device filled after the warm-ups, freed after the capture.
    step = side_by_side(pairs, make_step, data, lambda i: fill_gpu_leaving(left_mib) if i == 3 else None)
    s = step.stats
    assert s.graph_breaks == 0 and s.captures == 1, s
    step.close()


def test_warm_ups_and_the_capture_use_memory_the_allocator_holds_cached_as_eager_does():
    """The default pool caches nearly the whole device (a large tensor, freed): eager's allocations find
    room in that cache, and so must graphstep's warm-ups and capture, although they allocate in a pool
    of their own (there the allocator cannot hand its cache back to the driver when it runs short)."""
    pairs, make_step, data = gpt2_case()
    fill_gpu_leaving(4)  # freed at once: cached by the allocator, not given back to the driver
    step = side_by_side(pairs, make_step, data)
    s = step.stats
    assert (s.warmup_calls, s.captures, s.replays) == (3, 1, 7), s
    step.close()


def test_a_capture_that_runs_out_of_gpu_memory_steps_eagerly_and_captures_on_the_next_call(caplog):
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    captures = itertools.count()

    def too_big_while_capturing(module, inputs, output):
        if torch.cuda.is_current_stream_capturing() and next(captures) == 0:
            torch.empty(
                2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda"
            )

    m_g.blocks[0].register_forward_hook(too_big_while_capturing)
    data = batches(10)
    eager = train_step(m_e, o_e)
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g)
    with deterministic(), caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(data):
            want, got = eager(x, y), step(x, y)
            assert torch.equal(want, got), f"call {i}: eager {want.item()!r} != graphstep {got.item()!r}"
    assert_same_params(m_e, m_g)
    assert "ran out of memory while capturing" in caplog.text
    s = step.stats
    assert (s.warmup_calls, s.captures, s.replays, s.graph_breaks) == (4, 1, 6, 0), s
    step.close()


def test_after_a_capture_ran_out_of_memory_eager_allocations_still_get_the_cache_back():
    """The allocator hands its cached blocks back to the driver when an eager allocation finds no room,
    but not while a pool is marked as being captured into: a failed capture must leave none marked."""
    (m, o), _ = gpt_pair()
    captures = itertools.count()

    def too_big_while_capturing(module, inputs, output):
        if torch.cuda.is_current_stream_capturing() and next(captures) == 0:
            torch.empty(
                2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda"
            )

    m.blocks[0].register_forward_hook(too_big_while_capturing)
    step = graphstep.capture(train_step(m, o), model=m, optimizer=o)
    for x, y in batches(6):
        step(x, y)
    assert step.stats.captures == 1
    step.close()
    fill_gpu_leaving(4)  # freed at once: the allocator caches it
    small = [torch.empty(2**18, device="cuda") for _ in range(16)]  # 16 MiB of small blocks: needs the cache
    assert len(small) == 16
