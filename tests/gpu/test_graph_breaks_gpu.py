"""Graph breaks on a GPU: pieces no CUDA graph can record (token dispatch, CTC loss, a matcher on the
host) run eagerly, forward and backward, between the graphs of the rest of the step; bitwise equal to
eager in deterministic mode."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from gpu_common import deterministic, needs_cuda

import graphstep

sys.path.insert(0, str(Path(__file__).parents[1]))
from break_models import MoENet  # noqa: E402

pytestmark = needs_cuda


def twins(make, opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3)):
    """Two identical (model, optimizer) pairs; both optimizers made capturable as graphstep makes the
    captured one (lr as a device tensor), so that eager computes the same update."""
    torch.manual_seed(0)
    model = make().cuda()
    twin = copy.deepcopy(model)
    pairs = []
    for m in (model, twin):
        o = opt(m.parameters())
        graphstep.optim.make_capturable(o, "cuda")
        pairs.append((m, o))
    return pairs[0], pairs[1]


def moe_step(model, opt, *, amp=True):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def compare(eager, step, data, models, seeds=True):
    with deterministic():
        for i, batch in enumerate(data):
            torch.manual_seed(i)
            want = eager(*batch)
            torch.manual_seed(i)
            got = step(*batch)
            assert torch.equal(want, got), f"step {i}: loss {got.item()} != eager {want.item()}"
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


def moe_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, 16, generator=g).cuda(), torch.randn(8, 32, 1, generator=g).cuda()) for _ in range(n)]


def test_a_marked_moe_layer_runs_eagerly_between_graphs_and_trains_bitwise():
    (m_e, o_e), (m_g, o_g) = twins(MoENet)
    for block in m_g.blocks:
        graphstep.eager_segment(block.experts)
    step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g)
    compare(moe_step(m_e, o_e), step, moe_data(8), (m_e, m_g))
    assert step.stats.captures == 1 and step.stats.replays == 6
