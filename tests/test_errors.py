"""Failures during capture: a clear error at the user's line, and nothing lost."""

from __future__ import annotations

import pytest
import torch

import graphstep
from cpu_common import batches, same_params, sgd_step
from graphstep.errors import CaptureError, HostSyncError

RECORDING = graphstep.Config(backend="recording", warmup_steps=2)


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return params, grads, state


def assert_unchanged(before, model, opt):
    params, grads, state = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(g is p.grad for g, p in zip(grads, model.parameters()))
    for p, s in opt.state.items():
        assert all(torch.equal(state[id(p)][k], v) for k, v in s.items())


def test_item_in_the_step_fails_capture_at_the_users_line_and_loses_nothing(twins):
    (m_e, o_e), (model, opt) = twins
    inner = sgd_step(model, opt)
    sync = {"on": False}

    def fn(x, y):
        loss = inner(x, y)
        if sync["on"]:
            print(loss.item())  # the host sync
        return loss

    step = graphstep.capture(fn, model=model, optimizer=opt, config=RECORDING)
    data = batches(8)
    torch.manual_seed(3)
    graphed = [step(*data[0]), step(*data[1])]
    before = snapshot(model, opt)
    rng = torch.get_rng_state()
    sync["on"] = True
    with pytest.raises(HostSyncError) as info:
        step(*data[2])
    message = str(info.value)
    assert "test_errors.py" in message and "print(loss.item())" in message, message
    assert "Keep values on the device" in message and "Nothing was lost" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_unchanged(before, model, opt)
    assert torch.equal(torch.get_rng_state(), rng)
    sync["on"] = False
    graphed += [step(x, y) for x, y in data[2:]]

    torch.manual_seed(3)
    eager_fn = sgd_step(m_e, o_e)
    eager = [eager_fn(x, y) for x, y in data]
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert same_params(m_e, model)
    assert step.stats.captures == 1


def test_any_other_capture_failure_is_a_capture_error_with_the_cause_chained(twins):
    (_, _), (model, opt) = twins
    inner = sgd_step(model, opt)
    calls = {"n": 0}

    def fn(x, y):
        calls["n"] += 1
        loss = inner(x, y)
        if calls["n"] == 3:
            raise ValueError("boom in the user's code")
        return loss

    step = graphstep.capture(fn, model=model, optimizer=opt, config=RECORDING)
    data = batches(3)
    step(*data[0])
    step(*data[1])
    before = snapshot(model, opt)
    with pytest.raises(CaptureError, match="boom in the user's code") as info:
        step(*data[2])
    assert isinstance(info.value.__cause__, ValueError)
    assert_unchanged(before, model, opt)


def test_errors_are_graphstep_errors():
    for name in (
        "CaptureError",
        "HostSyncError",
        "TooManyGraphsError",
        "UnsupportedOutputError",
        "ClosedError",
    ):
        assert issubclass(getattr(graphstep.errors, name), graphstep.GraphStepError)


def test_a_backward_on_the_default_stream_names_ddp_and_deepspeed_with_the_way_out():
    """CUDA refuses a backward whose hooks were made on the default stream ("operation would make the
    legacy stream depend on a capturing blocking stream"): DDP's and DeepSpeed's engine's are (seen on an
    H100 with deepspeed 0.19.8). The error names both and how to build them. The CUDA error is raised by
    hand here, at capture, from the step itself."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"n": 0}

    def fn(x, y):
        calls["n"] += 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if calls["n"] == 3:
            raise RuntimeError(
                "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
            )
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = graphstep.capture(fn, model=model, optimizer=opt, config=RECORDING)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    step(x, y)
    step(x, y)
    with pytest.raises(CaptureError, match=r"DeepSpeed engine.*capture_stream\(\)") as info:
        step(x, y)
    assert "deepspeed.initialize" in str(info.value) and "DistributedDataParallel" in str(info.value)
