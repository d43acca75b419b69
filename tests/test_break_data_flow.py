"""Graph breaks bitwise whatever the data flow around them, on the CPU recording backend: a tensor the
break uses and the step uses outside it too (a residual, a post-norm block, a parameter passed in, one
tensor passed twice, two breaks in a row, tied embedding weights). Each such tensor's gradient is a sum
of several contributions, and float addition does not associate: these tests fail where the
contributions are summed in another order than eager's (the values are chosen so that the order
shows: float32, magnitudes spread over three decades, three or more contributions per gradient)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphstep
from break_models import SharedNet, SharedWeightNet, TiedLM

STEPS = 6


def recording() -> graphstep.Config:
    return graphstep.Config(backend="recording", warmup_steps=2, optimizer_mode="graph")


def make_step(model, opt, loss_fn, amp=None):
    def step(x, y):
        with torch.autocast(
            "cpu", dtype=torch.bfloat16, enabled=amp is not None, cache_enabled=amp != "nocache"
        ):
            loss = loss_fn(model(x), y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        return loss, grads

    return step


def train(make, batches, loss_fn, *, marked, amp=None):
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    o_e = torch.optim.SGD(twin.parameters(), lr=1e-3, momentum=0.9)
    o_g = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for name in marked:
        graphstep.eager_segment(model.get_submodule(name))
    eager = make_step(twin, o_e, loss_fn, amp)
    step = graphstep.capture(
        make_step(model, o_g, loss_fn, amp), model=model, optimizer=o_g, config=recording()
    )
    for i, (x, y) in enumerate(batches):
        (want, want_grads), (got, got_grads) = eager(x, y), step(x, y)
        assert torch.equal(want, got), f"step {i}: loss {got} != eager {want}"
        assert want_grads.keys() == got_grads.keys()
        for name, a in want_grads.items():  # the sums themselves, before the optimizer rounds them away
            b = got_grads[name]
            assert torch.equal(a, b), f"step {i}: the gradient of {name} differs by {(a - b).abs().max()}"
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs by {(p - q).abs().max()}"
    assert step.stats.captures == 1, step.stats
    return step


def token_batches(n=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1, 12)  # magnitudes over three decades: sums that depend on their order
    return [(torch.randn(16, 12, generator=g) * spread, torch.randn(16, 1, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("breaks", ["auto", "marked"])
@pytest.mark.parametrize("kind", ["residual", "postnorm", "twice", "param", "passed", "chain", "reuse"])
def test_a_break_whose_input_is_used_outside_it_trains_bitwise(kind, breaks):
    make = lambda: SharedNet(kind, sync=breaks == "auto")  # noqa: E731
    marked = [] if breaks == "auto" else [f"mix.{i}" for i in range(2)] + ["scaled"]
    if kind == "chain" and breaks == "marked":
        marked += [f"mix2.{i}" for i in range(2)]
    step = train(make, token_batches(), torch.nn.functional.mse_loss, marked=marked)
    assert step.stats.graph_breaks == (1 if breaks == "auto" else 0), step.stats


@pytest.mark.parametrize("breaks", ["auto", "marked"])
@pytest.mark.parametrize("kind", ["residual", "postnorm", "chain", "param"])
def test_under_autocast_a_break_whose_float32_input_is_used_outside_it_trains_bitwise(kind, breaks):
    """bf16 autocast on the CPU, the break's input a float32 activation (a float32 residual stream, a
    norm's result, as CUDA's autocast makes it): eagerly each Linear inside casts it anew, and each
    cast's gradient comes back in float32 and is added on its own. Autocast caches its cast of a leaf
    that requires grad, so a segment that got its input as such a leaf shared one cast among the uses
    and summed their gradients in bf16 first."""
    make = lambda: SharedNet(kind, sync=breaks == "auto", stream32=True)  # noqa: E731
    marked = [] if breaks == "auto" else [f"mix.{i}" for i in range(2)]
    if kind == "chain" and breaks == "marked":
        marked += [f"mix2.{i}" for i in range(2)]
    # four calls: an automatic break captures at the fourth (the capture gives the sums that differ)
    step = train(make, token_batches(4), torch.nn.functional.mse_loss, marked=marked, amp="cache")
    assert step.stats.graph_breaks == (1 if breaks == "auto" else 0), step.stats


@pytest.mark.parametrize("amp", [None, "cache"])
@pytest.mark.parametrize("breaks", ["auto", "marked"])
def test_tied_weights_used_inside_a_break_and_by_the_head_train_bitwise(breaks, amp):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 24, (16,), generator=g), torch.randint(0, 24, (16,), generator=g))]
    batches = batches * (STEPS if amp is None else 4)  # the same tokens: many contributions per row
    step = train(
        TiedLM,
        batches,
        torch.nn.functional.cross_entropy,
        marked=[] if breaks == "auto" else ["embed"],
        amp=amp,
    )
    assert step.stats.graph_breaks == (1 if breaks == "auto" else 0), step.stats


def test_a_partial_backward_through_a_break_whose_input_is_used_after_it_is_refused_naming_it():
    """torch.autograd.grad computes some gradients only: graphstep does not take later users'
    contributions out of a sum it cannot see whole, and says which tensor and what to do."""
    torch.manual_seed(0)
    model = SharedNet("residual", sync=False)
    for mix in model.mix:
        graphstep.eager_segment(mix)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    params = list(model.parameters())

    def step_fn(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
            p.grad = g
        opt.step()
        opt.zero_grad()
        return loss

    entry = torch.autograd._engine_run_backward
    step = graphstep.capture(step_fn, model=model, optimizer=opt, config=recording())
    with pytest.raises(
        graphstep.errors.CaptureError, match=r"argument 0 \(torch.float32\[16, 12\]\).*backward\(\)"
    ):
        for x, y in token_batches(3):
            step(x, y)
    assert torch.autograd._engine_run_backward is entry  # autograd's entry as it was


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_weight_cast_by_autocast_inside_a_break_and_outside_it(where):
    """Under autocast with its cache (the default) both uses of the weight share one cached cast
    eagerly, which a segment cannot: refused, naming the parameter and the way out. With the cache
    off each use casts anew, and the gradient sums in eager's order."""
    make = lambda: SharedWeightNet(where)  # noqa: E731
    mse = torch.nn.functional.mse_loss
    with pytest.raises(
        graphstep.errors.CaptureError, match=r"parameter of shape \[12, 12\].*cache_enabled=False"
    ):
        train(make, token_batches(), mse, marked=[], amp="cache")
    step = train(make, token_batches(), mse, marked=[], amp="nocache")
    assert step.stats.graph_breaks == 1


