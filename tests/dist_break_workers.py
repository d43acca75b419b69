"""Per-rank bodies of the tests of automatic graph breaks with ranks (CPU over gloo with the recording
backend, GPU over NCCL with CUDA graphs), run by `ranks.run_ranks`.

The model is a small stack of mixture-of-experts layers whose token dispatch reads the number of
tokens per expert on the host (`bincount`, each count read with `int`, then a Python loop over the experts): no CUDA
graph can record it, so the capture stops inside `Dispatch.forward` and graphstep breaks there. A layer
may instead run every expert on every token, weighted (no host sync, the same function): with
`sparse_on` naming only some ranks, only those ranks' captures stop, and every rank must still break at
the same modules (a segment on one rank while another captures that module would pair the collectives
inside it wrongly)."""

from __future__ import annotations

import copy
import dataclasses
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphstep

DIM = 16


class Combine(torch.nn.Module):
    """Without parameters: each token's output taken from its expert's, tokens grouped per expert (sparse,
    the counts read on the host) or every expert's output masked (dense)."""

    def __init__(self):
        super().__init__()
        self.sparse = True

    def forward(self, h: torch.Tensor, top: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h[0])
        if self.sparse:
            order = top.argsort(stable=True)
            counts = [int(c) for c in torch.bincount(top, minlength=h.shape[0])]  # a host sync
            for e, token in enumerate(order.split(counts)):
                out = out.index_add(0, token, h[e, token] * weight[token, None])
        else:
            for e in range(h.shape[0]):
                out = out + h[e] * (weight * (top == e))[:, None]
        return out


class Dispatch(torch.nn.Module):
    """Top-1 routing to `n` experts: sparse (tokens grouped per expert, counts read on the host) or dense.
    `combine`: every expert runs on every token (on the device) and a `Combine` without parameters picks
    each token's (the host sync is there)."""

    def __init__(self, dim: int = DIM, n: int = 4, combine: bool = False):
        super().__init__()
        self.router = torch.nn.Linear(dim, n, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(n))
        self.combine = Combine() if combine else None
        self.sparse = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(-1)
        weight, top = probs.max(-1)
        if self.combine is not None:
            h = torch.stack([expert(x) for expert in self.experts])
            return self.combine(h, top, weight).reshape(shape)
        out = torch.zeros_like(x)
        if self.sparse:
            order = top.argsort(stable=True)
            # The tokens per expert, on the host (a host sync: `int` reads each count, which the CPU
            # recording backend sees; it cannot see `.tolist()` of a CPU tensor, a CUDA capture can).
            counts = [int(c) for c in torch.bincount(top, minlength=len(self.experts))]
            for expert, token in zip(self.experts, order.split(counts)):
                out = out.index_add(0, token, expert(x[token]) * weight[token, None])
        else:
            for e, expert in enumerate(self.experts):
                out = out + expert(x) * (weight * (top == e))[:, None]
        return out.reshape(shape)


class OtherDispatch(Dispatch):
    """The same code under another class: a break at one is not a break at the other."""


