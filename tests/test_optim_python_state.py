"""Optimizers whose step() changes Python values run as eager segments, whatever package they come
from; optimizers that keep every per-step value on the device stay in the graph. On the CPU
recording backend (it bakes Python numbers as a CUDA graph does), next to an eager twin, bitwise.

The optimizers are the real packages (schedule-free, pytorch-optimizer) where installed, imported
from site-packages as users do; each test skips where its package is missing."""

from __future__ import annotations

import logging

import pytest
import torch

import graphstep
from graphstep.optim import python_state
from test_segments import STEPS, recording, run_pair, train_step, twins


class GroupCounter(torch.optim.Optimizer):
    """Keeps its step count in the param group, as timm's Lamb and pytorch-optimizer do, and
    uses a Python bias correction computed from it."""

    def __init__(self, params, lr=0.05, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta, step=0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] += 1
            correction = 1 - group["beta"] ** group["step"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(m, alpha=-group["lr"] / correction)


class AttributeCounter(GroupCounter):
    """The same, with the count in an attribute of the optimizer."""

    def __init__(self, params, lr=0.05, beta=0.9):
        super().__init__(params, lr, beta)
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps_taken += 1
        for group in self.param_groups:
            group["step"] = self.steps_taken
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / self.steps_taken)


class DeviceCounter(GroupCounter):
    """The same update with the count in a device tensor: nothing in Python changes."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), device=p.device)
                    state["m"] = torch.zeros_like(p)
                state["step"].add_(1)
                state["m"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.sub_(group["lr"] * state["m"] / (1 - group["beta"] ** state["step"]))


def moved(caplog) -> list[str]:
    return [r.message for r in caplog.records if "runs eagerly between graph replays" in r.message]


@pytest.mark.parametrize("make", [GroupCounter, AttributeCounter])
def test_an_optimizer_whose_step_changes_python_values_runs_as_a_segment(make, caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(lambda m: make(m.parameters())), recording())
    assert step.stats.captures == 1
    (message,) = moved(caplog)
    assert "changes Python values" in message and "ms on the host" in message
    assert ("param_groups[0]['step']" if make is GroupCounter else "steps_taken") in message


def test_an_optimizer_that_keeps_its_count_on_the_device_stays_in_the_graph(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(lambda m: DeviceCounter(m.parameters())), recording())
    assert step.stats.captures == 1 and not moved(caplog)


def test_a_count_created_by_a_single_warm_up_is_seen_too(caplog):
    """With one warm-up, the only step seen creates its state: a number created there counts."""

    class LazyCounter(GroupCounter):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    state["k"] = state.get("k", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"] / state["k"])

    config = graphstep.Config(backend="recording", warmup_steps=1)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        run_pair(twins(lambda m: LazyCounter(m.parameters())), config)
    assert len(moved(caplog)) == 1 and "state[param 0]['k']" in moved(caplog)[0]


def test_changes_name_each_value_and_ignore_device_tensors_and_new_flags():
    before = {"param_groups[0]['k']": 3, "state[param 0]['m']": 1.0, "flag": False, "x": float("nan")}
    after = dict(before, **{"param_groups[0]['k']": 4, "flag": False, "warned": True, "x": float("nan")})
    after["state[param 1]['n']"] = 0
    assert python_state.changes(before, after) == [
        "param_groups[0]['k']: 3 -> 4",
        "state[param 1]['n']: (absent) -> 0",
    ]
    opt = DeviceCounter([torch.nn.Parameter(torch.zeros(2))])
    opt.state[opt.param_groups[0]["params"][0]]["step"] = torch.zeros(())
    assert "state[param 0]['step']" not in python_state.values(opt, host_tensors=False)
    assert "state[param 0]['step']" in python_state.values(opt, host_tensors=True)
    opt.state["k"] = torch.tensor([3])  # a count of the optimizer's own beside its parameters' (MADGRAD)
    before = python_state.values(opt, host_tensors=True)
    opt.state["k"] += 1
    assert python_state.changes(before, python_state.values(opt, host_tensors=True)) == [
        "state['k']: a host tensor [3] -> a host tensor [4]"
    ]


# -- the real packages ------------------------------------------------------------------------------


def _schedulefree(name):
    schedulefree = pytest.importorskip("schedulefree")
    return lambda m: getattr(schedulefree, name)(m.parameters(), lr=0.01, warmup_steps=3)


def _pytorch_optimizer(name):
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    return lambda m: pytorch_optimizer.load_optimizer(name)(m.parameters(), lr=0.01)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _schedulefree("AdamWScheduleFree"), id="schedulefree.AdamWScheduleFree"),
        pytest.param(lambda: _pytorch_optimizer("ranger"), id="pytorch_optimizer.Ranger"),
        pytest.param(lambda: _pytorch_optimizer("adabelief"), id="pytorch_optimizer.AdaBelief"),
        pytest.param(lambda: _pytorch_optimizer("adopt"), id="pytorch_optimizer.ADOPT"),
        pytest.param(lambda: _pytorch_optimizer("lamb"), id="pytorch_optimizer.Lamb"),
        pytest.param(lambda: _pytorch_optimizer("adan"), id="pytorch_optimizer.Adan"),
    ],
)
def test_optimizers_from_other_packages_train_equal_to_eager(make, caplog):
    make_opt = make()
    pair = twins(make_opt)
    for _, opt, _ in pair:
        if hasattr(opt, "train"):  # schedule-free: the step needs train mode
            opt.train()
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(pair, recording())
    assert step.stats.captures == 1 and step.stats.replays == STEPS - 3
    assert len(moved(caplog)) == 1, "a step that keeps Python numbers must run as a segment"
    # The state round-trips: a copy loaded into a fresh optimizer carries the Python values on.
    (_, eager_opt, _), (model, opt, _) = pair
    fresh = make_opt(model)
    fresh.load_state_dict(opt.state_dict())
    assert python_state.values(fresh, host_tensors=False) == python_state.values(
        eager_opt, host_tensors=False
    )


def test_schedulefree_eval_between_calls_evaluates_the_same_weights():
    """schedule-free swaps the weights it trains for the ones it evaluates with `eval()`: toggled
    between calls, the evaluated weights and the training after `train()` stay equal to eager."""
    pair = twins(_schedulefree("AdamWScheduleFree"))
    (m_e, o_e, _), (m_g, o_g, _) = pair
    eager = train_step(m_e, o_e)
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
    x_eval = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    from cpu_common import batches

    for i, (x, y) in enumerate(batches(STEPS)):
        for opt in (o_e, o_g):
            opt.train()
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(want, step(x, y)), f"step {i}"
        if i % 5 == 4:
            for opt, model in ((o_e, m_e), (o_g, m_g)):
                opt.eval()
                model.eval()
            with torch.no_grad():
                assert torch.equal(m_e(x_eval), m_g(x_eval)), f"evaluated weights differ after step {i}"
            for model in (m_e, m_g):
                model.train()
    assert step.stats.captures == 1


class HostScaled(GroupCounter):
    """Reads a norm on the host every step (`.item()`): no graph can record it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                scale = min(1.0, 1.0 / max(p.grad.norm().item(), 1e-12))
                p.add_(p.grad, alpha=-group["lr"] * scale)


