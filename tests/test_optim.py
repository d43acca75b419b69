"""Optimizers in a captured step, on the CPU: what `prepare` converts, and schedulers, assigned
learning rates, zero_grad, GradScaler and load_state_dict under the recording backend, equal to eager.

The recording backend replays recorded operations on the same memory, so a Python float baked in
at capture stays baked, as in a CUDA graph. Capturable optimizers need a GPU; on the CPU the
tensor-lr paths are the fused ones (SGD, Adam, AdamW, Adagrad with fused=True).
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler as sched
from torch.utils._python_dispatch import TorchDispatchMode

import graphstep
from cpu_common import TinyNet, batches, same_params
from graphstep.errors import GraphStepError, UnsupportedOptimizerError
from graphstep.optim import (
    OptimizerAdapter,
    host_sync_hint,
    make_capturable,
    plan,
)

RECORDING = graphstep.Config(backend="recording")
N_STEPS = 20


def captured(fn, model, opt, config=RECORDING):
    """`graphstep.capture` with the optimizer prepared before the first call, as `make_capturable`
    prepares an eager twin, and `before_call` run by hand around each call. CapturedStep does both
    itself too; running them twice is harmless (both are idempotent)."""
    adapter = OptimizerAdapter([opt])
    adapter.prepare("cpu")
    step = graphstep.capture(fn, model=model, optimizer=opt, config=config)

    def call(*args):
        adapter.before_call()
        return step(*args)

    call.step = step
    return call


def eager(fn, opt):
    """The eager twin: the same optimizer settings (make_capturable) and the same lr absorption."""
    adapter = make_capturable(opt, "cpu")

    def call(*args):
        adapter.before_call()
        return fn(*args)

    return call


def twins(make_opt, seed=0):
    torch.manual_seed(seed)
    model = TinyNet()
    twin = copy.deepcopy(model)
    return (model, make_opt(model.parameters())), (twin, make_opt(twin.parameters()))


def fused_sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4, fused=True)


def fused_adam(params):
    return torch.optim.Adam(params, lr=1e-2, fused=True)


def train_step(model, opt, zero="optimizer"):
    def step(x, y):
        if zero == "optimizer_first":
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if zero == "optimizer":
            opt.zero_grad()
        elif zero == "model":
            model.zero_grad()
        return loss

    return step


def run(call, data, between=lambda i, loss: None, seed=7):
    torch.manual_seed(seed)  # the dropout in TinyNet draws from the CPU generator
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(call(x, y))
        between(i, losses[-1])
    return losses


def assert_equal_runs(eager_losses, graphed_losses, eager_model, graphed_model):
    for i, (a, b) in enumerate(zip(eager_losses, graphed_losses, strict=True)):
        assert torch.equal(a, b), f"step {i}: eager loss {a.item()!r} != graphstep loss {b.item()!r}"
    assert same_params(eager_model, graphed_model), "parameters differ from eager"


# -- what prepare converts ------------------------------------------------------------------------


class OwnStepAdam(torch.optim.Adam):
    def step(self, closure=None):
        return super().step(closure)


P = [torch.nn.Parameter(torch.zeros(2))]
optim = torch.optim


@pytest.mark.parametrize(
    "make, device, capturable, tensor_lr",
    [
        (lambda: optim.Adam(P), "cuda", True, True),
        (lambda: optim.AdamW(P, fused=True), "cuda", True, True),
        (lambda: optim.AdamW(P, foreach=False), "cuda", True, True),
        (lambda: optim.NAdam(P), "cuda", True, True),
        (lambda: optim.RAdam(P), "cuda", True, True),
        (lambda: optim.Adamax(P), "cuda", True, True),
        (lambda: optim.ASGD(P), "cuda", True, True),
        (lambda: optim.RMSprop(P, foreach=True), "cuda", True, True),
        (lambda: optim.RMSprop(P, foreach=False), "cuda", True, False),
        (lambda: optim.Adadelta(P, foreach=True), "cuda", True, True),
        (lambda: optim.Rprop(P), "cuda", True, True),  # read only when its state is made
        (lambda: optim.SGD(P, momentum=0.9), "cuda", False, False),
        (lambda: optim.SGD(P, momentum=0.9, foreach=True), "cuda", False, False),
        (lambda: optim.SGD(P, momentum=0.9, fused=True), "cuda", False, True),
        (lambda: optim.Adam(P), "cpu", False, False),
        (lambda: optim.Adam(P, fused=True), "cpu", False, True),
        (lambda: optim.SGD(P, fused=True), "cpu", False, True),
        (lambda: optim.Adagrad(P, fused=True), "cpu", False, True),
        (lambda: OwnStepAdam(P), "cuda", True, False),  # its own step() may read lr any way
    ],
)
def test_plan_per_optimizer(make, device, capturable, tensor_lr):
    opt = make()
    (p,) = plan(opt, device)
    assert (p.capturable, p.tensor_lr) == (capturable, tensor_lr), p
    assert bool(p.why_float) != tensor_lr, "a float lr must come with its reason, and only then"
    assert opt.param_groups[0].get("capturable", False) is False, "plan() must change nothing"


@pytest.mark.parametrize(
    "make, fused",
    [
        (lambda: optim.Adam(P), True),
        (lambda: optim.AdamW(P, weight_decay=0.1), True),
        (lambda: optim.AdamW(P, amsgrad=True, maximize=True), True),
        (lambda: optim.AdamW(P, foreach=True), False),  # the user's choice is kept
        (lambda: optim.AdamW(P, foreach=False), False),
        (lambda: optim.Adam(P, fused=False), False),
        (lambda: optim.Adam(P, differentiable=True), False),
        (lambda: optim.NAdam(P), False),  # no fused kernel
        (lambda: optim.SGD(P, momentum=0.9), True),
        (lambda: optim.SGD(P, momentum=0.9, foreach=True), False),
        (lambda: optim.RMSprop(P), False),
        (lambda: OwnStepAdam(P), False),  # its own step() may not take fused=True
    ],
)
def test_sgd_adam_adamw_run_fused_on_cuda_unless_the_user_chose(make, fused, monkeypatch):
    """graphstep's implementation choice, decided for a CUDA device (the parameters' own check,
    what torch's fused kernels take, is faked: this machine has no CUDA tensors)."""
    from graphstep.optim import table

    monkeypatch.setattr(table, "fused_kernel_takes", lambda params, device: True)
    opt = make()
    (p,) = plan(opt, "cuda")
    assert p.fuse == fused and (p.impl == "fused") == fused, p
    assert not fused or p.tensor_lr, "fused Adam reads lr as a device tensor"
    assert not plan(opt, "cpu")[0].fuse, "on the CPU nothing is chosen"
    assert opt.param_groups[0].get("fused") == opt.defaults.get("fused"), "plan() must change nothing"


