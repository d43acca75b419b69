"""Eager segments and optimizer modes, on the CPU recording backend (it bakes Python numbers
as a real CUDA graph does): graphs before and after a segment, the segment run eagerly
between them on every replay, equal to eager."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

import graphstep
from cpu_common import TinyNet, batches, same_params
from graphstep.errors import GraphStepError

STEPS = 30


def recording(**options) -> graphstep.Config:
    return graphstep.Config(backend="recording", warmup_steps=2, **options)


def train_step(model, opt, *, between=None):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if between is not None:
            between(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def twins(make_opt, make_sched=None):
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    opts = make_opt(model), make_opt(twin)
    scheds = [make_sched(o) if make_sched else None for o in opts]
    return (model, opts[0], scheds[0]), (twin, opts[1], scheds[1])


def run_pair(pair, config, *, steps=STEPS, wrap=None):
    """Train the eager twin and the captured twin side by side; return the captured step."""
    (m_e, o_e, s_e), (m_g, o_g, s_g) = pair
    eager = train_step(m_e, o_e)
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    for i, (x, y) in enumerate(batches(steps)):
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        got = step(x, y)
        assert torch.equal(want, got), f"step {i}: loss {got} != eager {want}"
        for s in (s_e, s_g):
            if s is not None:
                s.step()
    assert same_params(m_e, m_g)
    return step


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 5)


def test_an_eager_optimizer_follows_every_schedule_with_one_capture():
    step = run_pair(twins(sgd, one_cycle), recording(optimizer_mode="eager"))
    assert step.stats.captures == 1 and step.stats.replays == STEPS - 3


def test_an_eager_optimizer_keeps_its_schedulers_wrapper_of_step():
    # torch's LR schedulers wrap `opt.step` on the instance to notice it was called; routing the step
    # through a segment must put that wrapper back, or every scheduler step warns that the optimizer's
    # step was overridden and the "scheduler before optimizer" check goes blind.
    pair = twins(sgd, one_cycle)
    wrapped = pair[1][1].__dict__["step"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*overridden after learning rate scheduler.*")
        run_pair(pair, recording(optimizer_mode="eager"))
    assert pair[1][1].__dict__["step"] is wrapped


def test_auto_runs_an_optimizer_whose_scheduler_changes_a_baked_value_as_a_segment(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(sgd, one_cycle), recording())
    assert step.stats.captures == 1  # torch's schedulers mark the groups they drive
    moved = [r.message for r in caplog.records if "runs eagerly between graph replays" in r.message]
    assert len(moved) == 1 and "SGD.step()" in moved[0] and "'lr'" in moved[0]


class ByHand:
    """A schedule no scheduler object announces: a float lr assigned between calls."""

    def __init__(self, opt):
        self.opt, self.i = opt, 0

    def step(self):
        self.i += 1
        self.opt.param_groups[0]["lr"] = 0.05 / (1 + self.i // 4)


def test_auto_moves_an_optimizer_to_a_segment_at_the_first_unforeseen_change(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(sgd, ByHand), recording())
    # The first capture, then one more when lr first changed by hand: never again.
    assert step.stats.captures == 2
    moved = [r.message for r in caplog.records if "runs eagerly between graph replays" in r.message]
    assert len(moved) == 1 and "['lr']: 0.05 -> 0.025" in moved[0]


def test_graph_mode_recaptures_on_a_baked_change_and_stops_at_the_limit():
    pair = twins(sgd, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9))
    with pytest.raises(graphstep.errors.StaleGraphError, match="lr"):
        run_pair(pair, recording(optimizer_mode="graph", max_recaptures=2))


class CountingSGD(torch.optim.Optimizer):
    """A custom optimizer that keeps a Python step counter and changes its update (and its
    state's layout) at step 5: a graph would freeze the counter."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] >= 5:
                    buf = state.setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.5).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])
                else:
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_custom_optimizer_with_python_state_runs_as_a_segment_from_the_start(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(lambda m: CountingSGD(m.parameters())), recording())
    assert step.stats.captures == 1
    # The log says why, and claims no hyperparameter changed: none did.
    (message,) = [r.message for r in caplog.records if "runs eagerly between graph replays" in r.message]
    assert "changes Python values" in message and "state[param 0]['n']" in message, message
    assert "hyperparameter" not in message and "changed" not in message, message


