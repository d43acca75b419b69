"""A `torch.compile`d model inside a captured step (CPU: dynamo with the "aot_eager" backend, graphs on
the recording backend). Whatever the capture runs is compiled in the warm-ups; a warm-up that still
compiled is followed by another; a frame that would compile during the capture is found before it
compiles, and that call warms up instead, or the error names the guard. Bitwise against the same
compiled model stepped eagerly."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
from torch import nn

import graphstep
from graphstep.backends import compiled
from graphstep.errors import CompileAtCaptureError

pytestmark = pytest.mark.skipif(
    not compiled.MODES_KEEP_COMPILED,
    reason="torch < 2.9 runs compiled frames uncompiled under the recording backend's dispatch mode",
)

ACTIVATION = "tanh"
"""Read by `Stack.forward`: dynamo guards on its value."""


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8)
        # Slicing makes a new ModuleList (and registers its modules) every call, as transformers'
        # models do with their layers: graphstep's registration hook runs inside the traced code.
        for layer in self.layers[: len(self.layers)]:
            x = layer(x)
            x = torch.tanh(x) if ACTIVATION == "tanh" else torch.relu(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setitem(globals(), "ACTIVATION", "tanh")
    yield
    torch._dynamo.reset()


def twins() -> list[tuple[nn.Module, torch.optim.Optimizer, nn.Module]]:
    """(model, optimizer, compiled model) twice, identical at the start."""
    torch.manual_seed(0)
    model = Stack()
    out = []
    for m in (model, copy.deepcopy(model)):
        out.append(
            (m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), torch.compile(m, backend="aot_eager"))
        )
    return out


def make_step(model: nn.Module, opt: torch.optim.Optimizer, forward: nn.Module):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x: (B, 8), y: (B, 1)
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def frames() -> int:
    return torch._dynamo.utils.counters["frames"]["total"]


def run(n: int, config: graphstep.Config, before_call=None) -> tuple[graphstep.CapturedStep, list[int]]:
    """n calls of the captured step and of its eager twin (same compiled code, same data), bitwise
    compared; returns the captured step and the frames dynamo compiled in each of its calls."""
    (m_e, o_e, f_e), (m_g, o_g, f_g) = twins()
    graphstep.optim.make_capturable(o_e, "cpu")  # the settings graphstep gives the captured one
    eager = make_step(m_e, o_e, f_e)
    step = graphstep.capture(make_step(m_g, o_g, f_g), model=m_g, optimizer=o_g, config=config)
    compiled_per_call = []
    for i, (x, y) in enumerate(data(n)):
        if before_call is not None:
            before_call(i)
        start = frames()
        got = step(x, y)  # first: the twin shares its compiled code (same class), and must not warm it
        compiled_per_call.append(frames() - start)
        want = eager(x, y)
        assert torch.equal(want, got), f"call {i}: eager {want.item()!r} != graphstep {got.item()!r}"
    for p, q in zip(m_e.parameters(), m_g.parameters()):
        assert torch.equal(p, q)
    return step, compiled_per_call


def test_a_compiled_model_compiles_in_the_first_warm_up_only():
    # Before: graphstep's module-registration hook, traced, made dynamo guard on graphstep's epoch
    # counter, which every forward advanced: a recompile in every warm-up and in the capture.
    step, compiled_per_call = run(6, graphstep.Config(backend="recording", warmup_steps=3))
    assert step.stats.warmup_calls == 3 and step.stats.captures == 1 and step.stats.replays == 2
    assert compiled_per_call[0] > 0 and compiled_per_call[1:] == [0] * 5, compiled_per_call


def test_a_warm_up_that_compiled_is_followed_by_another_before_the_capture(caplog):
    with caplog.at_level(logging.INFO, logger="graphstep"):
        step, compiled_per_call = run(4, graphstep.Config(backend="recording", warmup_steps=1))
    # Warm-up 1 compiled, so a capture after it could have found code still to compile: one more.
    assert step.stats.warmup_calls == 2 and step.stats.captures == 1, step.stats
    assert compiled_per_call[1:] == [0, 0, 0]
    assert "torch.compile compiled in the last warm-up (1 frame); one more warm-up" in caplog.text


def test_a_frame_that_would_compile_at_capture_warms_up_instead(caplog):
    # The value dynamo guards on changes just before the call that captures: the capture stops
    # before dynamo compiles anything, that call warms up instead, and a later one captures.
    def switch(i: int) -> None:
        if i == 3:
            globals()["ACTIVATION"] = "relu"

    with caplog.at_level(logging.INFO, logger="graphstep"):
        step, compiled_per_call = run(8, graphstep.Config(backend="recording", warmup_steps=3), switch)
    assert "torch.compile would compile during the capture" in caplog.text
    assert "ACTIVATION" in caplog.text  # the guard that failed, as dynamo words it
    assert "This call runs as one more warm-up instead" in caplog.text
    # warm-ups 1-3, the capture that stopped (a warm-up, which compiled), one more (it compiled
    # nothing), then the capture.
    assert step.stats.warmup_calls == 5 and step.stats.captures == 1 and step.stats.replays == 2, step.stats
    assert compiled_per_call == [compiled_per_call[0], 0, 0, 1, 0, 0, 0, 0], compiled_per_call


def test_a_guarded_value_that_changes_on_every_call_is_named():
    (m, opt, forward), _ = twins()
    step = graphstep.capture(
        make_step(m, opt, forward), model=m, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    batches = data(12)
    with pytest.raises(CompileAtCaptureError) as caught:
        for i, (x, y) in enumerate(batches):
            globals()["ACTIVATION"] = f"tanh{i}"  # never the same twice: dynamo recompiles every call
            step(x, y)
    text = str(caught.value)
    assert "torch.compile would compile during the capture" in text and "ACTIVATION" in text
    assert "It did again, after one more warm-up" in text and "Nothing was lost" in text
    # warm-ups 1-3 and 2 more (each still compiled); the capture gives way to a warm-up, and 2 more
    # follow (each still compiled); the next capture raises.
    assert i == 8 and step.stats.warmup_calls == 8 and step.stats.captures == 0, (i, step.stats)


def test_compile_count_reads_dynamo_counters_without_importing_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils")
    assert compiled.CompileCount().since() is compiled.NOTHING


@pytest.fixture
def nothing_compiled():
    """dynamo's counters as in a process that has compiled nothing (`reset()` keeps them), then back."""
    from torch._dynamo.utils import counters

    kept = {key: counter.copy() for key, counter in counters.items()}
    counters.clear()
    yield
    counters.clear()
    counters.update(kept)