def test_make_capturable_on_cuda_sets_fused_but_leaves_unscaling_to_the_user(monkeypatch):
    from graphstep.optim import table

    monkeypatch.setattr(table, "fused_kernel_takes", lambda params, device: True)
    monkeypatch.setattr(table, "capturable_devices", lambda: ("cuda",))
    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    OptimizerAdapter([opt]).prepare(torch.device("cuda", 0))  # no CUDA call: the index is given
    group = opt.param_groups[0]
    assert (group["fused"], group["capturable"], group["foreach"]) == (True, True, None)
    # Lightning refuses to clip an optimizer that unscales itself, and GradScaler would skip the
    # user's own unscale_: the optimizer graphstep made fused keeps the user's unscaling.
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    assert opt.defaults["fused"] is True, "groups added later run fused too"


def test_fused_kernel_takes_only_floating_tensors_on_the_device():
    from graphstep.optim import table

    floats = [torch.nn.Parameter(torch.zeros(2))]
    assert table.fused_kernel_takes(floats, torch.device("cpu"))
    assert not table.fused_kernel_takes(floats, torch.device("cuda"))
    assert not table.fused_kernel_takes([torch.zeros(2, dtype=torch.int64)], torch.device("cpu"))
    assert not table.fused_kernel_takes([], torch.device("cpu"))


