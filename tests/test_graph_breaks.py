"""Graph breaks on the CPU recording backend (it refuses host syncs as a CUDA capture does): a piece
of the forward pass runs eagerly between graphs, its backward eagerly between the backward graphs,
and training stays bitwise equal to eager: gradients, dropout inside and around, accumulation, a
failed capture put back. The GPU tests (tests/gpu/test_graph_breaks_gpu.py) prove it on real graphs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import graphstep
from break_models import MoENet
from cpu_common import plain_step
from graphstep.backends import autograd_segments
from graphstep.errors import CaptureError, GraphStepError, HostSyncError


def recording(**options) -> graphstep.Config:
    return graphstep.Config(backend="recording", warmup_steps=2, optimizer_mode="graph", **options)


def twins(make=MoENet):
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    return (model, opt(model)), (twin, opt(twin))


def moe_step(model, opt, *, micro=1):
    def step(x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = torch.nn.functional.mse_loss(model(xs), ys) / micro
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return total

    return step


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 1, generator=g)) for _ in range(n)]


def compare(eager, step, batches, models):
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        got = step(x, y)
        assert torch.equal(want, got), f"step {i}: {got} != eager {want}"
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


def parts(step):
    (life,) = step._lives.values()
    return [type(s).__name__ for s in life.current.recording.segments]


def test_a_marked_module_runs_forward_and_backward_eagerly_between_graphs():
    (m_e, o_e), (m_g, o_g) = twins()
    for block in m_g.blocks:
        graphstep.eager_segment(block.experts)
    step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    compare(moe_step(m_e, o_e), step, data(8), (m_e, m_g))
    # forward of each layer in order, then their backwards in reverse order, in the graphs' gaps
    assert parts(step) == ["ForwardSegment", "ForwardSegment", "BackwardSegment", "BackwardSegment"]
    assert step.stats.captures == 1 and step.stats.graph_breaks == 0


def test_a_capture_stopped_inside_a_module_breaks_there_and_trains_bitwise(caplog):
    (m_e, o_e), (m_g, o_g) = twins()
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
        compare(moe_step(m_e, o_e), step, data(8), (m_e, m_g))
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1
    assert step.stats.warmup_calls == 3  # the failed capture's call was one more warm-up, nothing lost
    made = [r.message for r in caplog.records if "graph break:" in r.message]
    assert len(made) == 1 and "model.blocks.0.experts" in made[0] and "torch.where(top == e)" in made[0]
    cost = [r.message for r in caplog.records if "captured with a graph break" in r.message]
    assert len(cost) == 1 and "ms of host time per call" in cost[0]
    step.close()  # the marks come off with the step
    assert not any(autograd_segments.is_marked(b.experts) for b in m_g.blocks)


def test_gradient_accumulation_over_micro_batches_crosses_each_segment_twice():
    (m_e, o_e), (m_g, o_g) = twins()
    step = graphstep.capture(moe_step(m_g, o_g, micro=2), model=m_g, optimizer=o_g, config=recording())
    compare(moe_step(m_e, o_e, micro=2), step, data(7), (m_e, m_g))
    assert parts(step).count("BackwardSegment") == 4


def test_breaks_off_refuses_with_the_line_as_before():
    (_, _), (m_g, o_g) = twins()
    step = graphstep.capture(
        moe_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording(graph_breaks="off")
    )
    before = copy.deepcopy(m_g.state_dict())
    batches = data(3)
    step(*batches[0])
    step(*batches[1])
    after_warmup = copy.deepcopy(m_g.state_dict())
    with pytest.raises(HostSyncError, match=r"torch\.where"):
        step(*batches[2])
    assert all(torch.equal(after_warmup[k], v) for k, v in m_g.state_dict().items())  # nothing lost
    assert not all(torch.equal(before[k], v) for k, v in m_g.state_dict().items())


def test_a_sync_in_the_step_function_itself_cannot_be_broken_out():
    (_, _), (m_g, o_g) = twins()

    def step_fn(x, y):
        loss = torch.nn.functional.mse_loss(m_g.out(m_g.inp(x)), y)
        if loss > 100:  # a branch on a tensor, outside any module
            loss = loss * 0
        loss.backward()
        o_g.step()
        o_g.zero_grad()
        return loss

    step = graphstep.capture(step_fn, model=m_g, optimizer=o_g, config=recording())
    batches = data(3)
    with pytest.raises(HostSyncError, match="loss > 100"):
        for x, y in batches:
            step(x, y)
    assert step.stats.graph_breaks == 0


class Gated(torch.nn.Module):
    """A segment whose parameters take part only where the data says so: with gradients set to None,
    a replay cannot follow a call where one of them gets no gradient."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if bool(x.sum() > 0) else self.b(x)


class GatedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.gate = Gated()

    def forward(self, x):
        return self.gate(self.inp(x)).sum()


def test_a_parameter_that_stops_taking_part_raises_rather_than_guess():
    torch.manual_seed(0)
    model = GatedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = graphstep.capture(step_fn, model=model, optimizer=opt, config=recording())
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(4))
        model.inp.bias.zero_()
    for _ in range(4):
        step(torch.ones(1, 4))  # warm-ups, the break, the capture: always `a`
    with pytest.raises(GraphStepError, match="set_to_none=False"):
        step(-torch.ones(1, 4))  # `b` now: its gradient has no place in the graph after the segment


def test_a_double_backward_through_a_segment_is_refused_at_capture():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    graphstep.eager_segment(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x):
        x = x.requires_grad_()
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        return g.detach()

    step = graphstep.capture(step_fn, model=model, optimizer=opt, config=recording())
    with pytest.raises(CaptureError, match="double backward"):
        for _ in range(3):
            step(torch.randn(2, 4))


def test_checkpointing_around_a_segment_is_refused_at_capture():
    (_, _), (m_g, o_g) = twins()
    graphstep.eager_segment(m_g.blocks[0].experts)

    def step_fn(x, y):
        h = torch.utils.checkpoint.checkpoint(m_g.blocks[0], x, use_reentrant=False)
        loss = torch.nn.functional.mse_loss(m_g.out(h), y)
        loss.backward()
        o_g.step()
        o_g.zero_grad()
        return loss

    step = graphstep.capture(step_fn, model=m_g, optimizer=o_g, config=recording())
    with pytest.raises(CaptureError, match="checkpoint"):
        for x, y in data(3):
            step(x, y)


