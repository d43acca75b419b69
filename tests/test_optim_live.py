"""Live hyperparameters (issue 11): every torch optimizer x schedule follows its hyperparameters with
no re-capture, bitwise equal to an eager twin, on the CPU with the recording backend.

torch runs capturable optimizers only on a GPU (`_get_capturable_supported_devices`), and graphstep
asks torch which devices qualify. The `capturable_cpu` fixture adds "cpu" to that list, so the CPU
runs torch's own capturable code paths (the GPU's, device-agnostic Python over ATen operations) and
`make_capturable(opt, "cpu")` does what it does on a GPU. Without it, the CPU keeps the
non-capturable paths, which read their step count with `.item()` and cannot be recorded.

Rows whose schedule changes a hyperparameter that cannot be live run that optimizer's step as an
eager segment between graph replays (`optimizer_mode="auto"`), with one capture as well.
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as sched
from torch.utils._python_dispatch import TorchDispatchMode

import graphstep
from cpu_common import TinyNet, batches
from cpu_common import plain_step as train_step
from graphstep.diagnostics import host_sync_ops
from graphstep.errors import GraphStepError, UnsupportedOptimizerError
from graphstep.optim import OptimizerAdapter, baked_hyperparameters, make_capturable, plan, table

RECORDING = graphstep.Config(backend="recording")
N_STEPS = 16
"""3 warm-ups, the capture and 12 replays, through which every schedule below changes the values it
drives (StepLR at calls 5, 10 and 15, the warm-up's peak at 8, OneCycleLR's and the cosine's every call)."""

# Non-zero numbers for every hyperparameter, so no `!= 0` branch is skipped.
OPTIONS = {
    "SGD": dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-3),
    "Adam": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-3),
    "AdamW": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2),
    "NAdam": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-3, momentum_decay=4e-3),
    "RAdam": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-3),
    "Adamax": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-3),
    "RMSprop": dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=1e-3, momentum=0.9),
    "Adagrad": dict(lr=0.05, lr_decay=1e-3, weight_decay=1e-3, eps=1e-6),
    "Adadelta": dict(lr=0.5, rho=0.9, eps=1e-6, weight_decay=1e-3),
    "ASGD": dict(lr=1e-2, lambd=1e-3, alpha=0.75, t0=5.0, weight_decay=1e-3),
    "Rprop": dict(lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-6, 1.0)),
}
FLAGS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "forloop": dict(foreach=False)}
ROWS = [(name, impl) for name in OPTIONS for impl in FLAGS if impl != "fused" or name in table.HAS_FUSED]


@pytest.fixture
def capturable_cpu(monkeypatch):
    """Let torch (and so graphstep) treat the CPU as a device for capturable optimizers."""
    for module in [m for n, m in sys.modules.items() if n.startswith("torch.optim")]:
        devices = getattr(module, "_get_capturable_supported_devices", None)
        if devices is not None:
            monkeypatch.setattr(
                module,
                "_get_capturable_supported_devices",
                lambda supports_xla=True, f=devices: [*f(supports_xla), "cpu"],
            )


def make_optimizer(name, impl, params, **overrides):
    cls = getattr(torch.optim, name)
    flags = dict(
        FLAGS[impl], **({"capturable": True} if "capturable" in cls([torch.zeros(1)]).defaults else {})
    )
    return cls(params, **{**OPTIONS[name], **overrides}, **flags)


# -- the table is what the installed torch does -------------------------------------------------------


