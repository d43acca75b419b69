"""graphstep.integrations.transformer_engine's key on TE's amax buffers, on the CPU's recording backend.

Transformer Engine needs CUDA, so TE itself is not here: a stand-in keeps TE's bookkeeping as TE 2.20 does
(`FP8GlobalStateManager.quantization_state.global_amax_buffer`: per recipe key, the list of registered
modules' amax tensors; a module registers its tensor at its first forward; the reduction at `te.autocast`'s
exit updates every registered tensor), compiled under a site-packages path so that graphstep treats it as
a library, as it treats TE. A second model registers after the first one's capture and trains eagerly
beside it: eagerly, the first model's reduction updates the second one's tensor too. Keyed on the
buffers' membership, the step is captured again and stays bitwise equal to eager; a plain capture leaves
the second model's tensor behind (what the key is for). The GPU tests with TE itself:
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

class FP8GlobalStateManager:
    quantization_state = FP8GlobalState()

class Module(torch.nn.Module):
    """A TE-like module: its amax joins the global buffer at its first forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("amax", torch.ones(1))
        self.registered = False

    def forward(self, x):
        if not self.registered:
            FP8GlobalStateManager.quantization_state.global_amax_buffer.setdefault("forward_k", []).append(self.amax)
            self.registered = True
        y = self.lin(x) / self.amax.clone()  # the scale from the history (TE: scale, from amax)
        self.amax.copy_(torch.maximum(self.amax, y.detach().abs().amax()))
        return y

def reduce_and_update():
    """te.autocast's exit: every registered tensor, this step's modules' or not."""
    for tensors in FP8GlobalStateManager.quantization_state.global_amax_buffer.values():
        for amax in tensors:
            amax.mul_(0.75)
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


def _run(te, capture, calls: int = 10, joins: int = 5) -> list[list[torch.Tensor]]:
    """The first model's step (captured by `capture`, or eager); from call `joins` on, a second model's
    step, eagerly. Per call: the loss, the first model's parameters and amax, the second model's amax."""
    te.FP8GlobalStateManager.quantization_state = te.FP8GlobalState()
    model, opt, step = _training(te, 0)
    if capture is not None:
        step = capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="recording"))
    other = other_step = None
    seen = []
    for i in range(calls):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        loss = step(x)
        if i >= joins:
            if other is None:
                other, _, other_step = _training(te, 1)
            other_step(x)
        state = [loss, *(p.detach().clone() for p in model.parameters()), model.amax.clone()]
        seen.append(state + ([other.amax.clone()] if other is not None else []))
    return seen


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b))


def test_key_follows_the_amax_buffers_membership(te_stand_in):
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


def test_a_module_registered_after_capture_is_reduced_as_eager(te_stand_in):
    eager = _run(te_stand_in, None)
    keyed = _run(te_stand_in, gs_te.capture_te_step)
    assert _same(eager, keyed)
    # Without the key, the graph's reduction covers the first model's tensor only: the second model's
    # amax misses the first model's reduction on every replay (eagerly it is updated there).
    assert not _same(eager, _run(te_stand_in, graphstep.capture))


def test_without_te_imported_the_key_is_empty(monkeypatch):
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert gs_te.amax_membership() == ()