def test_checkpointing_inside_a_segment_is_its_own_business():
    class Inner(torch.nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

        def forward(self, x, top, w):
            return torch.utils.checkpoint.checkpoint(self.experts, x, top, w, use_reentrant=False)

    (m_e, o_e), (m_g, o_g) = twins()
    for m in (m_e, m_g):
        for block in m.blocks:
            block.experts = Inner(block.experts)
    for block in m_g.blocks:  # the checkpointed module inside it: an automatic break would pick that one
        graphstep.eager_segment(block.experts)
    step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    compare(moe_step(m_e, o_e), step, data(7), (m_e, m_g))
    assert step.stats.graph_breaks == 0 and step.stats.captures == 1


def test_a_segment_that_uses_a_tensor_with_history_it_was_not_given_is_refused():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    kept = {}

    @graphstep.eager_segment
    def uses_kept(x):
        return x * kept["h"]

    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step_fn(x):
        kept["h"] = lin(x)
        loss = uses_kept(lin(x)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = graphstep.capture(step_fn, model=lin, optimizer=opt, config=recording())
    with pytest.raises(CaptureError, match="not one of its arguments"):
        step(torch.randn(2, 4))


def test_a_function_segment_with_dropout_inside_keeps_the_generator_in_eager_order():
    (m_e, o_e), (m_g, o_g) = twins()

    def head(h):
        return torch.nn.functional.dropout(h, 0.5) * 2

    segment = graphstep.eager_segment(head)

    def make(model, opt, fn):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model.out(fn(model.drop(model.inp(x)))), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    step = graphstep.capture(make(m_g, o_g, segment), model=m_g, optimizer=o_g, config=recording())
    compare(make(m_e, o_e, head), step, data(7), (m_e, m_g))
    assert parts(step) == ["ForwardSegment", "BackwardSegment"]


def test_explain_names_the_break_a_capture_will_make_and_the_ones_made():
    (_, _), (m_g, o_g) = twins()
    step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    x, y = data(1)[0]
    before = graphstep.explain(step, x, y)
    assert any("model.blocks.0.experts" in b and "will be made" in b for b in before.graph_breaks), before
    assert "graph breaks" in str(before)
    for x, y in data(4):
        step(x, y)
    after = graphstep.explain(step, x, y)
    assert any("made when a capture stopped at" in b and "torch.where" in b for b in after.graph_breaks), (
        after
    )


def test_batchnorm_with_a_cumulative_average_becomes_a_break_and_trains_bitwise():
    def make():
        return torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=None), torch.nn.Linear(8, 1)
        )

    (m_e, o_e), (m_g, o_g) = twins(make)
    step = graphstep.capture(plain_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(6)]
    compare(plain_step(m_e, o_e), step, batches, (m_e, m_g))
    assert step.stats.graph_breaks == 1
    assert torch.equal(m_e[1].running_mean, m_g[1].running_mean)
    assert m_e[1].num_batches_tracked == m_g[1].num_batches_tracked == 6


def test_a_torchmetrics_update_with_its_checks_and_counters_runs_as_a_break():
    torchmetrics = pytest.importorskip("torchmetrics")
    (m_e, o_e), (m_g, o_g) = twins(
        lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    )
    metrics = [
        torchmetrics.classification.MulticlassAccuracy(num_classes=4, validate_args=True) for _ in range(2)
    ]

    def make(model, opt, metric):
        def step(x, labels):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            metric(logits.detach(), labels)  # its checks read the host; it counts its updates in Python
            return loss

        return step

    step = graphstep.capture(make(m_g, o_g, metrics[1]), model=m_g, optimizer=o_g, config=recording())
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
    for x, y in batches:
        assert torch.equal(make(m_e, o_e, metrics[0])(x, y), step(x, y))
    assert torch.equal(metrics[0].compute(), metrics[1].compute())
    assert metrics[0]._update_count == metrics[1]._update_count == 6
    assert step.stats.graph_breaks >= 1 and step.stats.captures == 1, step.stats


def test_a_known_function_break_another_rank_made_is_patched_where_the_model_looks_it_up(monkeypatch):
    """With ranks, a break at a known function may come from another rank's capture (no frame here): it is
    routed through a segment in its own module and in every module of the model's classes that imported
    it by name; closing the step puts both back."""
    import sys
    import types

    import torch.nn.functional as F

    from graphstep.backends.graph_breaks import GraphBreaks

    original = F.ctc_loss
    caller = types.ModuleType("graphstep_test_caller")
    caller.ctc_loss = original  # `from torch.nn.functional import ctc_loss` in a model's module
    monkeypatch.setitem(sys.modules, caller.__name__, caller)
    Head = type("Head", (torch.nn.Module,), {"__module__": caller.__name__})
    breaks = GraphBreaks("step", "auto", lambda: [("model", Head())], None)
    try:
        assert breaks.make_named("function", "torch.nn.functional.ctc_loss", "rank 1's line", "a host sync")
        assert not breaks.make_named("function", "torch.nn.functional.ctc_loss", "again", "a host sync")
        assert F.ctc_loss is not original and caller.ctc_loss is F.ctc_loss
        assert breaks.made[0].segments == ["torch.nn.functional.ctc_loss"]
    finally:
        breaks.close()
    assert F.ctc_loss is original and caller.ctc_loss is original
