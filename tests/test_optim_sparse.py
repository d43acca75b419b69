"""Sparse gradients (`nn.Embedding(sparse=True)`): graphstep never turns the user's optimizer into one
that fails. SGD/Adam/AdamW whose user chose neither foreach nor fused run fused on CUDA, except a
group torch's fused kernel refuses, which keeps its user's implementation; an optimizer updating
sparse gradients runs as an eager segment (sizes that depend on the data); a sparse embedding with a
padding_idx is refused at the first call, with what to change.

graphstep chooses fused on CUDA only. Here the choice is made for the CPU (`user_chose_neither`
patched to ignore the device), where torch's fused SGD refuses sparse gradients just as on CUDA.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import graphstep
from graphstep.errors import CaptureError, UnsupportedOptimizerError
from graphstep.optim import make_capturable, plan, table


class Bag(torch.nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8, sparse=True, padding_idx=padding_idx)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) int64
        return self.out(self.emb(idx)).mean()


def _batches(n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 20, (4, 6), generator=g) for _ in range(n)]


@pytest.fixture
def chooses_on_cpu(monkeypatch):
    """graphstep's fused choice made for CPU tensors, as it is for CUDA ones."""
    monkeypatch.setattr(
        table,
        "user_chose_neither",
        lambda name, group, device: (
            name in table.FUSED_BY_CHOICE and group.get("foreach") is None and group.get("fused") is None
        ),
    )


def _train(model, opt, steps):
    losses = []
    for idx in steps:
        loss = model(idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_sparse_gradient_at_the_first_step_puts_fused_back(chooses_on_cpu, momentum, caplog):
    """Nothing told graphstep of the sparse embedding (no model): the group was made fused and its lr a
    tensor; the first step sees the sparse gradient and puts both back before the fused kernel runs."""
    torch.manual_seed(0)
    model = Bag()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    make_capturable(opt, "cpu").before_call()  # as a captured step's first call does
    group = opt.param_groups[0]
    assert group["fused"] is True and isinstance(group["lr"], torch.Tensor)  # graphstep's choice
    with caplog.at_level(logging.INFO, logger="graphstep"):
        losses = _train(model, opt, _batches())  # torch: "`_fused_sgd` does not support sparse gradients"
    assert group["fused"] is None and group["lr"] == 0.1 and type(group["lr"]) is float, group
    assert "keeps its user's implementation" in caplog.text and "sparse" in caplog.text
    eager_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=momentum)
    assert all(torch.equal(a, b) for a, b in zip(losses, _train(twin, eager_opt, _batches())))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_a_sparse_embedding_known_from_the_model_is_never_fused(chooses_on_cpu, caplog):
    model = Bag()
    opt = torch.optim.SGD(
        [{"params": model.emb.parameters()}, {"params": model.out.parameters()}], lr=0.1, momentum=0.9
    )
    with caplog.at_level(logging.INFO, logger="graphstep"):
        make_capturable(opt, "cpu", model=model)
    emb, out = opt.param_groups
    assert emb["fused"] is None and out["fused"] is True, "only the sparse group keeps its user's choice"
    assert "param group 0 keeps its user's implementation" in caplog.text
    _train(model, opt, _batches(2))  # and it steps


def test_plan_keeps_the_users_implementation_where_the_fused_kernel_refuses(monkeypatch):
    monkeypatch.setattr(table, "fused_kernel_takes", lambda params, device: True)
    dense, sparse = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([{"params": [dense]}, {"params": [sparse]}], lr=0.1)
    first, second = plan(opt, "cuda", {id(sparse)})
    assert first.fuse and not first.kept
    assert not second.fuse and second.impl != "fused" and "sparse" in second.kept
    assert opt.param_groups[1]["fused"] is None, "plan() changes nothing"


def test_why_not_fused_names_what_the_fused_kernel_refuses():
    cpu = torch.device("cpu")
    assert table.why_not_fused([torch.nn.Parameter(torch.zeros(2))], cpu) == ""
    assert "float8" in table.why_not_fused([torch.zeros(2, dtype=torch.float8_e4m3fn)], cpu)
    assert "floating-point" in table.why_not_fused([torch.zeros(2, dtype=torch.complex64)], cpu)
    assert "floating-point" in table.why_not_fused([torch.nn.Parameter(torch.zeros(2))], torch.device("cuda"))
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.zeros(4, 2).to_sparse()
    assert "sparse" in table.why_not_fused([p], cpu)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_with_a_sparse_embedding_trains_bitwise_as_an_eager_segment(momentum, caplog):
    """On the recording backend: the optimizer's step runs eagerly between replays (its gradient's and
    momentum's sizes depend on the data), reading the sparse gradient the backward graph wrote."""
    torch.manual_seed(0)
    model = Bag()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)

    def step(idx):
        loss = model(idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    captured = graphstep.capture(
        step, model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        losses = [captured(idx) for idx in _batches()]
    assert captured.stats.replays == 4 and captured.stats.captures == 1, captured.stats
    assert "SGD.step() runs eagerly" in caplog.text and "sparse" in caplog.text
    wanted = _train(twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=momentum), _batches())
    assert all(torch.equal(a, b) for a, b in zip(losses, wanted))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_optimizer_mode_graph_refuses_sparse_gradients():
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(idx):
        F.mse_loss(model(idx), torch.zeros(())).backward()
        opt.step()
        opt.zero_grad()

    captured = graphstep.capture(
        step, model=model, optimizer=opt, config=graphstep.Config(backend="recording", optimizer_mode="graph")
    )
    with pytest.raises(UnsupportedOptimizerError, match="sparse"):
        for idx in _batches(4):
            captured(idx)


def test_a_sparse_embedding_with_padding_idx_is_refused_with_what_to_change():
    model = Bag(padding_idx=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.emb.weight.detach().clone()

    def step(idx):
        model(idx).backward()
        opt.step()
        opt.zero_grad()

    captured = graphstep.capture(
        step, model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    with pytest.raises(CaptureError, match=r"model\.emb is nn\.Embedding\(sparse=True, padding_idx=0\)") as e:
        captured(_batches(1)[0])
    assert "sparse=False" in str(e.value)
    assert torch.equal(weight, model.emb.weight), "refused before anything ran"
    eager = graphstep.capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="eager"))
    eager(_batches(1)[0])  # the eager backend runs it as eager does


@pytest.mark.parametrize("name, fused", [("SGD", False), ("AdamW", True)])
def test_dtensor_parameters_are_fused_only_where_dtensor_shards_the_fused_kernel(tmp_path, name, fused):
    """Under FSDP2 / tensor parallelism the parameters are DTensors; torch 2.11's DTensor had no rule for
    SGD's fused kernel (its first step raised NotImplementedError on two H100s) but has for Adam's. A
    group whose kernel DTensor cannot shard keeps the user's implementation, saying why."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from graphstep.optim import table

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
        why = table.why_not_fused([weight], torch.device("cpu"), name=name)
        assert ("DTensor" in why) != fused, why
    finally:
        dist.destroy_process_group()
