"""Live hyperparameters on a GPU (issue 11): every torch optimizer that runs on CUDA, with OneCycleLR
(momentum or beta1 cycled) and a linear warm-up from lr 0, captured once and bitwise equal to an eager
twin made with `make_capturable`, in deterministic mode; replays run under
`torch.cuda.set_sync_debug_mode("error")`, so a live hyperparameter read on the host fails the test.

Rows in `IN_SEGMENT` change a number that torch's implementation bakes in (tests/test_optim_live.py
says which): graphstep runs such an optimizer's step as an eager segment between graph replays.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from gpu_common import deterministic, needs_cuda
from torch import nn
from torch.optim import lr_scheduler as sched

import graphstep
from graphstep.optim import make_capturable, table

pytestmark = needs_cuda

N_STEPS = 20
OPTIONS = {
    "SGD": dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "Adam": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-3),
    "AdamW": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-2),
    "NAdam": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-3),
    "RAdam": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-3),
    "Adamax": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-3),
    "RMSprop": dict(lr=1e-3, momentum=0.9, weight_decay=1e-3),
    "Adagrad": dict(lr=0.05, weight_decay=1e-3),
    "Adadelta": dict(lr=0.5, weight_decay=1e-3),
    "ASGD": dict(lr=1e-2, t0=5.0, weight_decay=1e-3),
    "Rprop": dict(lr=1e-2),
}
FLAGS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "forloop": dict(foreach=False)}
FUSED_ON_CUDA = ("SGD", "Adam", "AdamW")  # fused Adagrad is CPU-only
ROWS = [(n, i) for n in OPTIONS for i in FLAGS if i != "fused" or n in FUSED_ON_CUDA]
# Constructed with no flags: graphstep runs SGD, Adam and AdamW fused (its choice), the others foreach.
FLAGS["default"] = {}
ROWS += [(n, "default") for n in table.FUSED_BY_CHOICE]


def onecycle(opt: torch.optim.Optimizer) -> sched.LRScheduler:
    cycles = "momentum" in opt.defaults or "betas" in opt.defaults
    return sched.OneCycleLR(
        opt, max_lr=5 * OPTIONS[type(opt).__name__]["lr"], total_steps=N_STEPS + 1, cycle_momentum=cycles
    )


def warmup(opt: torch.optim.Optimizer) -> sched.LRScheduler:  # transformers' linear warm-up and decay
    warm, total = 6, N_STEPS + 2
    return sched.LambdaLR(opt, lambda s: s / warm if s < warm else max(0.0, (total - s) / (total - warm)))


SCHEDULES = {"OneCycleLR": onecycle, "warmup-from-0": warmup}


def baked_by(name: str, impl: str, schedule: str) -> list[str]:
    """The numbers `schedule` changes that this path does not read live."""
    changed = ["lr"]
    if schedule == "OneCycleLR":
        changed += (
            ["betas[0]"] if "betas" in OPTIONS[name] else ["momentum"] if "momentum" in OPTIONS[name] else []
        )
    if name == "Adagrad":
        return ["its whole step (a host step count on a GPU)"]
    live = table.LIVE[name].get("fused" if impl == "default" else impl, {})
    return [k for k in changed if not (k in live or (k == "betas[0]" and 0 in (live.get("betas") or ())))]


IN_SEGMENT = {(n, i, s) for n, i in ROWS for s in SCHEDULES if baked_by(n, i, s)}


def cases():
    for name, impl in ROWS:
        for schedule in SCHEDULES:
            yield pytest.param(name, impl, schedule, id=f"{name}-{impl}-{schedule}")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x: (B, 32), y: (B,) int64
        return nn.functional.cross_entropy(self.net(x), y)


def make_step(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@contextlib.contextmanager
def sync_debug(mode: str):
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bit patterns: NaN equals NaN (capturable for-loop Adam makes NaN at lr 0: pytorch#126514)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("name, impl, schedule", list(cases()))
def test_optimizer_and_schedule_bitwise_equal_to_eager_with_one_capture(name, impl, schedule):
    torch.manual_seed(0)
    model = MLP().cuda()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 32, generator=g).cuda(), torch.randint(8, (16,), generator=g).cuda())
        for _ in range(N_STEPS)
    ]
    make = lambda params: getattr(torch.optim, name)(params, **OPTIONS[name], **FLAGS[impl])  # noqa: E731
    eager_opt, graph_opt = make(twin.parameters()), make(model.parameters())
    make_capturable(eager_opt, "cuda")  # before its scheduler; graphstep prepares at its first call
    if impl == "default":
        assert eager_opt.param_groups[0]["fused"] is True, (
            "graphstep runs default SGD/Adam/AdamW fused on CUDA"
        )
    step = graphstep.capture(make_step(model, graph_opt), model=model, optimizer=graph_opt)
    in_graph = (name, impl, schedule) not in IN_SEGMENT
    runs = []
    with deterministic():
        for m, opt, call in ((twin, eager_opt, make_step(twin, eager_opt)), (model, graph_opt, step)):
            scheduler = SCHEDULES[schedule](opt)
            losses = []
            for x, y in data:
                replaying = call is step and step.stats.captures == 1 and in_graph
                with sync_debug("error") if replaying else contextlib.nullcontext():
                    losses.append(call(x, y))
                    scheduler.step()
            runs.append((m, opt, losses))
        torch.cuda.synchronize()
    (m_e, o_e, losses_e), (m_g, o_g, losses_g) = runs
    for i, (a, b) in enumerate(zip(losses_e, losses_g)):
        assert torch.equal(bits(a), bits(b)), f"step {i}: eager loss {a.item()!r} != graphstep {b.item()!r}"
    for (pname, p), q in zip(m_e.named_parameters(), m_g.parameters()):
        assert torch.equal(bits(p), bits(q)), f"{pname} differs: max |diff| {(p - q).abs().max().item():.3g}"
        for key, value in o_e.state[p].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(bits(value), bits(o_g.state[q][key])), f"optimizer state {key} of {pname}"
    s = step.stats
    assert step.backend_name == "cuda" and s.captures == 1, s
    assert s.replays == N_STEPS - 3, s  # three warm-ups; the capturing call replays too
    step.close()


# -- sparse gradients (issue 40, item 4) ---------------------------------------------------------


class SparseBag(nn.Module):
    """A sparse embedding (its gradient is a sparse COO tensor) under a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32, sparse=True)
        self.head = nn.Linear(32, 8)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # idx: (B, T), y: (B, T)
        return torch.nn.functional.cross_entropy(self.head(self.emb(idx)).flatten(0, 1), y.flatten())


