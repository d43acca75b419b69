"""The recording backend (the CPU stand-in for a CUDA graph) replays what torch's activation
checkpointing does with the CPU generator: the recompute restores the forward's state with
`torch.set_rng_state`, so its dropout draws the forward's mask again, in every replay as in eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import graphstep


class CheckpointedNet(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 1)
        self.reentrant = reentrant

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.a(x)), 0.3, self.training)
        return F.dropout(torch.tanh(self.b(h)), 0.2, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8)
        return self.out(
            F.dropout(checkpoint(self.block, x, use_reentrant=self.reentrant), 0.1, self.training)
        )


def _step(model, opt):
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_with_dropout_replays_bitwise(reentrant):
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    # reentrant checkpointing needs an input that requires grad to build a backward at all
    data = [
        (torch.randn(4, 8, generator=g).requires_grad_(reentrant), torch.randn(4, 1, generator=g))
        for _ in range(8)
    ]
    step = graphstep.capture(
        _step(model, opt), model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    eager = _step(twin, twin_opt)

    torch.manual_seed(5)
    losses = [step(x, y) for x, y in data]
    state = torch.get_rng_state()
    torch.manual_seed(5)
    wanted = [eager(x, y) for x, y in data]

    assert step.stats.replays >= 4, step.stats
    for i, (a, b) in enumerate(zip(losses, wanted)):
        assert torch.equal(a, b), f"step {i}: loss {a.item()} vs eager {b.item()}"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert torch.equal(state, torch.get_rng_state()), "the CPU generator advanced unlike eager's"
    assert torch.get_rng_state is torch.random.get_rng_state  # put back after the capture


def test_a_state_set_from_the_callers_tensor_is_read_at_each_replay():
    """`torch.set_rng_state(saved)` with the caller's tensor: each replay restores what it holds then."""

    def make():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.ones(16))
        opt = torch.optim.SGD([w], lr=0.1)
        saved = torch.get_rng_state()

        def body(x):
            torch.set_rng_state(saved)
            loss = (F.dropout(x * w, 0.5) ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return w, opt, saved, body

    w, opt, saved, body = make()
    step = graphstep.capture(
        body, model=torch.nn.ParameterList([w]), optimizer=opt, config=graphstep.Config(backend="recording")
    )
    w_eager, _, saved_eager, eager = make()
    x = torch.randn(16)
    losses, wanted = [], []
    for call in range(8):
        if call == 5:  # another state to restore from, in both runs
            torch.manual_seed(7)
            saved.copy_(torch.get_rng_state())
            saved_eager.copy_(saved)
        losses.append(step(x))
        wanted.append(eager(x))
    assert step.stats.replays >= 3, step.stats
    assert all(torch.equal(a, b) for a, b in zip(losses, wanted)), (losses, wanted)
    assert torch.equal(w, w_eager)