def test_the_watches_hooks_are_wrapped_against_dynamo_only_once_it_has_compiled(nothing_compiled):
    """`torch.compiler.disable` costs each event of a watch's hook (some 200,000 in a tiny GPT's capture):
    only needed where dynamo's frame callback can be on, around code it compiled. graphstep imports dynamo
    itself, so being imported says nothing."""
    from graphstep.guards.compiling import frames_compiled, unseen

    def hook(frame, event, arg):
        return None

    assert "torch._dynamo" in sys.modules and frames_compiled() == 0
    assert unseen(hook) is hook
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert frames_compiled() > 0 and unseen(hook) is not hook


USE_COMPILED = False
"""Read by the step below: the compiled model from the call that captures on."""


def test_a_compiled_model_first_called_inside_the_capture_with_the_hooks_unwrapped(
    nothing_compiled, monkeypatch
):
    """Nothing compiled before the capture, so the watches' hooks run unwrapped while dynamo's frame
    callback is on for the first time, around the compiled model the capture calls first (on the CPU
    dynamo compiles it there: a first compilation is no recompile). The hooks' frames are not compiled
    and the watches keep working: one capture, replays, bitwise against the same switch made eagerly."""
    (m, opt, forward), (m_e, opt_e, forward_e) = twins()

    def make(model, opt, forward):
        def step(x, y):
            out = forward(x) if USE_COMPILED else model(x)
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    config = graphstep.Config(backend="recording", warmup_steps=2)
    step = graphstep.capture(make(m, opt, forward), model=m, optimizer=opt, config=config)
    eager = make(m_e, opt_e, forward_e)
    for i, (x, y) in enumerate(data(9)):
        if i == 2:  # the call that captures
            monkeypatch.setitem(globals(), "USE_COMPILED", True)
        want, got = eager(x, y), step(x, y)
        assert torch.equal(want, got), f"call {i}"
    assert step.stats.captures == 1 and step.stats.replays == 6, step.stats
    for p, q in zip(m_e.parameters(), m.parameters()):
        assert torch.equal(p, q)