def _sparse_run(model, opt, call, data):
    losses = [call(idx, y) for idx, y in data]
    torch.cuda.synchronize()
    return losses


def _sparse_step(model, opt):
    def step(idx, y):
        loss = model(idx, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _sparse_data(n: int = 12):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(64, (8, 10), generator=g).cuda(), torch.randint(8, (8, 10), generator=g).cuda())
        for _ in range(n)
    ]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_with_a_sparse_embedding_equals_plain_eager(momentum):
    """SGD built with neither foreach nor fused over a sparse embedding: graphstep keeps torch's default
    (fused SGD refuses sparse gradients) and runs the step as an eager segment; bitwise equal to the
    same SGD run plainly, no make_capturable on the eager side."""
    torch.manual_seed(0)
    model = SparseBag().cuda()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    eager_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=momentum)
    step = graphstep.capture(_sparse_step(model, opt), model=model, optimizer=opt)
    data = _sparse_data()
    with deterministic():
        wanted = _sparse_run(twin, eager_opt, _sparse_step(twin, eager_opt), data)
        losses = _sparse_run(model, opt, step, data)
    assert opt.param_groups[0]["fused"] is None, "the user's choice, kept"
    s = step.stats
    assert step.backend_name == "cuda" and s.captures == 1 and s.replays == len(data) - 3, s
    for i, (a, b) in enumerate(zip(wanted, losses)):
        assert torch.equal(a, b), f"step {i}: eager loss {a.item()!r} != graphstep {b.item()!r}"
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name} differs: max |diff| {(p - q).abs().max().item():.3g}"
    step.close()


def test_a_sparse_group_keeps_its_choice_and_a_dense_group_runs_fused():
    """Two param groups: the sparse embedding's keeps torch's default, the head's runs fused. The eager
    twin is made with make_capturable and no model: its sparse group is put back at its first step."""
    torch.manual_seed(0)
    model = SparseBag().cuda()
    twin = copy.deepcopy(model)

    def make(m):
        return torch.optim.SGD(
            [{"params": m.emb.parameters()}, {"params": m.head.parameters()}], lr=0.05, momentum=0.9
        )

    opt, eager_opt = make(model), make(twin)
    make_capturable(eager_opt, "cuda")
    step = graphstep.capture(_sparse_step(model, opt), model=model, optimizer=opt)
    data = _sparse_data()
    with deterministic():
        wanted = _sparse_run(twin, eager_opt, _sparse_step(twin, eager_opt), data)
        losses = _sparse_run(model, opt, step, data)
    for o in (opt, eager_opt):
        assert [g["fused"] for g in o.param_groups] == [None, True], o.param_groups
    assert all(torch.equal(a, b) for a, b in zip(wanted, losses)), (wanted, losses)
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name} differs: max |diff| {(p - q).abs().max().item():.3g}"
    assert step.stats.captures == 1, step.stats
    step.close()