class _SyncSpy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.syncs = host_sync_ops(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += func in self.ops
        return func(*args, **(kwargs or {}))


def _probe(name, impl, key, positions=None):
    """Make `key` (or those `positions` of a tuple key) 0-d tensors once the state exists; run two
    steps, the second after writing new values into the tensors. "live": no host sync and the same
    numbers (to float32 rounding) as a twin given floats; else "sync", "error" or "differs"."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    twins = [[torch.nn.Parameter(p.detach().clone()) for p in params] for _ in range(2)]
    opts = [make_optimizer(name, impl, ps) for ps in twins]
    grads = [[torch.randn(p.shape) for p in params] for _ in range(3)]
    first = OPTIONS[name][key]
    second = tuple(v * 0.9 for v in first) if isinstance(first, tuple) else first * 0.9

    def step(i, ps, opt):
        for p, g in zip(ps, grads[i]):
            p.grad = g.clone()
        opt.step()

    def put(group, value, as_tensor):
        def one(now, v):
            if not as_tensor:
                return v
            if isinstance(now, torch.Tensor):
                return now.fill_(v)
            return torch.tensor(float(v))

        if positions is None:
            group[key] = one(group[key], value)
        else:
            group[key] = tuple(
                one(n, v) if i in positions else v for i, (n, v) in enumerate(zip(group[key], value))
            )

    for ps, opt in zip(twins, opts):
        step(0, ps, opt)
    spy = _SyncSpy()
    try:
        with spy:
            put(opts[0].param_groups[0], first, True)
            step(1, twins[0], opts[0])
            put(opts[0].param_groups[0], second, True)
            step(2, twins[0], opts[0])
    except (RuntimeError, ValueError):
        return "error"
    step(1, twins[1], opts[1])
    put(opts[1].param_groups[0], second, False)
    step(2, twins[1], opts[1])
    if spy.syncs:
        return "sync"
    same = all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(*twins))
    return "live" if same else "differs"


@pytest.mark.parametrize("name, impl", ROWS)
def test_the_table_matches_the_installed_torch(capturable_cpu, name, impl):
    """What the table calls live runs without a host sync and is read on every step; each number it
    calls baked does sync (or is refused) as a tensor, so the table is not too cautious either."""
    live = table.LIVE[name].get(impl, {})
    checked = 0
    for key in table.numbers_of(make_optimizer(name, impl, [torch.nn.Parameter(torch.zeros(1))])):
        if (name, key) in table.READ_WHEN_STATE_IS_MADE and key not in live:
            continue  # read when the state is made only: a tensor changes nothing afterwards
        if not isinstance(OPTIONS[name][key], tuple):
            verdict = _probe(name, impl, key)
            assert (verdict == "live") == (key in live), (
                f"{name} ({impl}) {key}: {verdict}; table: {key in live}"
            )
            checked += 1
            continue
        listed = set(live.get(key) or ())
        if listed:  # the live positions together (Rprop clamps with both step_sizes or neither)
            verdict = _probe(name, impl, key, listed)
            assert verdict == "live", f"{name} ({impl}) {key}{sorted(listed)}: {verdict}; table: live"
        for position in set(range(len(OPTIONS[name][key]))) - listed:
            verdict = _probe(name, impl, key, listed | {position})
            assert verdict != "live", f"{name} ({impl}) {key}[{position}]: live; table: baked"
        checked += 1
    assert checked, f"{name} has no numeric hyperparameters?"


def test_the_docs_table_is_the_table():
    docs = Path(__file__).parent.parent / "docs" / "optimizers.md"
    assert table.table_markdown() in docs.read_text(), (
        "docs/optimizers.md's table differs from optim/table.py"
    )


# -- every optimizer x schedule: equal to the eager twin, one capture ----------------------------------


def _onecycle(opt):
    cycles = "momentum" in opt.defaults or "betas" in opt.defaults
    max_lr = 5 * float(OPTIONS[type(opt).__name__]["lr"])
    return sched.OneCycleLR(opt, max_lr=max_lr, total_steps=N_STEPS + 1, cycle_momentum=cycles)


def _warmup(opt):  # transformers' get_linear_schedule_with_warmup: from lr 0 up, then down to 0
    warm, total = 8, N_STEPS + 2

    def factor(step):
        return step / max(1, warm) if step < warm else max(0.0, (total - step) / max(1, total - warm))

    return sched.LambdaLR(opt, factor)


class _ByHand:
    """A float lr assigned by hand between calls."""

    def __init__(self, opt):
        self.opt, self.calls = opt, 0

    def step(self):
        self.calls += 1
        for group in self.opt.param_groups:
            group["lr"] = OPTIONS[type(self.opt).__name__]["lr"] * 0.9**self.calls


SCHEDULES = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=5, gamma=0.5),
    "OneCycleLR": _onecycle,
    "CosineAnnealingLR": lambda opt: sched.CosineAnnealingLR(opt, T_max=N_STEPS),
    "warmup-from-0": _warmup,
    "lr-by-hand": _ByHand,
}

_LR_BAKED = {("SGD", "foreach"), ("SGD", "forloop"), ("RMSprop", "forloop"), ("Adadelta", "forloop")}
_EAGER_ONLY = {("Adagrad", "foreach"), ("Adagrad", "forloop")}  # host step count on a device
_MOMENTUM_BAKED = {  # OneCycleLR cycles momentum or betas[0]: baked on these paths
    ("SGD", "fused"),
    ("Adam", "fused"),
    ("Adam", "foreach"),
    ("AdamW", "fused"),
    ("AdamW", "foreach"),
    ("NAdam", "foreach"),
    ("RAdam", "foreach"),
    ("Adamax", "foreach"),
    ("RMSprop", "foreach"),
}


def _cases():
    for name, impl in ROWS:
        for schedule in SCHEDULES:
            yield pytest.param(name, impl, schedule, id=f"{name}-{impl}-{schedule}")


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Bits, not values: NaN equals NaN (torch's capturable for-loop Adam makes NaN at lr=0).
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bits = _BITS.get(a.element_size()) if a.is_floating_point() else None
    assert torch.equal(a.view(bits), b.view(bits)) if bits else torch.equal(a, b), f"{what} differs"


def train_twins(make_opt, make_schedule, *, n_steps=N_STEPS, config=RECORDING, between=None):
    """The eager twin (make_capturable before its scheduler, no per-step calls) and graphstep
    (scheduler first, prepared at the first call): the orders users write. Returns the step."""
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    data = batches(n_steps)
    eager_opt = make_opt(twin.parameters())
    make_capturable(eager_opt, "cpu")
    graph_opt = make_opt(model.parameters())
    runs = []
    for m, opt, call in (
        (twin, eager_opt, None),
        (
            model,
            graph_opt,
            graphstep.capture(train_step(model, graph_opt), model=model, optimizer=graph_opt, config=config),
        ),
    ):
        schedule = make_schedule(opt)
        step = call or train_step(m, opt)
        torch.manual_seed(7)  # TinyNet's dropout
        losses = []
        for i, (x, y) in enumerate(data):
            losses.append(step(x, y))
            schedule.step()
            if between is not None:
                between(i, opt)
        runs.append((m, opt, losses, step))
    (m_e, o_e, losses_e, _), (m_g, o_g, losses_g, step) = runs
    for i, (a, b) in enumerate(zip(losses_e, losses_g)):
        assert_bitwise(a, b, f"loss of step {i}")
    for (name, p), q in zip(m_e.named_parameters(), m_g.parameters()):
        assert_bitwise(p, q, f"parameter {name}")
        state_e, state_g = o_e.state[p], o_g.state[q]
        assert sorted(state_e) == sorted(state_g), f"optimizer state keys of {name}"
        for key, value in state_e.items():
            if isinstance(value, torch.Tensor):
                assert_bitwise(value, state_g[key], f"optimizer state {key} of {name}")
    return step


@pytest.mark.parametrize("name, impl, schedule", list(_cases()))
def test_schedules_follow_live_hyperparameters_equal_to_eager(capturable_cpu, name, impl, schedule):
    step = train_twins(lambda ps: make_optimizer(name, impl, ps), SCHEDULES[schedule])
    s = step.stats
    # 3 warm-ups, the capturing call, replays. A float assigned by hand to a baked lr cannot be
    # foreseen (torch's schedulers can): the optimizer moves to an eager segment then, capturing once more.
    moved = schedule == "lr-by-hand" and (name, impl) in _LR_BAKED
    assert (s.captures, s.replays) == (1 + moved, N_STEPS - 4 - moved), s
    segment = (name, impl) in _LR_BAKED | _EAGER_ONLY or (
        schedule == "OneCycleLR" and (name, impl) in _MOMENTUM_BAKED
    )
    assert bool(step._ctx.modes.eager) == segment, "the optimizer runs where the table says"


def test_the_hf_warmup_is_equal_whichever_was_made_first(capturable_cpu):
    """Regression (issue 11): a LambdaLR made after the lr became a tensor computed base_lr * factor
    in float32 (its base_lrs clone the tensor), one made before in float64 then rounded once: an eager
    twin prepared before its scheduler drifted from graphstep (prepared at its first call) by 1 ulp of
    lr on most steps. Live tensors are now made at the first step, after the schedulers."""
    step = train_twins(lambda ps: torch.optim.AdamW(ps, lr=3e-4, foreach=True, capturable=True), _warmup)
    assert step.stats.captures == 1


def test_a_scheduler_made_before_the_first_step_sees_python_floats():
    opt = torch.optim.SGD(TinyNet().parameters(), lr=3e-4, fused=True)
    make_capturable(opt, "cpu")
    scheduler = _warmup(opt)
    assert all(isinstance(b, float) for b in scheduler.base_lrs)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()  # the first step makes the tensor
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


# -- the pieces the step's lifecycle uses ----------------------------------------------------------------


class Lion(torch.optim.Optimizer):
    """A Lion-like optimizer written here: graphstep does not know how it reads its numbers."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, ema_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, ema_decay=ema_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
                if group["ema_decay"] > 0:  # a new state entry once a hyperparameter turns it on
                    ema = state.setdefault("ema", p.clone())
                    ema.lerp_(p, 1 - group["ema_decay"])


def test_an_optimizer_graphstep_does_not_know_is_captured_with_nothing_live(capturable_cpu):
    opt = Lion([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.1)
    adapter = OptimizerAdapter([opt])
    adapter.prepare("cpu")
    adapter.before_call()
    assert adapter.live_keys(opt) == set() and isinstance(opt.param_groups[0]["lr"], float)
    assert not adapter.can_stay_in_graph(opt, "lr") and not adapter.can_stay_in_graph(opt, "initial_lr")
    assert adapter.eager_only(opt) is None
    assert "does not know" in adapter.why_baked(opt, "lr")


def test_a_custom_optimizer_with_fixed_hyperparameters_stays_in_the_graph():
    step = train_twins(lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1), lambda opt: _Nothing())
    assert step.stats.captures == 1


class _Nothing:
    def step(self):
        pass


def test_a_custom_optimizer_with_a_schedule():
    step = train_twins(
        lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1), lambda o: sched.CosineAnnealingLR(o, N_STEPS)
    )
    assert step.stats.captures == 1