class LateCounter(GroupCounter):
    """Changes a Python value in its group only from its third step (counted on the class, which the
    per-step check of an optimizer's own values does not read): two warm-ups cannot see it."""

    steps_taken = 0

    @torch.no_grad()
    def step(self, closure=None):
        type(self).steps_taken += 1
        for group in self.param_groups:
            if type(self).steps_taken >= 3:
                group["late"] = group.get("late", 0.0) + 0.5
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / (1.0 + group.get("late", 0.0)))


def test_a_step_that_syncs_only_at_capture_moves_to_a_segment_and_captures_again(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(lambda m: HostScaled(m.parameters())), recording())
    (message,) = moved(caplog)
    assert "reads the host" in message
    assert step.stats.captures == 1 and step.stats.replays == STEPS - 3


def test_a_python_value_first_changed_at_capture_moves_the_step_to_a_segment(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        run_pair(twins(lambda m: type("Late", (LateCounter,), {})(m.parameters())), recording())
    (message,) = moved(caplog)
    assert "param_groups[0]['late']" in message and "in the capture" in message


def test_with_optimizer_mode_graph_such_a_step_is_refused_at_capture():
    with pytest.raises(graphstep.errors.PythonWriteError, match=r"group\[\"step\"\] \+= 1"):
        run_pair(twins(lambda m: GroupCounter(m.parameters())), recording(optimizer_mode="graph"))


def test_explain_says_where_each_optimizer_runs_and_why():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = GroupCounter(model.parameters())
    step = graphstep.capture(train_step(model, opt), model=model, optimizer=opt, config=recording())
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    text = str(graphstep.explain(step, x, y))
    assert "GroupCounter.step(): an eager segment" in text and "param_groups[0]['step']" in text, text
    device_model = torch.nn.Linear(8, 1)
    device_opt = DeviceCounter(device_model.parameters())
    other = graphstep.capture(
        train_step(device_model, device_opt), model=device_model, optimizer=device_opt, config=recording()
    )
    assert "DeviceCounter.step(): in the graph" in str(graphstep.explain(other, x, y))


class LastGradByReference(torch.optim.Optimizer):
    """Keeps the previous gradient by reference, as timm 1.0.29's Mars does (`state["last_grad"] =
    grad`), and steps along the difference. Eagerly each step's gradient is a new tensor; a graph
    writes every step's into one buffer, so the reference would follow it."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                last = state.get("last_grad")
                direction = p.grad if last is None else p.grad + 0.5 * (p.grad - last)
                p.add_(direction, alpha=-group["lr"])
                state["last_grad"] = p.grad


@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_an_optimizer_keeping_a_gradient_by_reference_gets_a_copy_in_its_segment(mode, caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = run_pair(twins(lambda m: LastGradByReference(m.parameters())), recording(optimizer_mode=mode))
    assert step.stats.captures == 1
    if mode == "auto":
        (message,) = moved(caplog)
        assert "keeps a gradient by reference" in message and "state[param 0]['last_grad']" in message


def test_in_graph_mode_an_optimizer_keeping_a_gradient_by_reference_is_refused():
    with pytest.raises(graphstep.errors.UnsupportedOptimizerError, match="by reference"):
        run_pair(twins(lambda m: LastGradByReference(m.parameters())), recording(optimizer_mode="graph"))