def test_a_segment_for_a_changed_hyperparameter_names_the_key_and_only_its_own_changes(caplog):
    pair = twins(sgd, ByHand)
    model = pair[1][0]
    (m_e, o_e, s_e), (m_g, o_g, s_g) = pair
    eager = train_step(m_e, o_e)
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(batches(8)):
            if i == 4:  # a change beside lr's in the same call: not the optimizer's
                for m in (m_e, m_g):
                    m.drop.p = 0.2
            torch.manual_seed(i)
            want = eager(x, y)
            torch.manual_seed(i)
            assert torch.equal(want, step(x, y)), i
            s_e.step()
            s_g.step()
    assert same_params(m_e, model)
    (message,) = [r.message for r in caplog.records if "runs eagerly between graph replays" in r.message]
    assert "Why: 'lr' changed, which its step reads as a Python number" in message, message
    assert "['lr']: 0.05 -> 0.025" in message and "no re-capture will be needed" in message, message
    assert "drop" not in message, "another module's change is not the optimizer's"


class Lion(torch.optim.Optimizer):
    """A Lion-like update written in the test: graphstep does not know it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                update = (m * beta1 + p.grad * (1 - beta1)).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def test_a_custom_optimizer_with_a_schedule_runs_as_a_segment():
    cosine = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)  # noqa: E731
    step = run_pair(twins(lambda m: Lion(m.parameters()), cosine), recording())
    assert step.stats.captures == 1


def test_a_custom_optimizer_with_fixed_hyperparameters_stays_in_the_graph(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(lambda m: Lion(m.parameters())), recording())
    assert step.stats.captures == 1 and "runs eagerly" not in caplog.text


def test_a_user_segment_may_read_the_host_and_hand_tensors_on():
    seen = []

    @graphstep.eager_segment
    def scale_from_host(loss):
        value = loss.item()  # a host sync: fine in an eager segment
        seen.append(value)
        return torch.tensor(0.5 if value > 1.0 else 1.0)

    def make(model, opt):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss * scale_from_host(loss.detach())).backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    (m_e, o_e, _), (m_g, o_g, _) = twins(sgd)
    eager = make(m_e, o_e)
    step = graphstep.capture(make(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    for i, (x, y) in enumerate(batches(12)):
        torch.manual_seed(i)  # the same dropout masks
        want = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(want, step(x, y)), f"step {i}"
    assert same_params(m_e, m_g)
    assert step.stats.captures == 1 and step.stats.replays == 9
    assert len(seen) == 24  # every call ran the segment: eager twin 12, captured 12


def test_a_segment_returning_a_python_number_is_refused_with_a_reason():
    @graphstep.eager_segment
    def host_value(loss):
        return loss.item()

    model = TinyNet()

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss * host_value(loss)

    captured = graphstep.capture(step, model=model, config=recording())
    with pytest.raises(GraphStepError, match="returns a float"):
        captured(*batches(1)[0])


def test_a_segment_whose_result_changes_shape_at_replay_is_an_error():
    sizes = iter([3, 3, 3, 4])

    @graphstep.eager_segment
    def varying():
        return torch.ones(next(sizes))

    def step(x):
        return x.sum() + varying().sum()

    captured = graphstep.capture(step, config=recording())
    x = torch.ones(2)
    for _ in range(3):
        captured(x)
    with pytest.raises(GraphStepError, match="returned"):
        captured(x)


def test_a_library_that_syncs_only_when_not_capturing_is_captured():
    """Like transformers' mask checks: a host sync skipped while a CUDA stream captures."""
    model = TinyNet()
    opt = sgd(model)

    def capturing():
        try:
            return torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build of torch outside graphstep's recording capture
            return False

    def library_check(x):
        if not capturing():
            assert bool((x == x).all())  # a host sync, skipped under capture

    def step(x, y):
        library_check(x)
        return train_step(model, opt)(x, y)

    captured = graphstep.capture(step, model=model, optimizer=opt, config=recording())
    for x, y in batches(6):
        captured(x, y)
    assert captured.stats.captures == 1 and captured.stats.replays == 3


def test_grads_a_step_leaves_behind_are_there_after_every_replay():
    """The step does forward and backward; the optimizer step and zero_grad(set_to_none) run
    outside it. Every replay must hand the optimizer its grads, as eager does."""
    (m_e, o_e, _), (m_g, o_g, _) = twins(sgd)

    def make(model):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        return step

    eager, step = make(m_e), graphstep.capture(make(m_g), model=m_g, optimizer=o_g, config=recording())
    for i, (x, y) in enumerate(batches(10)):
        for fn, opt in ((eager, o_e), (step, o_g)):
            torch.manual_seed(i)
            fn(x, y)
            opt.step()
            opt.zero_grad()
    assert same_params(m_e, m_g) and step.stats.replays == 7