def test_a_custom_optimizer_that_changes_its_state_layout_mid_run():
    def turn_on_ema(i, opt):
        if i == 12:
            opt.param_groups[0]["ema_decay"] = 0.9

    step = train_twins(lambda ps: Lion(ps, lr=1e-3), lambda opt: _Nothing(), between=turn_on_ema)
    assert step.stats.captures == 2  # the assignment by hand moves its step to an eager segment


def test_live_keys_and_what_may_change_in_the_graph(capturable_cpu):
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam_loop, adam_foreach, sgd = (
        torch.optim.Adam(p, foreach=False),
        torch.optim.AdamW(p, foreach=True),
        torch.optim.SGD(p, momentum=0.9),
    )
    adapter = OptimizerAdapter([adam_loop, adam_foreach, sgd])
    adapter.prepare("cpu")
    assert adapter.live_keys(adam_loop) == {"lr", "eps", "betas[0]"}
    assert adapter.live_keys(adam_foreach) == {"lr"} and adapter.live_keys(sgd) == set()
    assert adapter.can_stay_in_graph(adam_loop, "betas[0]") and not adapter.can_stay_in_graph(
        adam_loop, "betas"
    )
    assert not adapter.can_stay_in_graph(adam_foreach, "weight_decay")
    for key in ("initial_lr", "max_lr", "base_momentum", "max_momentum"):  # scheduler bookkeeping
        assert adapter.can_stay_in_graph(sgd, key)
    assert not adapter.can_stay_in_graph(sgd, "momentum") and "momentum" in adapter.why_baked(sgd, "momentum")