class Block(torch.nn.Module):
    def __init__(self, dim: int = DIM, dispatch: type = Dispatch, combine: bool = False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.moe = dispatch(dim, combine=combine)
        self.mlp = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.moe(self.norm(x))
        return x + F.gelu(self.mlp(x))


class MoEStack(torch.nn.Module):
    def __init__(
        self, dim: int = DIM, layers: int = 2, crossed: bool = False, combine: bool = False, head: int = 0
    ):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        kinds = [OtherDispatch if crossed and i % 2 else Dispatch for i in range(layers)]
        self.blocks = torch.nn.ModuleList(Block(dim, kind, combine) for kind in kinds)
        self.out = torch.nn.Linear(dim, 1)
        # `head`: a wide layer at the output, lightly weighted: its gradients are ready first and fill DDP's
        # first bucket (which torch may cap at 1 MiB whatever the others' size) before the blocks' come.
        self.wide = torch.nn.Linear(dim, head, bias=False) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if self.wide is not None:
            return self.out(h) + 1e-3 * self.wide(h).mean(-1, keepdim=True)
        return self.out(h)


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _wrap(model: torch.nn.Module, kind: str, device: torch.device) -> torch.nn.Module:
    if kind == "plain":  # per-rank models, no collective in the step (the recording backend on CPU)
        return model
    if kind in ("ddp", "ddp_buckets"):
        # "ddp_buckets": buckets of ~4 KiB, so that some are all-reduced in a backward graph before the
        # segments' backward and waited for in a later one (one bucket holds this whole model otherwise).
        options = {"bucket_cap_mb": 0.004} if kind == "ddp_buckets" else {}
        if device.type != "cuda":
            return torch.nn.parallel.DistributedDataParallel(model, **options)
        stream = graphstep.capture_stream(device)  # DDP's accumulators run on the stream it was made on
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index], **options)
        torch.cuda.current_stream(device).wait_stream(stream)
        return ddp
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    raise ValueError(kind)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _trace(exc: BaseException) -> str:
    """The end of the error's traceback, causes included (which call CUDA refused, when a capture fails)."""
    return "".join(traceback.format_exception(exc))[-4000:]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_with_breaks(
    rank: int,
    size: int,
    *,
    kind: str,
    steps: int = 6,
    sparse_on: tuple[int, ...] | None = None,
    graph_breaks: str = "auto",
    crossed: bool = False,
    combine: bool = False,
    again: bool = False,
) -> dict:
    """`steps` steps of `MoEStack` under `kind` ("ddp", "ddp_buckets", "fsdp" or "plain"), eagerly and through graphstep
    with automatic graph breaks, from the same weights and data. `sparse_on`: the ranks whose layers
    dispatch sparsely (with a host sync); every rank when None. `crossed`: the second layer's dispatch is of
    another class, and rank r dispatches sparsely in layer 1 - r only (each rank's capture stops in a
    different module, of a different class). `combine`: the host sync is in a `Combine` without parameters
    (under FSDP2, a module with parameters cannot be a break). `again`: after an error, the same batch once
    more (`then`: its error, or None). Reports bitwise equality, the modules
    that became segments, the counters, and the first error a call raised (the run stops there)."""
    device = _device(rank)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    head = 1 << 14 if kind == "ddp_buckets" else 0  # 16 x 16384 weights: 1 MiB, DDP's first bucket
    base = MoEStack(crossed=crossed, combine=combine, head=head).to(device)
    for i, block in enumerate(base.blocks):
        block.moe.sparse = i == 1 - rank if crossed else sparse_on is None or rank in sparse_on
        if block.moe.combine is not None:
            block.moe.combine.sparse = block.moe.sparse
    twins = []
    for _ in range(2):
        model = _wrap(copy.deepcopy(base), kind, device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        graphstep.optim.make_capturable(opt, device.type)  # as graphstep makes its own: the same update
        twins.append((model, opt))
    (m_e, o_e), (m_g, o_g) = twins
    g = torch.Generator().manual_seed(100 + rank)  # data-parallel ranks: their own batches
    data = [
        (torch.randn(4, 8, DIM, generator=g).to(device), torch.randn(4, 8, 1, generator=g).to(device))
        for _ in range(steps)
    ]
    backend = "recording" if device.type == "cpu" else "cuda"
    config = graphstep.Config(backend=backend, optimizer_mode="graph", graph_breaks=graph_breaks)
    step = graphstep.capture(_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    eager = _step(m_e, o_e)
    losses_equal, error = True, None
    for i, (x, y) in enumerate(data):
        try:
            got = step(x, y)
        except Exception as exc:  # the eager twin stops before this step too: nothing may be lost
            error = {"call": i, "error": type(exc).__name__, "message": str(exc), "trace": _trace(exc)}
            if again:
                try:
                    step(x, y)
                    error["then"] = None
                except Exception as then:
                    error["then"] = {"error": type(then).__name__, "message": str(then)}
            break
        losses_equal = losses_equal and torch.equal(eager(x, y), got)
    report = {
        "losses_equal": losses_equal,
        "params_equal": all(
            torch.equal(_local(p), _local(q)) for p, q in zip(m_e.parameters(), m_g.parameters(), strict=True)
        ),
        "breaks": sorted(s for made in step._ctx.breaks.made for s in made.segments),
        "error": error,
        "stats": dataclasses.asdict(step.stats),
        "warmups_needed": step._ctx.warmups_needed,
        "backend": step.backend_name,
    }
    step.close()
    return report
