"""A capture that runs out of GPU memory: that call runs as an eager step, the next captures again;
twice in a row is a clear `CaptureError`. The recording backend stands in for the graph; the GPU test
(tests/gpu/test_memory_pressure_gpu.py) runs out of memory for real."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import graphstep
from cpu_common import make_twins, plain_step
from graphstep.errors import CaptureError

RECORDING = graphstep.Config(backend="recording")


def running_out_at(model: torch.nn.Module, forwards: set[int]) -> None:
    """`model.fc1` raises torch's out-of-memory error on the forwards numbered in `forwards` (from 0)."""
    count = itertools.count()  # advanced by a call, not a Python write the capture would refuse

    def hook(module, inputs, output):
        if next(count) in forwards:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    model.fc1.register_forward_hook(hook)


def data(n: int) -> list:
    torch.manual_seed(0)
    return [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(n)]


def test_out_of_memory_at_capture_runs_the_call_eagerly_and_captures_on_the_next(caplog):
    (m_e, o_e), (m_g, o_g) = make_twins()
    running_out_at(m_g, {3})  # calls 0-2 warm up; call 3 captures and runs out
    eager = plain_step(m_e, o_e)
    step = graphstep.capture(plain_step(m_g, o_g), model=m_g, optimizer=o_g, config=RECORDING)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(data(8)):
            torch.manual_seed(i)
            want = eager(x, y)
            torch.manual_seed(i)
            assert torch.equal(want, step(x, y)), f"call {i}"
    for p, q in zip(m_e.parameters(), m_g.parameters()):
        assert torch.equal(p, q)
    assert step.stats.warmup_calls == 4 and step.stats.captures == 1 and step.stats.replays == 3
    assert "ran out of memory while capturing" in caplog.text
    assert step.stats.graph_breaks == 0  # not mistaken for an operation no graph can record


def test_out_of_memory_in_two_captures_in_a_row_raises_and_loses_nothing():
    (m_e, o_e), (m_g, o_g) = make_twins()
    # Forwards 0-2 warm up; 3 is call 3's capture (then its eager step, forward 4); 5 is call 4's capture.
    running_out_at(m_g, {3, 5})
    eager = plain_step(m_e, o_e)
    step = graphstep.capture(plain_step(m_g, o_g), model=m_g, optimizer=o_g, config=RECORDING)
    batches = data(5)
    for i, (x, y) in enumerate(batches[:4]):
        for fn in (eager, step):
            torch.manual_seed(i)  # the same dropout masks
            fn(x, y)
    before = [p.detach().clone() for p in m_g.parameters()]
    torch.manual_seed(4)
    with pytest.raises(CaptureError, match="ran out of memory") as raised:
        step(*batches[4])
    assert "previous capture ran out of memory too" in str(raised.value)
    assert all(torch.equal(p, q) for p, q in zip(before, m_g.parameters()))  # nothing of call 4 left
    for fn in (eager, step):  # called again, the step captures
        torch.manual_seed(4)
        fn(*batches[4])
    assert step.stats.captures == 1
    for p, q in zip(m_e.parameters(), m_g.parameters()):
        assert torch.equal(p, q)
