"""Eager segments on a GPU: graph parts before and after an eager optimizer step or a user's
segment, in one pool, bitwise equal to eager in deterministic mode."""

from __future__ import annotations

import torch
from gpu_common import (
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

pytestmark = needs_cuda


def test_an_optimizer_in_an_eager_segment_is_bitwise_equal_with_a_changing_schedule():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    config = graphstep.Config(optimizer_mode="eager")
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    eager = train_step(m_e, o_e)
    data = batches(20)
    with deterministic():
        losses_e, losses_g = [], []
        for i, (x, y) in enumerate(data):
            for opt in (o_e, o_g):  # betas change every call: a value no graph could keep
                opt.param_groups[0]["betas"] = (0.9 - 0.01 * (i % 5), 0.95)
                opt.param_groups[0]["weight_decay"] = 0.1 * (i % 3)
            losses_e.append(eager(x, y))
            losses_g.append(step(x, y))
    assert_same_losses(losses_e, losses_g)
    assert_same_params(m_e, m_g)
    assert step.stats.captures == 1 and step.stats.replays == 17


def test_a_user_segment_reads_the_host_between_two_graphs():
    values = []

    @graphstep.eager_segment
    def clip_factor(norm):
        values.append(norm.item())  # fine here: this runs eagerly
        return torch.clamp(1.0 / (norm + 1e-6), max=1.0)

    def make(model, opt):
        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            factor = clip_factor(norm)
            for p in model.parameters():
                p.grad.mul_(factor)
            opt.step()
            opt.zero_grad()
            return loss

        return step

    (m_e, o_e), (m_g, o_g) = gpt_pair()
    step = graphstep.capture(make(m_g, o_g), model=m_g, optimizer=o_g)
    data = batches(12)
    with deterministic():
        assert_same_losses(run(make(m_e, o_e), data), run(step, data))
    assert_same_params(m_e, m_g)
    assert step.stats.captures == 1 and len(values) == 24
