"""Graph variants on the CPU recording backend: values that change back and forth (train/eval,
frozen layers, a module attribute) get a graph each, captured once, every call equal to eager;
and `verify_against="capture"` catches a baked value that no guard watches."""

from __future__ import annotations

import copy

import pytest
import torch

import graphstep
from cpu_common import TinyNet, batches, same_params
from cpu_common import plain_step as make_step

STEPS = 30


def side_by_side(change, *, config=None, steps=STEPS):
    """Apply `change(i, model)` to both twins before call i; every call equal to eager."""
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    eager = make_step(model, opts[0])
    config = config or graphstep.Config(backend="recording", warmup_steps=2)
    step = graphstep.capture(make_step(twin, opts[1]), model=twin, optimizer=opts[1], config=config)
    for i, (x, y) in enumerate(batches(steps)):
        for m in (model, twin):
            change(i, m)
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        got = step(x, y)
        assert torch.equal(want, got), f"call {i}: {got} != eager {want}"
    assert same_params(model, twin)
    return step


def test_flipping_train_and_eval_every_call_captures_each_mode_once():
    step = side_by_side(lambda i, m: m.train(i % 2 == 0))
    s = step.stats
    assert s.captures == 2 and s.variants == 1 and s.graphs_alive == 2
    assert s.variant_switches >= STEPS - 6


def test_freezing_and_unfreezing_a_layer_back_and_forth():
    step = side_by_side(lambda i, m: m.fc1.requires_grad_(i % 6 < 3))
    assert step.stats.captures == 2 and step.stats.variants == 1


def test_a_dropout_schedule_on_a_module_attribute():
    step = side_by_side(lambda i, m: setattr(m.drop, "p", 0.0 if i >= 10 else 0.5))
    assert step.stats.captures == 2


def test_variants_beyond_max_graphs_evict_the_least_recently_used():
    """Three values, each for three calls (replayed between changes: no churn, see test_churn.py)."""

    def change(i, m):
        m.drop.p = [0.1, 0.2, 0.3][i // 3 % 3]

    config = graphstep.Config(backend="recording", warmup_steps=2, max_graphs=2)
    step = side_by_side(change, config=config)
    assert step.stats.graphs_alive == 2 and step.stats.captures > 3  # evicted ones come back


def test_verify_against_a_fresh_capture_catches_a_baked_value_no_guard_sees():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = graphstep.Config(
        backend="recording", warmup_steps=1, check="off", verify_every=1, verify_against="capture"
    )
    step = graphstep.capture(make_step(model, opt), model=model, optimizer=opt, config=config)
    data = batches(4)
    model.eval()  # no dropout: replays and the fresh capture draw nothing at random
    for x, y in data[:3]:
        step(x, y)  # the fresh captures agree with the replays while nothing changes
    assert step.stats.replays == 1
    opt.param_groups[0]["lr"] = 0.5  # baked into the graph; guards are off
    with pytest.raises(graphstep.errors.VerificationError, match="reference run"):
        step(*data[3])