class _ItemCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.items = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.items += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "cls, flags",
    [
        (optim.SGD, {"fused": True}),
        (optim.SGD, {"foreach": True}),
        (optim.SGD, {"foreach": False}),
        (optim.Adam, {"fused": True}),
        (optim.AdamW, {"fused": True}),
        (optim.Adam, {"foreach": False}),
        (optim.Adagrad, {"fused": True}),
        (optim.Adagrad, {"foreach": False}),
        (optim.RMSprop, {"foreach": True}),
        (optim.Adadelta, {"foreach": False}),
    ],
)
def test_tensor_lr_table_matches_the_installed_torch(cls, flags):
    """Where plan() makes lr a tensor, this torch's step must read it without .item() (CPU paths)."""
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([param], lr=0.01, **flags)
    (p,) = plan(opt, "cpu")
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    counter = _ItemCounter()
    for _ in range(2):  # the second step runs with state, as a capture does
        param.grad = torch.randn(4, 3)
        counter.items = 0
        try:
            with counter:
                opt.step()
        except (RuntimeError, ValueError):  # torch refuses a tensor lr on this path outright
            counter.items = -1
    assert (counter.items == 0) == p.tensor_lr, (
        f"{cls.__name__}{flags}: plan says tensor_lr={p.tensor_lr}, a tensor lr step made {counter.items} .item() calls"
    )


def test_lr_becomes_a_float32_device_tensor_at_the_first_call_once():
    opt = fused_sgd(TinyNet().parameters())
    adapter = make_capturable(opt)
    assert opt.param_groups[0]["lr"] == 0.05, "a scheduler made now must still see the float"
    adapter.before_call()
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.shape == () and lr.dtype == torch.float32
    assert lr.item() == torch.tensor(0.05, dtype=torch.float32).item()
    adapter.prepare("cpu")  # idempotent, and so is a second adapter on the same optimizer
    make_capturable(opt).before_call()
    assert opt.param_groups[0]["lr"] is lr
    with pytest.raises(GraphStepError, match="prepared for cpu"):
        adapter.prepare("meta")


def test_a_users_tensor_lr_is_kept():
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD(TinyNet().parameters(), lr=lr, fused=True)
    make_capturable(opt).before_call()
    assert opt.param_groups[0]["lr"] is lr


def test_an_assigned_lr_is_absorbed_into_the_tensor_the_graph_reads():
    opt = fused_sgd(TinyNet().parameters())
    adapter = make_capturable(opt)
    adapter.before_call()
    group = opt.param_groups[0]
    lr = group["lr"]
    group["lr"] = 0.01  # a float, as older schedulers assign
    adapter.before_call()
    assert group["lr"] is lr and lr.item() == pytest.approx(0.01)
    group["lr"] = torch.tensor([0.02], dtype=torch.float64)  # a tensor of another dtype and shape
    adapter.before_call()
    assert group["lr"] is lr and lr.item() == pytest.approx(0.02)
    group["lr"] = "fast"
    with pytest.raises(GraphStepError, match="must be a number"):
        adapter.before_call()


def test_an_added_param_group_gets_its_own_lr_tensor():
    model = TinyNet()
    opt = torch.optim.SGD(model.fc1.parameters(), lr=0.05, fused=True)
    adapter = make_capturable(opt)
    opt.add_param_group({"params": model.fc2.parameters(), "lr": 0.5})
    adapter.before_call()
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(isinstance(lr, torch.Tensor) for lr in lrs) and lrs[0] is not lrs[1]
    assert lrs[1].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: optim.LBFGS(p), ["closure", "on the host", "AdamW"]),
        (lambda p: optim.SparseAdam(p), ["sparse", "nn.Embedding(sparse=False)"]),
        (lambda p: optim.Adafactor(p), [".item()", "AdamW"]),
    ],
)
def test_optimizers_that_cannot_be_captured_are_refused_with_a_reason(make, words):
    opt = make(TinyNet().parameters())
    with pytest.raises(UnsupportedOptimizerError) as info:
        OptimizerAdapter([opt])  # as Config(optimizer_mode="graph") makes it
    assert all(w in str(info.value) for w in words), str(info.value)


