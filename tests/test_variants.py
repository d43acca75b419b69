"""Graph variants on the CPU recording backend: values that change back and forth (train/eval,
frozen layers, a module attribute) get a graph each, captured once, every call equal to eager;
and `verify_against="capture"` catches a baked value that no guard watches."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import graphstep
from cpu_common import TinyNet, batches, same_params

STEPS = 30


def make_step(model, opt):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


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
    def change(i, m):
        m.drop.p = [0.1, 0.2, 0.3][i % 3]

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


CHURNING = {"scale": 1.0, "step": 0}


def captured_scaled(scaled):
    """A recording-backend step whose loss goes through `scaled` (which reads the value under test)."""
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = scaled(torch.nn.functional.mse_loss(model(x), y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return graphstep.capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="recording"))


def test_a_value_that_changes_every_call_and_costs_a_capture_every_call_is_named_once(caplog):
    """The loop keeps a counter in a dict the step reads: every call captures another variant and
    none replays. Results stay right, so nothing else would say it: one warning names the entry."""
    captured = captured_scaled(lambda loss: loss * CHURNING["scale"])
    data = batches(12)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(data):
            CHURNING["step"] = i
            captured(x, y)
    said = [r.message for r in caplog.records if "each call captured another variant" in r.message]
    assert len(said) == 1, said
    assert "global 'CHURNING'" in said[0] and "['step']" in said[0] and "['scale']" not in said[0], said[0]
    assert captured.stats.replays == 0 and captured.stats.variants == len(data) - 4, captured.stats
    captured.close()


def test_flipping_between_two_values_reuses_variants_and_is_not_named(caplog):
    flags = {"scale": 1.0}
    captured = captured_scaled(lambda loss: loss * flags["scale"])
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(batches(16)):
            flags["scale"] = 1.0 if i % 2 else 0.5
            captured(x, y)
    assert not [r for r in caplog.records if "each call captured another variant" in r.message]
    assert captured.stats.variant_switches > 0
    captured.close()


def test_the_variant_churn_counts_a_capturing_call_s_own_replay_as_no_reuse(caplog):
    """On CUDA the call that captures replays once to take its step: that replay must not end a run
    of variants captured call after call; a replay of a graph in between does."""
    from graphstep.diagnostics import VariantChurn

    churn = VariantChurn("step", max_graphs=8)
    change = ("global 'CFG' in train.py, at ['step']: 1 -> 2",)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for replays in range(VariantChurn.CALLS - 1):  # each capture's own replay: replays + 1
            churn.captured(change, replays, own_replay=True)
        churn.captured(change, VariantChurn.CALLS + 5, own_replay=True)  # graphs were replayed between
        assert not caplog.records
        for replays in range(VariantChurn.CALLS + 6, 2 * VariantChurn.CALLS + 5):
            churn.captured(change, replays, own_replay=True)
    assert len(caplog.records) == 1 and "at ['step']" in caplog.records[0].message
