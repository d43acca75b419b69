"""The recording backend (the CPU stand-in for a CUDA graph) replays what torch's activation
checkpointing does with the CPU generator: the recompute restores the forward's state with
`torch.set_rng_state`, so its dropout draws the forward's mask again, in every replay as in eager."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import graphstep
from graphstep.errors import HostSyncError


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


class SplitBySize(torch.nn.Module):
    """Sizes a slice with a value read on the host, as torchtitan's for-loop MoE experts split tokens
    (`torch.split(x, counts.tolist())`)."""

    def __init__(self, read):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.read = read

    def forward(self, x):
        n = self.read((x[:, 0] > 0).sum())
        return self.proj(x[:n]).sum() + self.proj(x[n:]).pow(2).sum()


_READS = {
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: int(t.numpy()),
    "asarray": lambda t: int(np.asarray(t)),
}


@pytest.mark.parametrize("read", sorted(_READS))
def test_a_size_read_with_tolist_or_numpy_breaks_the_graph_never_bakes(read):
    """`tolist()` / `numpy()` read memory without an ATen call: the recording backend once baked the
    size read at capture into every replay (wrong losses from the first replay). Now a host sync: the
    module that reads becomes a graph break, and every step is bitwise eager's."""
    torch.manual_seed(0)
    model = SplitBySize(_READS[read])
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]

    def make(m, opt):
        def step(x):
            loss = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return step

    config = graphstep.Config(backend="recording", warmup_steps=1)
    step = graphstep.capture(make(model, opts[0]), model=model, optimizer=opts[0], config=config)
    eager = make(twin, opts[1])
    g = torch.Generator().manual_seed(1)
    for i in range(5):  # each batch has another number of rows with x[:, 0] > 0
        x = torch.randn(8, 4, generator=g)
        assert torch.equal(step(x), eager(x)), f"step {i}"
    assert step.stats.graph_breaks == 1 and step.stats.replays >= 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_tolist_in_the_step_function_is_refused_with_its_line():
    w = torch.nn.Parameter(torch.randn(4))

    def step(x):
        n = (x > 0).sum().tolist()
        return x[:n].sum() + w.sum()

    captured = graphstep.capture(step, config=graphstep.Config(backend="recording", warmup_steps=1))
    report = graphstep.explain(captured, torch.randn(8))  # the dry run names it too
    assert any("tolist()" in h for h in report.hazards), report.hazards
    captured(torch.randn(8))
    with pytest.raises(HostSyncError, match=r"n = \(x > 0\)\.sum\(\)\.tolist\(\)") as info:
        captured(torch.randn(8))
    assert "return the tensor" in str(info.value) and captured.stats.replays == 0


class Bucketed(torch.nn.Module):
    """A weight updated from a bucket that a fresh tensor is moved into with `t.data = ...`, as
    DeepSpeed's ZeRO moves each gradient into its contiguous bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("bucket", torch.zeros(8))

    def train_step(self, x: torch.Tensor) -> torch.Tensor:  # x: (4,)
        g = x * 2  # a fresh tensor, as autograd's gradient
        self.bucket[:4].copy_(g)
        g.data = self.bucket[:4]  # the tensor now lives in the bucket
        g.mul_(3)  # so this writes the bucket: a graph records the memory an operation used
        with torch.no_grad():
            self.w.add_(self.bucket[:4])
        return self.w.detach().clone()


def test_an_operation_on_a_tensor_whose_memory_changed_replays_on_its_new_memory():
    model, twin = Bucketed(), Bucketed()
    step = graphstep.capture(model.train_step, model=model, config=graphstep.Config(backend="recording"))
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        x = torch.randn(4, generator=g)
        assert torch.equal(step(x), twin.train_step(x))
    assert step.stats.replays > 0 and torch.equal(model.bucket, twin.bucket)