def test_adagrad_runs_only_eagerly_on_a_gpu_but_fused_adagrad_runs_on_cpu():
    (p,) = plan(torch.optim.Adagrad(P), "cuda")
    assert "step count on the host" in p.eager_only and not p.live
    with pytest.raises(UnsupportedOptimizerError, match="step count on the host"):
        OptimizerAdapter([torch.optim.Adagrad(P)]).prepare("xpu")  # a capturable device type
    adapter = OptimizerAdapter([opt := torch.optim.Adagrad(P)], allow_eager=True)
    adapter.prepare("xpu")
    assert "step count" in adapter.eager_only(opt) and not adapter.can_stay_in_graph(opt, "lr")
    assert plan(torch.optim.Adagrad(P, fused=True), "cpu")[0].tensor_lr


def test_host_sync_hints_name_the_fix():
    frame = traceback.FrameSummary
    scaler = host_sync_hint([frame("/t/amp/grad_scaler.py", 371, "_maybe_opt_step")])
    clip = host_sync_hint([frame("/t/nn/utils/clip_grad.py", 109, "get_total_norm")])
    assert "fused=True" in scaler and "eager segment" in scaler
    assert "error_if_nonfinite=False" in clip and "isfinite" in clip
    assert host_sync_hint([frame("/user/train.py", 3, "step")]) is None


# -- numerics with the recording backend ----------------------------------------------------------

SCHEDULERS = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=4, gamma=0.5),
    "CosineAnnealingLR": lambda opt: sched.CosineAnnealingLR(opt, T_max=N_STEPS),
    # Momentum cycling changes a Python float (momentum, betas) that stays baked: guards' work.
    "OneCycleLR": lambda opt: sched.OneCycleLR(
        opt, max_lr=0.1, total_steps=N_STEPS + 1, cycle_momentum=False
    ),
    "LambdaLR": lambda opt: sched.LambdaLR(opt, lambda s: 1 / (1 + s)),
    "SequentialLR": lambda opt: sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, start_factor=0.1, total_iters=5), sched.ExponentialLR(opt, gamma=0.8)],
        milestones=[5],
    ),
    "ReduceLROnPlateau": lambda opt: sched.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}


def stepper(scheduler, lrs):
    def between(i, loss):
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(loss.detach())
        else:
            scheduler.step()
        lrs.append(float(scheduler.optimizer.param_groups[0]["lr"]))

    return between