def test_baked_hyperparameters_leave_tensors_out_but_keep_the_numbers_beside_them():
    lr, beta1 = torch.tensor(0.1), torch.tensor(0.9)
    group = {"params": [], "lr": lr, "betas": (beta1, 0.99), "eps": 1e-8, "foreach": None}
    baked = baked_hyperparameters(group)
    assert baked == {"betas": ("<device tensor>", 0.99), "eps": 1e-8, "foreach": None}
    group["betas"] = (torch.tensor(0.5), 0.98)  # another tensor: not compared; the number is
    assert baked_hyperparameters(group)["betas"] != baked["betas"]


def test_onecycle_betas_tuples_are_absorbed_by_the_step_pre_hook(capturable_cpu):
    """An eager loop after make_capturable needs no per-step call: OneCycleLR assigns a new
    (float, float) betas tuple every step; the pre-hook writes beta1 into the live tensor."""
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    make_capturable(opt, "cpu")
    scheduler = sched.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    step = train_step(model, opt)
    step(*batches(1)[0])
    beta1 = opt.param_groups[0]["betas"][0]
    assert isinstance(beta1, torch.Tensor) and opt.param_groups[0]["betas"][1] == 0.999
    for x, y in batches(5):
        scheduler.step()
        assigned = opt.param_groups[0]["betas"][0]
        assert isinstance(assigned, float)
        step(x, y)
        assert opt.param_groups[0]["betas"][0] is beta1
        assert beta1.item() == torch.tensor(assigned, dtype=torch.float32).item()


