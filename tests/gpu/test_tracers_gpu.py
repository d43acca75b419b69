"""On a GPU, under each tracer the watches can use (guards/tracing.py: `sys.settrace`/`sys.setprofile`,
and on Python >= 3.12 `sys.monitoring` with events on the watched code objects only): the captured
GPT trains bitwise like eager, a Python write in the user's step and one in a library's module are
refused with their lines and nothing lost, and a global a helper reads is guarded."""

from __future__ import annotations

import types

import pytest
import torch
from gpu_common import (
    assert_same_losses,
    assert_same_params,
    batches,
    deterministic,
    gpt_pair,
    needs_cuda,
    run,
    train_step,
)

import graphstep
from graphstep.errors import PythonWriteError
from graphstep.guards import tracing

pytestmark = needs_cuda
STEPS = 8
PROGRESS = types.SimpleNamespace(steps=0)
SCALE = 1.0  # a global a helper reads: guarded


@pytest.fixture(params=tracing.available())
def tracer(request, monkeypatch):
    monkeypatch.setenv("GRAPHSTEP_TRACER", request.param)
    return request.param


def test_the_gpt_trains_bitwise_like_eager(tracer):
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(STEPS)
    with deterministic():
        eager = run(train_step(m_e, o_e), data)
        captured = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g)
        graphed = run(captured, data)
    assert_same_losses(eager, graphed)
    assert_same_params(m_e, m_g)
    assert captured.stats.captures == 1 and captured.stats.warmup_calls == 3
    captured.close()


class Counting(torch.nn.Module):
    """A library-style wrapper that counts its calls in Python."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1  # the refused write, in a module
        return self.inner(x, y)


@pytest.mark.parametrize("where", ["step", "module"])
def test_a_python_write_is_refused_with_its_line_and_nothing_is_lost(tracer, where):
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    model = Counting(m_g) if where == "module" else m_g
    data = batches(4)
    PROGRESS.steps = 0

    def step_of(model, opt, counted):
        def step(x, y):
            if counted:
                PROGRESS.steps += 1  # the refused write, in the step
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    step = step_of(model, o_g, where == "step")
    with deterministic():
        eager = step_of(m_e, o_e, False)
        for x, y in data[:3]:
            eager(x, y)
        captured = graphstep.capture(
            step, model=model, optimizer=o_g, config=graphstep.Config(graph_breaks="off")
        )
        for x, y in data[:3]:
            captured(x, y)
        with pytest.raises(PythonWriteError) as info:
            captured(*data[3])
    text = str(info.value)
    if where == "step":
        assert "PROGRESS.steps += 1" in text and "3 -> 4" in text, text
        assert PROGRESS.steps == 3
    else:
        assert "self.calls += 1" in text and "3 -> 4" in text, text
        assert model.calls == 3
    assert "test_tracers_gpu.py" in text, text
    assert_same_params(m_e, m_g)  # the capture's step undone: three steps each
    for p, q in zip(m_e.parameters(), m_g.parameters()):
        for key, value in o_e.state[p].items():
            assert torch.equal(value, o_g.state[q][key]), f"optimizer state {key!r} differs"
    captured.close()


def scaled(loss):
    return loss * SCALE


def test_a_global_a_helper_reads_is_guarded(tracer):
    global SCALE
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(STEPS)

    def step_of(model, opt):
        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = scaled(model(x, y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    eager, graphed = [], []
    try:
        with deterministic():
            eager_step = step_of(m_e, o_e)
            captured = graphstep.capture(step_of(m_g, o_g), model=m_g, optimizer=o_g)
            for i, (x, y) in enumerate(data):
                SCALE = 1.0 if i < STEPS // 2 else 0.5
                eager.append(eager_step(x, y))
                graphed.append(captured(x, y))
    finally:
        SCALE = 1.0
    assert_same_losses(eager, graphed)
    assert_same_params(m_e, m_g)
    assert captured.stats.captures + captured.stats.variants >= 2  # the new value: its own graph
    captured.close()
