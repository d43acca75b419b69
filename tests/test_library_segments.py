"""Library calls that read the host, on the CPU recording backend (it refuses host syncs at capture
as a CUDA graph does): the self-contained ones run as eager segments, automatically and bitwise
equal to eager (GradScaler.step with any optimizer, clip_grad_norm_ with error_if_nonfinite=True);
the others are refused with what to write instead."""

from __future__ import annotations

import copy
import logging
import traceback

import pytest
import torch
import torch.nn.functional as F

import graphstep
from cpu_common import TinyNet, batches, same_params
from graphstep.diagnostics import host_sync_hint
from graphstep.errors import HostSyncError
from graphstep.optim import make_capturable

N_STEPS = 20
INF_CALLS = (3, 9, 14)  # call 3 is the capturing call (warmup_steps=3): its step is skipped too


def recording(**options) -> graphstep.Config:
    return graphstep.Config(backend="recording", warmup_steps=3, **options)


def twins(make_opt):
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    pairs = []
    for m in (model, twin):
        opt = make_opt(m.parameters())
        make_capturable(opt, "cpu")  # the settings graphstep gives the captured one
        pairs.append((m, opt))
    return pairs


def scaled_step(model, opt, scaler, *, unscale: bool):
    def step(x, y, boost):  # boost: () float32, 1 or 1e30 (then the fp16 grads overflow)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss * boost).backward()
        if unscale:  # the recipe for clipping unscaled gradients
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    return step


def scaled_data(inf_calls=INF_CALLS):
    return [
        (x, y, torch.tensor(1e30 if i in inf_calls else 1.0)) for i, (x, y) in enumerate(batches(N_STEPS))
    ]