def test_a_float_assigned_inside_the_captured_step_is_an_error(capturable_cpu):
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)

    def step(x, y):
        opt.param_groups[0]["lr"] = 1e-3  # baked at capture: refused there
        return train_step(model, opt)(x, y)

    captured = graphstep.capture(step, model=model, optimizer=opt, config=RECORDING)
    data = batches(4)
    for x, y in data[:3]:
        captured(x, y)  # warm-up: eager, the pre-hook copies the float into the tensor
    with pytest.raises(GraphStepError, match="inside the captured step"):
        captured(*data[3])


def test_adam_for_loop_made_capturable_warns_about_nan_at_lr_zero(capturable_cpu, caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        make_capturable(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=False), "cpu")
        make_capturable(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True), "cpu")
    warned = [r for r in caplog.records if "126514" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_what_cannot_work_is_refused_clearly_and_what_runs_eagerly_is_named(capturable_cpu):
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(UnsupportedOptimizerError, match="closure"):
        OptimizerAdapter([torch.optim.LBFGS(p)], allow_eager=True)
    adafactor = torch.optim.Adafactor(p)
    with pytest.raises(UnsupportedOptimizerError, match=r"\.item\(\)"):
        OptimizerAdapter([adafactor])
    adapter = OptimizerAdapter([adafactor], allow_eager=True)
    adapter.prepare("cpu")
    assert ".item()" in adapter.eager_only(adafactor) and plan(adafactor, "cpu")[0].live == {}
