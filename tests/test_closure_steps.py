"""Optimizer steps called with a closure (`opt.step(closure)`, as Lightning calls them) where the
optimizer runs as an eager segment: the closure runs in the graph, the update as the segment, and
the step returns the closure's loss. On the CPU recording backend (it bakes Python numbers as a
CUDA graph does), bitwise equal to eager, for every torch.optim optimizer whose step calls the
closure once; an optimizer that calls it again is stopped with an error that says so."""

from __future__ import annotations

import copy

import pytest
import torch

import graphstep
from cpu_common import TinyNet, batches, same_params
from graphstep.errors import CaptureError, UnsupportedOptimizerError

STEPS = 12

OPTIMIZERS = {
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-3),
}


def closure_step(model, opt):
    def step(x, y):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return loss

        return opt.step(closure)

    return step


def twins(make_opt):
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    opts = []
    for m in (model, twin):
        opt = make_opt(m.parameters())
        graphstep.optim.make_capturable(opt, "cpu")  # the settings graphstep gives the captured one
        opts.append(opt)
    return (model, opts[0]), (twin, opts[1])


def train_pair(make_opt, config, make_sched=None):
    (m_e, o_e), (m_g, o_g) = twins(make_opt)
    scheds = [make_sched(o) for o in (o_e, o_g)] if make_sched else []
    eager = closure_step(m_e, o_e)
    step = graphstep.capture(closure_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    for i, (x, y) in enumerate(batches(STEPS)):
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        got = step(x, y)
        assert torch.equal(want, got), f"step {i}: loss {got} != eager {want}"
        for s in scheds:
            s.step()
    assert same_params(m_e, m_g)
    for p, q in zip(m_e.parameters(), m_g.parameters()):  # optimizer state: buffers, moments, counts
        for key, value in o_e.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(o_g.state[q][key])), key
    return step


def recording(**options) -> graphstep.Config:
    return graphstep.Config(backend="recording", warmup_steps=2, **options)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_segment_step_with_a_closure_equals_eager(name):
    step = train_pair(OPTIMIZERS[name], recording(optimizer_mode="eager"))
    s = step.stats
    assert (s.warmup_calls, s.captures, s.replays) == (2, 1, STEPS - 3), s
    (life,) = step._lives.values()
    assert len(life.current.recording.segments) == 1  # the update only: the closure is in the graph


def test_sgd_with_one_cycle_moves_to_a_segment_and_keeps_its_closure():
    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)

    step = train_pair(OPTIMIZERS["SGD-nesterov"], recording(), one_cycle)
    assert step.stats.captures == 1


class TwiceSGD(torch.optim.SGD):
    """Evaluates the loss twice per step, as a line search or SAM does."""

    def step(self, closure=None):
        closure()
        return super().step(closure)


def test_an_optimizer_that_calls_its_closure_twice_is_refused_at_capture_saying_so():
    cosine = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)  # noqa: E731
    with pytest.raises(CaptureError, match=r"TwiceSGD.step called its closure a second time.*once"):
        train_pair(lambda p: TwiceSGD(p, lr=0.05, momentum=0.9), recording(), cosine)


def test_an_optimizer_that_calls_its_closure_twice_stops_at_the_first_eager_segment():
    with pytest.raises(CaptureError, match=r"called its closure 2 times in one step"):
        train_pair(lambda p: TwiceSGD(p, lr=0.05), recording(optimizer_mode="eager"))


def test_lbfgs_is_refused_saying_it_calls_the_closure_several_times():
    model = TinyNet()
    opt = torch.optim.LBFGS(model.parameters())
    step = graphstep.capture(closure_step(model, opt), model=model, optimizer=opt, config=recording())
    x, y = batches(1)[0]
    with pytest.raises(UnsupportedOptimizerError, match="calls a closure several times"):
        step(x, y)


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_a_fused_optimizer_stepped_by_grad_scaler_gets_its_scale_at_every_replay(name):
    """GradScaler.step sets `grad_scale` and `found_inf` on a fused optimizer for the one step() call;
    the segment that replays the update must set them again, or replays would not unscale."""

    def make_opt(params):
        cls = getattr(torch.optim, name)
        return (
            cls(params, lr=1e-2, momentum=0.9, fused=True)
            if name == "SGD"
            else cls(params, lr=1e-2, fused=True)
        )

    (m_e, o_e), (m_g, o_g) = twins(make_opt)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]

    def scaled_step(model, opt, scaler):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        return step

    eager = scaled_step(m_e, o_e, scalers[0])
    step = graphstep.capture(
        scaled_step(m_g, o_g, scalers[1]), model=m_g, optimizer=o_g, config=recording(optimizer_mode="eager")
    )
    for i, (x, y) in enumerate(batches(STEPS)):
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(want, step(x, y)), f"step {i}"
    assert same_params(m_e, m_g) and step.stats.replays == STEPS - 3
    assert not any(hasattr(o_g, key) for key in ("grad_scale", "found_inf"))  # gone after each step