OPTIMIZERS = {
    "SGD foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "SGD for-loop": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "AdamW default": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


@pytest.mark.parametrize("unscale", [False, True], ids=["step-only", "unscale-clip-step"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_with_an_unfused_optimizer_runs_its_step_as_a_segment_equal_to_eager(
    name, unscale, caplog
):
    (m_e, o_e), (m_g, o_g) = twins(OPTIMIZERS[name])
    s_e = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    s_g = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    eager = scaled_step(m_e, o_e, s_e, unscale=unscale)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = graphstep.capture(
            scaled_step(m_g, o_g, s_g, unscale=unscale), model=m_g, optimizer=o_g, config=recording()
        )
        for i, args in enumerate(scaled_data()):
            torch.manual_seed(i)  # the same dropout masks
            want = eager(*args)
            torch.manual_seed(i)
            got = step(*args)
            assert torch.equal(want, got), f"call {i}: loss {got} != eager {want}"
            assert s_e.get_scale() == s_g.get_scale(), (
                f"call {i}: scale {s_g.get_scale()} != {s_e.get_scale()}"
            )
            assert same_params(m_e, m_g), f"call {i}: parameters differ"
    assert torch.equal(s_e._growth_tracker, s_g._growth_tracker)
    assert all(
        torch.equal(o_e.state[p]["step"], o_g.state[q]["step"])
        for p, q in zip(m_e.parameters(), m_g.parameters())
        if "step" in o_e.state[p]
    )
    assert step.stats.captures == 1 and step.stats.replays == N_STEPS - 4
    lines = [r.message for r in caplog.records if "eager segment" in r.message]
    optimizer = type(o_g).__qualname__
    assert len(lines) == 1 and f"GradScaler.step({optimizer})" in lines[0] and "fused=True" in lines[0], lines
    assert "1 wait for the GPU" in lines[0] and "ms of host time" in lines[0], lines[0]


def test_the_scaler_skips_and_backs_off_at_the_overflowing_calls():
    """The inf calls really overflow: eager's scale halves there and the parameters stay."""
    (m_e, o_e), (m_g, o_g) = twins(OPTIMIZERS["AdamW default"])
    s_e = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    s_g = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    eager = scaled_step(m_e, o_e, s_e, unscale=False)
    step = graphstep.capture(
        scaled_step(m_g, o_g, s_g, unscale=False), model=m_g, optimizer=o_g, config=recording()
    )
    for i, args in enumerate(scaled_data()):
        before = [p.clone() for p in m_g.parameters()]
        scale = s_g.get_scale()
        torch.manual_seed(i)
        eager(*args)
        torch.manual_seed(i)
        step(*args)
        skipped = all(torch.equal(a, b) for a, b in zip(before, m_g.parameters()))
        assert skipped == (i in INF_CALLS), f"call {i}: skipped={skipped}"
        if i in INF_CALLS:
            assert s_g.get_scale() == scale / 2, f"call {i}: no back-off"
    assert same_params(m_e, m_g) and step.stats.replays == N_STEPS - 4


def test_the_eager_segment_leaves_a_fused_optimizer_in_the_graph(caplog):
    (_, _), (model, opt) = twins(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with caplog.at_level(logging.INFO, logger="graphstep"):
        step = graphstep.capture(
            scaled_step(model, opt, scaler, unscale=False), model=model, optimizer=opt, config=recording()
        )
        for args in scaled_data()[:6]:
            step(*args)
    assert step.stats.replays == 2 and "eager segment" not in caplog.text


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_an_optimizer_whose_step_moved_to_a_segment_is_scaled_as_eager(fused):
    """SGD with momentum cycling: its step runs as an eager segment (momentum is baked). Fused, GradScaler
    hands it `grad_scale` and `found_inf` only during the call: the segment must set them at replay.
    Foreach, GradScaler's own segment calls the optimizer's: one segment, not one inside another."""
    (m_e, o_e), (m_g, o_g) = twins(
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=fused, foreach=not fused)
    )
    scheds, scalers = [], []
    for opt in (o_e, o_g):
        scheds.append(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=N_STEPS + 1))
        scalers.append(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    eager = scaled_step(m_e, o_e, scalers[0], unscale=False)
    step = graphstep.capture(
        scaled_step(m_g, o_g, scalers[1], unscale=False), model=m_g, optimizer=o_g, config=recording()
    )
    for i, args in enumerate(scaled_data(inf_calls=(9, 14))):  # the capture steps
        torch.manual_seed(i)
        want = eager(*args)
        torch.manual_seed(i)
        assert torch.equal(want, step(*args)), f"call {i}"
        assert same_params(m_e, m_g), f"call {i}: parameters differ"
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"call {i}"
        for s in scheds:
            s.step()
    assert step.stats.captures == 1 and step.stats.replays == N_STEPS - 4


def test_explain_names_the_segment_not_a_host_sync():
    (_, _), (model, opt) = twins(OPTIMIZERS["SGD foreach"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = graphstep.capture(
        scaled_step(model, opt, scaler, unscale=False), model=model, optimizer=opt, config=recording()
    )
    report = graphstep.explain(step, *scaled_data()[0])
    segments = [h for h in report.hazards if "eager segment" in h]
    assert len(segments) == 1 and "GradScaler.step(SGD)" in segments[0], report.hazards
    assert not any(h.startswith("host sync") for h in report.hazards), report.hazards


def test_outside_graphstep_the_calls_are_torchs_own():
    """The patches live only while a step warms up or captures."""
    assert torch.amp.GradScaler._maybe_opt_step.__module__ == "torch.amp.grad_scaler"
    assert torch.nn.utils.clip_grad._get_total_norm.__module__ == "torch.nn.utils.clip_grad"


# -- clip_grad_norm_(error_if_nonfinite=True) -----------------------------------------------------------


def clipped_step(model, opt):
    def step(x, y, boost):  # boost: () float32, 1 or inf (then the gradients are not finite)
        loss = F.mse_loss(model(x), y)
        (loss * boost).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad()
        return loss, norm

    return step


def test_clip_grad_norm_with_error_if_nonfinite_checks_in_a_segment_and_raises_where_eager_does(caplog):
    (m_e, o_e), (m_g, o_g) = twins(OPTIMIZERS["SGD foreach"])
    eager = clipped_step(m_e, o_e)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = graphstep.capture(clipped_step(m_g, o_g), model=m_g, optimizer=o_g, config=recording())
        bad = 11
        for i, (x, y) in enumerate(batches(N_STEPS)):
            boost = torch.tensor(float("inf") if i == bad else 1.0)
            outcomes = []
            for fn, opt in ((eager, o_e), (step, o_g)):
                torch.manual_seed(i)
                try:
                    outcomes.append(fn(x, y, boost))
                except RuntimeError as exc:
                    outcomes.append(exc)
                    opt.zero_grad()  # the user's recovery: drop this step's gradients
            want, got = outcomes
            if i == bad:
                assert isinstance(want, RuntimeError) and isinstance(got, RuntimeError), outcomes
                assert str(got) == str(want) and "non-finite" in str(got)  # torch's own error
            else:
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), f"call {i}"
            assert same_params(m_e, m_g), f"call {i}: parameters differ"
    assert step.stats.captures == 1 and step.stats.replays == N_STEPS - 5  # the raising replay is not counted
    lines = [r.message for r in caplog.records if "eager segment" in r.message]
    assert len(lines) == 1 and "clip_grad_norm_(error_if_nonfinite=True)" in lines[0], lines


def test_clip_grad_norm_without_the_check_stays_in_one_graph(caplog):
    (_, _), (model, opt) = twins(OPTIMIZERS["SGD foreach"])

    def step(x, y):
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    with caplog.at_level(logging.INFO, logger="graphstep"):
        captured = graphstep.capture(step, model=model, optimizer=opt, config=recording())
        for x, y in batches(5):
            captured(x, y)
    assert captured.stats.replays == 1 and "eager segment" not in caplog.text


# -- AveragedModel (SWA, EMA) ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_an_averaged_model_updated_in_the_step_runs_as_a_segment_equal_to_eager(kind, caplog):
    (m_e, o_e), (m_g, o_g) = twins(OPTIMIZERS["SGD foreach"])
    extra = {"multi_avg_fn": torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)} if kind == "ema" else {}
    avg_e, avg_g = (torch.optim.swa_utils.AveragedModel(m, **extra) for m in (m_e, m_g))

    def make(model, opt, averaged):
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            averaged.update_parameters(model)
            return loss

        return step

    eager = make(m_e, o_e, avg_e)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = graphstep.capture(make(m_g, o_g, avg_g), model=m_g, optimizer=o_g, config=recording())
        for i, (x, y) in enumerate(batches(12)):
            torch.manual_seed(i)
            want = eager(x, y)
            torch.manual_seed(i)
            assert torch.equal(want, step(x, y)), f"call {i}"
    assert same_params(avg_e, avg_g) and same_params(m_e, m_g)
    assert int(avg_g.n_averaged) == 12 and step.stats.replays == 8
    assert "AveragedModel.update_parameters runs as an eager segment" in caplog.text


# -- hints where a segment cannot help ------------------------------------------------------------------


def refused(step, *args, model=None, opt=None, **options) -> str:
    captured = graphstep.capture(step, model=model, optimizer=opt, config=recording(**options))
    for _ in range(3):
        captured(*args)  # warm-up runs eagerly: host syncs are judged at capture
    with pytest.raises(HostSyncError) as info:
        captured(*args)
    return str(info.value)


@pytest.fixture
def validating():
    """Distributions validate their arguments, as by default. torch.compile turns that off for the
    whole process the first time it runs (dynamo's `TorchPatcher`), so a test earlier in the same
    process (test_vote.py compiles) would otherwise decide what this one sees."""
    was = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(was)


def test_distribution_validation_names_validate_args(validating):
    policy = torch.nn.Linear(4, 2)

    def step(obs, action):  # obs: (B, 4), action: (B, 2)
        d = torch.distributions.Normal(policy(obs), torch.ones(2))
        return -d.log_prob(action).mean()

    message = refused(step, torch.randn(3, 4), torch.randn(3, 2), model=policy)
    assert "validate_args=False" in message and "set_default_validate_args(False)" in message, message
    assert "Normal(policy(obs)" in message, message  # the user's line


def test_distribution_validation_off_is_captured():
    policy = torch.nn.Linear(4, 2)

    def step(obs, action):
        d = torch.distributions.Normal(policy(obs), torch.ones(2), validate_args=False)
        return -d.log_prob(action).mean()

    captured = graphstep.capture(step, model=policy, config=recording())
    obs, action = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(5):
        got = captured(obs, action)
    assert torch.equal(got, step(obs, action)) and captured.stats.replays == 1


def test_boolean_mask_indexing_names_ignore_index_and_where():
    head = torch.nn.Linear(4, 5)

    def step(x, labels):  # x: (N, 4), labels: (N,) with -100 at padding
        logits = head(x)
        keep = labels != -100
        return F.cross_entropy(logits[keep], labels[keep])

    labels = torch.tensor([1, -100, 3, 0])
    message = refused(step, torch.randn(4, 4), labels, model=head)
    assert "ignore_index" in message and "torch.where" in message, message
    assert "logits[keep]" in message, message


class ConvNet(torch.nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8, momentum=momentum)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 4)
        return self.head(torch.relu(self.norm(self.fc(x))))


def test_batchnorm_with_a_cumulative_average_names_the_module_and_the_momentum():
    """BatchNorm(momentum=None) divides by num_batches_tracked read on the host in every training
    forward: the error names the module by its qualified name and says to give it a momentum."""
    model = ConvNet(momentum=None)

    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    message = refused(step, torch.randn(6, 4), model=model, graph_breaks="off")  # else: a graph break
    assert "`model.norm` (BatchNorm1d(momentum=None))" in message, message
    assert "num_batches_tracked" in message and "momentum=0.1" in message, message
    assert "eval mode" in message and "update_bn" in message, message


def test_batchnorm_with_a_momentum_is_captured_and_equal_to_eager():
    torch.manual_seed(0)
    model = ConvNet(momentum=0.1)
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]

    def make(m, opt):
        def step(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    eager = make(model, opts[0])
    captured = graphstep.capture(make(twin, opts[1]), model=twin, optimizer=opts[1], config=recording())
    for x in [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]:
        assert torch.equal(eager(x), captured(x))
    assert captured.stats.replays == 2 and torch.equal(model.norm.running_var, twin.norm.running_var)


def test_item_for_logging_names_returning_the_tensor():
    model = torch.nn.Linear(4, 1)
    logged = []

    def step(x):
        loss = model(x).pow(2).mean()
        logged.append(loss.item())
        return loss

    message = refused(step, torch.randn(3, 4), model=model)
    assert "return the tensor" in message and "logged.append(loss.item())" in message, message


def test_tolist_for_logging_names_returning_the_tensor():
    """On a GPU tolist() copies to the host: the hint as a CUDA capture's error reaches it (the recording
    backend refuses it too: tests/test_recording_backend.py)."""
    frames = [traceback.FrameSummary("/home/me/train.py", 9, "step", line="log.append(out.mean(0).tolist())")]
    hint = host_sync_hint(frames, "CUDA error: operation not permitted when stream is capturing")
    assert "return the tensor" in hint and ".tolist()" in hint, hint


def test_a_copy_of_pageable_cpu_memory_to_the_gpu_names_pinning():
    """No GPU here: the hint as a CUDA capture's error and traceback reach it."""
    frames = [traceback.FrameSummary("/home/me/train.py", 12, "step", line="x = batch.to('cuda')")]
    hint = host_sync_hint(frames, "CUDA error: operation not permitted when stream is capturing")
    assert "pin" in hint and "non_blocking=True" in hint and "before calling the step" in hint, hint


def test_a_line_with_no_known_pattern_gets_no_hint():
    frames = [traceback.FrameSummary("/home/me/train.py", 12, "step", line="y = model(x)")]
    assert host_sync_hint(frames, "operation not permitted when stream is capturing") is None


# -- the PPO example --------------------------------------------------------------------------------


def test_the_ppo_examples_update_captures(monkeypatch):
    """examples/rl_ppo.py's update, captured on the recording backend, which refuses host syncs as a
    CUDA capture does (its distributions' argument validation was one). On a GPU graphstep makes the
    example's Adam capturable; on the CPU the graph-safe Adam is the fused one."""
    import argparse
    import functools
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "rl_ppo.py"
    spec = importlib.util.spec_from_file_location("rl_ppo_example", path)
    ppo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ppo)
    capture = graphstep.capture
    steps = []

    def recorded(fn, **options):
        steps.append(capture(fn, config=recording(), **options))
        return steps[-1]

    monkeypatch.setattr(graphstep, "capture", recorded)
    monkeypatch.setattr(torch.optim, "Adam", functools.partial(torch.optim.Adam, fused=True))
    args = argparse.Namespace(envs=16, horizon=8, epochs=2, minibatches=2, clip=0.2)
    ppo.train(torch.device("cpu"), 6, args, captured=True)
    assert steps[0].stats.captures == 1 and steps[0].stats.replays == 2