@pytest.mark.parametrize("make_opt", [fused_sgd, fused_adam], ids=["SGD-fused", "Adam-fused"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_changes_lr_with_no_recapture_equal_to_eager(name, make_opt):
    (m_e, o_e), (m_g, o_g) = twins(make_opt)
    data = batches(N_STEPS)
    eager_call = eager(train_step(m_e, o_e), o_e)  # prepare before the scheduler, as capture(optimizer=) does
    graphed = captured(train_step(m_g, o_g), m_g, o_g)
    lrs_e, lrs_g = [], []
    eager_losses = run(eager_call, data, stepper(SCHEDULERS[name](o_e), lrs_e))
    graphed_losses = run(graphed, data, stepper(SCHEDULERS[name](o_g), lrs_g))
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    assert lrs_e == lrs_g and len(set(lrs_g)) > 1, f"lr did not change: {lrs_g}"
    s = graphed.step.stats
    assert (s.captures, s.replays) == (1, N_STEPS - 4), s


def test_lr_assigned_by_hand_between_calls_equal_to_eager():
    (m_e, o_e), (m_g, o_g) = twins(fused_sgd)

    def set_lr(opt):
        def between(i, loss):
            for group in opt.param_groups:
                group["lr"] = 0.05 * 0.8**i  # a float replaces the tensor: absorbed before the next call

        return between

    eager_losses = run(eager(train_step(m_e, o_e), o_e), batches(N_STEPS), set_lr(o_e))
    graphed = captured(train_step(m_g, o_g), m_g, o_g)
    graphed_losses = run(graphed, batches(N_STEPS), set_lr(o_g))
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    assert graphed.step.stats.captures == 1


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_sgd_without_fused_keeps_a_float_lr_and_matches_eager_at_a_constant_lr(foreach):
    def make_opt(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=foreach)

    (m_e, o_e), (m_g, o_g) = twins(make_opt)
    eager_losses = run(eager(train_step(m_e, o_e), o_e), batches(N_STEPS))
    graphed_losses = run(captured(train_step(m_g, o_g), m_g, o_g), batches(N_STEPS))
    assert isinstance(o_g.param_groups[0]["lr"], float)
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_sgd_without_fused_and_a_scheduler_runs_as_an_eager_segment(foreach):
    """SGD without fused=True keeps a float lr, and a scheduler is attached: its step runs as an
    eager segment between graph replays from the first capture (optimizer_mode="auto")."""

    def make_opt(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=foreach)

    (m_e, o_e), (m_g, o_g) = twins(make_opt)
    data = batches(N_STEPS)
    eager_losses = run(eager(train_step(m_e, o_e), o_e), data, stepper(sched.StepLR(o_e, 6, 0.5), []))
    graphed = captured(train_step(m_g, o_g), m_g, o_g)
    graphed_losses = run(graphed, data, stepper(sched.StepLR(o_g, 6, 0.5), []))
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    assert graphed.step.stats.captures == 1, graphed.step.stats


@pytest.mark.parametrize("zero", ["optimizer", "model", "optimizer_first"])
def test_zero_grad_inside_the_step_equal_to_eager(zero):
    (m_e, o_e), (m_g, o_g) = twins(fused_sgd)
    data = batches(N_STEPS)
    eager_losses = run(eager(train_step(m_e, o_e, zero), o_e), data)
    graphed = captured(train_step(m_g, o_g, zero), m_g, o_g)
    grads_none = []
    graphed_losses = run(
        graphed, data, lambda i, loss: grads_none.append(all(p.grad is None for p in m_g.parameters()))
    )
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    if zero == "optimizer_first":  # grads of the last step stay readable, as in eager
        assert not any(grads_none)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(m_e.parameters(), m_g.parameters()))
    else:
        assert all(grads_none), "grads must be None after every call, replays included"


def scaled_step(model, opt, scaler):
    def step(x, y, boost):  # boost: () float32, 1 or huge (then the fp16 grads overflow)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss * boost).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    return step


def test_grad_scaler_with_a_fused_optimizer_skips_inf_steps_as_eager():
    (m_e, o_e), (m_g, o_g) = twins(fused_sgd)
    data = [(x, y, torch.tensor(1e30 if i in (9, 14) else 1.0)) for i, (x, y) in enumerate(batches(N_STEPS))]

    def go(call, scaler):
        torch.manual_seed(7)
        losses, scales = [], []
        for args in data:
            losses.append(call(*args))
            scales.append(scaler.get_scale())
        return losses, scales

    s_e = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    s_g = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    eager_losses, eager_scales = go(eager(scaled_step(m_e, o_e, s_e), o_e), s_e)
    graphed = captured(scaled_step(m_g, o_g, s_g), m_g, o_g)
    graphed_losses, graphed_scales = go(graphed, s_g)
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    assert eager_scales == graphed_scales
    assert eager_scales[9] == eager_scales[8] / 2 and eager_scales[14] < eager_scales[13], eager_scales
    assert max(eager_scales) > 2.0**10, "the scale never grew: the growth path was not exercised"
    assert graphed.step.stats.replays == N_STEPS - 4


# GradScaler with an unfused optimizer: its step runs as an eager segment (test_library_segments.py).


def test_load_state_dict_between_calls_writes_into_the_tensors_the_graph_uses():
    (m_e, o_e), (m_g, o_g) = twins(fused_sgd)
    data = batches(N_STEPS)
    saved = {}

    def rewind(model, opt):
        def between(i, loss):
            if i == 7:
                saved[id(opt)] = copy.deepcopy((model.state_dict(), opt.state_dict(), torch.get_rng_state()))
            if i == 11:  # back to step 8, and train on from there
                model_state, opt_state, rng = saved[id(opt)]
                model.load_state_dict(model_state)
                opt.load_state_dict(opt_state)
                torch.set_rng_state(rng)

        return between

    eager_losses = run(eager(train_step(m_e, o_e), o_e), data, rewind(m_e, o_e))
    graphed = captured(train_step(m_g, o_g), m_g, o_g)
    buffers = None

    def watch(i, loss):
        nonlocal buffers
        rewind(m_g, o_g)(i, loss)
        now = [o_g.state[p]["momentum_buffer"] for p in m_g.parameters()]
        if i == 10:
            buffers = now
        if i == 11:
            assert all(a is b for a, b in zip(buffers, now)), (
                "load_state_dict replaced the graph's state tensors"
            )

    graphed_losses = run(graphed, data, watch)
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    assert graphed.step.stats.captures == 1, "the load hooks should have made a re-capture unnecessary"


def test_load_state_dict_of_another_structure_is_left_to_the_guards():
    """Loading a state without momentum buffers cannot be copied in place: the guards capture again."""
    (m_e, o_e), (m_g, o_g) = twins(fused_sgd)
    data = batches(N_STEPS)
    fresh = {id(o_e): copy.deepcopy(o_e.state_dict()), id(o_g): copy.deepcopy(o_g.state_dict())}

    def reset_state(opt):
        def between(i, loss):
            if i == 9:
                opt.load_state_dict(fresh[id(opt)])  # no state yet: fused SGD starts its momentum again

        return between

    eager_losses = run(eager(train_step(m_e, o_e), o_e), data, reset_state(o_e))
    graphed = captured(train_step(m_g, o_g), m_g, o_g)
    graphed_losses = run(graphed, data, reset_state(o_g))
    assert_equal_runs(eager_losses, graphed_losses, m_e, m_g)
    assert graphed.step.stats.captures == 2, graphed.step.stats  # one more warm-up, then a capture


def test_state_layout_changes_only_while_state_is_created():
    model = TinyNet()
    opt = fused_sgd(model.parameters())
    adapter = make_capturable(opt)
    step = train_step(model, opt)
    empty = adapter.state_layout()
    step(*batches(1)[0])
    first = adapter.state_layout()
    step(*batches(1)[0])
    assert empty != first == adapter.state_layout()
    opt.load_state_dict(fused_sgd(TinyNet().parameters()).state_dict())
    assert adapter.state_layout() != first


def test_load_state_dict_absorbs_a_float_lr_and_keeps_capturable_state_in_place():
    model = TinyNet()
    opt = fused_sgd(model.parameters())
    make_capturable(opt)
    train_step(model, opt)(*batches(1)[0])
    lr, groups, group, state = opt.param_groups[0]["lr"], opt.param_groups, opt.param_groups[0], opt.state
    buffers = [state[p]["momentum_buffer"] for p in model.parameters()]
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.125  # as saved by an optimizer with a float lr
    saved["param_groups"][0]["weight_decay"] = 0.5
    for s in saved["state"].values():
        s["momentum_buffer"].fill_(3.0)
    opt.load_state_dict(saved)
    assert opt.param_groups is groups and opt.param_groups[0] is group and opt.state is state
    assert group["lr"] is lr and lr.item() == 0.125 and group["weight_decay"] == 0.5
    for p, buffer in zip(model.parameters(), buffers):
        assert state[p]["momentum_buffer"] is buffer and bool((buffer == 3.0).all())


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(["step", "sched", "float_lr", "tensor_lr", "rewind"]), min_size=6, max_size=16)
)
def test_random_lr_changes_and_rewinds_never_differ_from_eager(ops):
    (m_e, o_e), (m_g, o_g) = twins(fused_sgd)
    data = batches(len(ops) + 1)
    calls = (eager(train_step(m_e, o_e), o_e), captured(train_step(m_g, o_g), m_g, o_g))
    results = []
    for call, model, opt in zip(calls, (m_e, m_g), (o_e, o_g)):
        torch.manual_seed(3)
        scheduler = sched.ExponentialLR(opt, gamma=0.9)
        losses = [call(*data[-1])]
        # A rewind goes back to a state with momentum buffers: one that loses them changes the
        # state's structure, which the guards (not the load hooks) must catch.
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        for i, op in enumerate(ops):
            if op == "sched":
                scheduler.step()
            elif op == "float_lr":
                opt.param_groups[0]["lr"] = 0.01 * (i + 1)
            elif op == "tensor_lr":
                opt.param_groups[0]["lr"] = torch.tensor(0.02 * (i + 1), dtype=torch.float64)
            elif op == "rewind":
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            losses.append(call(*data[i]))
        results.append(losses)
    assert_equal_runs(*results, m_e, m_g)