def test_a_backward_that_starts_from_a_breaks_input_is_refused_naming_it():
    """Autograd adds a root's gradient first, before the segment's own: refused rather than reordered."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 12)
    opt = torch.optim.SGD(lin.parameters(), lr=1e-3)

    @graphstep.eager_segment
    def seg(h):
        return h * h.sin()

    def step_fn(x, y):
        h = lin(x)
        loss = torch.nn.functional.mse_loss(seg(h).sum(-1, keepdim=True), y)
        torch.autograd.backward([loss, h], [None, torch.full_like(h, 1e-3)])
        opt.step()
        opt.zero_grad()
        return loss

    step = graphstep.capture(step_fn, model=lin, optimizer=opt, config=recording())
    with pytest.raises(
        graphstep.errors.CaptureError, match=r"starts from its argument 0 .*Start the backward"
    ):
        for x, y in token_batches(3):
            step(x, y)


def test_a_backward_that_bypasses_torch_autograd_is_refused_at_a_segment():
    """graphstep finds later users when torch.autograd's entry starts a backward; one started in the
    engine directly could not be seen, so the segment refuses rather than guess."""
    torch.manual_seed(0)
    model = SharedNet("residual", sync=False)
    for mix in model.mix:
        graphstep.eager_segment(mix)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = torch.autograd.Variable._execution_engine

    def step_fn(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
        opt.step()
        opt.zero_grad()
        return loss

    step = graphstep.capture(step_fn, model=model, optimizer=opt, config=recording())
    with pytest.raises(graphstep.errors.CaptureError, match=r"did not start through torch.autograd"):
        for x, y in token_batches(3):
            step(x, y)
