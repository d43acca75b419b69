"""A captured step follows TE's amax buffers (graphstep.integrations.transformer_engine), on the CPU's
recording backend.

Transformer Engine needs CUDA, so TE itself is not here: a stand-in keeps TE's bookkeeping as TE 2.20 does
(`FP8GlobalStateManager.quantization_state.global_amax_buffer`: per recipe key, the list of registered
modules' current amax tensors; a module registers at its first forward and writes its amax there; the
reduction at a grad-enabled `te.autocast`'s exit updates every registered tensor, skipping one whose
current amax is 0, as TE's kernel does, and zeroes it), compiled under a site-packages path so that
graphstep treats it as a library, as it treats TE. Another model registers after the first one's capture:
run without grad (an evaluation), its amax waits for the next training step's reduction, which eagerly
covers it; the captured step sees the buffers' membership change and is captured again, bitwise equal to
eager (not watching, its graph would leave that model's scale behind). Trained, the other model's own
reductions consume its amaxes. The GPU tests with TE itself:
tests/gpu/test_transformer_engine_gpu.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import graphstep
from graphstep.integrations import transformer_engine as gs_te

# TE's bookkeeping, reduced to what the key reads and what the reduction does; a library's file.
_TE_STAND_IN = '''
import torch

class FP8GlobalState:
    def __init__(self):
        self.global_amax_buffer = {}
        self.global_scale_buffer = {}

class FP8GlobalStateManager:
    quantization_state = FP8GlobalState()

class Module(torch.nn.Module):
    """A TE-like module: its amax and scale join the global buffers at its first forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("amax", torch.zeros(1))  # TE: amax_history[0], the current amax
        self.register_buffer("scale", torch.ones(1))
        self.registered = False

    def forward(self, x):
        if not self.registered:
            state = FP8GlobalStateManager.quantization_state
            state.global_amax_buffer.setdefault("forward_k", []).append(self.amax)
            state.global_scale_buffer.setdefault("forward_k", []).append(self.scale)
            self.registered = True
        y = self.lin(x) * self.scale.clone()
        self.amax.copy_(torch.maximum(self.amax, y.detach().abs().amax()))
        return y

def reduce_and_update():
    """A grad-enabled te.autocast's exit: every registered tensor, this step's modules' or not; one with
    no new amax (0) keeps its scale, as in TE's kernel."""
    state = FP8GlobalStateManager.quantization_state
    for key, amaxes in state.global_amax_buffer.items():
        for amax, scale in zip(amaxes, state.global_scale_buffer[key]):
            scale.copy_(torch.where(amax > 0, 1.0 / (1.0 + amax), scale))
            amax.zero_()
'''


@pytest.fixture
def te_stand_in(monkeypatch):
    module = types.ModuleType("transformer_engine.pytorch.quantization")
    module.__file__ = "/stand-in/site-packages/transformer_engine/pytorch/quantization.py"
    exec(compile(_TE_STAND_IN, module.__file__, "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _training(te, seed: int):
    torch.manual_seed(seed)
    model = te.Module()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).square().mean()
        te.reduce_and_update()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, opt, step


def _run(te, capture, other_trains: bool, calls: int = 10, joins: int = 5) -> list[list[torch.Tensor]]:
    """The first model's step (captured by `capture`, or eager); from call `joins` on, a second model:
    its training step (`other_trains`) or its forward without grad, eagerly. Per call: the loss, the first
    model's parameters, amax and scale, the second model's output, amax and scale."""
    te.FP8GlobalStateManager.quantization_state = te.FP8GlobalState()
    model, opt, step = _training(te, 0)
    if capture is not None:
        step = capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="recording"))
    other, _, other_step = _training(te, 1)  # built now, first run at `joins`: registered then
    seen = []
    for i in range(calls):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        state = [step(x), *(p.detach().clone() for p in model.parameters()), model.amax.clone()]
        state.append(model.scale.clone())
        if i >= joins:
            if other_trains:
                state.append(other_step(x))
            else:
                with torch.no_grad():
                    state.append(other(x))
            state += [other.amax.clone(), other.scale.clone()]
        seen.append(state)
    return seen


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b))


def test_the_membership_follows_the_amax_buffers(te_stand_in):
    te = te_stand_in
    state = te.FP8GlobalStateManager.quantization_state = te.FP8GlobalState()
    empty = gs_te.amax_membership()
    te.Module()(torch.randn(2, 4))
    one = gs_te.amax_membership()
    te.Module()(torch.randn(2, 4))
    assert (empty, one) == ((id(state), ()), (id(state), (("forward_k", 1),)))
    assert gs_te.amax_membership() == (id(state), (("forward_k", 2),))
    te.FP8GlobalStateManager.quantization_state = te.FP8GlobalState()  # TE's reset(): another state
    assert gs_te.amax_membership() != empty


def _capture_noting(steps: list):
    def capture(fn, **options):
        steps.append(graphstep.capture(fn, **options))
        return steps[-1]

    return capture


def test_a_model_run_without_grad_after_capture_is_reduced_as_eager(te_stand_in, monkeypatch):
    eager = _run(te_stand_in, None, other_trains=False)
    steps = []
    assert _same(eager, _run(te_stand_in, _capture_noting(steps), other_trains=False))
    assert steps[0].stats.captures == 2  # again once the second model registered
    # Not watching TE's buffers, the graph's reduction covers the first model's tensors only: the second
    # model's amax, written without grad, is never reduced, and its scale stays behind eager's.
    monkeypatch.setattr(gs_te, "te_imported", lambda: False)
    assert not _same(eager, _run(te_stand_in, graphstep.capture, other_trains=False))


def test_a_model_trained_after_capture_is_reduced_as_eager(te_stand_in):
    # Its own step reduces (and zeroes) its amax; the step is captured again all the same.
    eager = _run(te_stand_in, None, other_trains=True)
    steps = []
    assert _same(eager, _run(te_stand_in, _capture_noting(steps), other_trains=True))
    assert steps[0].stats.captures == 2


def test_without_te_imported_the_membership_is_empty(monkeypatch):
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert gs_te.amax_membership() == ()
