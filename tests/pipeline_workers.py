"""Per-rank bodies of the pipeline-parallel tests (CPU over gloo, GPU over NCCL), run by `ranks.run_ranks`."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import graphstep

WIDTH = 16


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _stage_module(index: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(100 + index)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()).to(device)


def _build(schedule: str, rank: int, size: int, device, micro: int):
    per_rank = 2 if schedule == "interleaved" else 1
    n_stages = size * per_rank
    indices = [rank + k * size for k in range(per_rank)]
    mods = [_stage_module(i, device) for i in indices]
    stages = [PipelineStage(m, i, n_stages, device) for m, i in zip(mods, indices)]
    loss_fn = torch.nn.functional.mse_loss
    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], micro, loss_fn=loss_fn)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], micro, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    first = 0 in indices
    last = n_stages - 1 in indices
    return mods, sched, opt, first, last


def _step_fn(sched, opt, first, last, device):
    def step(x, y):
        losses = []
        if first and last:
            sched.step(x, target=y, losses=losses)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).sum() if last else torch.zeros((), device=device)

    return step


def _data(n: int, device, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, WIDTH, generator=g).to(device), torch.randn(batch, WIDTH, generator=g).to(device)) for _ in range(n)]


def train_pipeline(rank: int, size: int, *, schedule: str, steps: int = 8, micro: int = 4, graphs: str = "auto") -> dict:
    device = _device(rank)
    torch.use_deterministic_algorithms(True)
    data = _data(steps, device)
    runs = []
    for graphed in (False, True):
        mods, sched, opt, first, last = _build(schedule, rank, size, device, micro)
        step = _step_fn(sched, opt, first, last, device)
        if graphed:
            step = graphstep.capture(step, model=mods, optimizer=opt, config=graphstep.Config(backend=graphs))
        losses = [step(x, y) for x, y in data]
        runs.append((mods, losses, step))
    (em, el, _), (gm, gl, step) = runs
    report = {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(el, gl, strict=True)),
        "params_equal": all(torch.equal(a, b) for ma, mb in zip(em, gm) for a, b in zip(ma.parameters(), mb.parameters(), strict=True)),
        "stats": dataclasses.asdict(step.stats),
        "backend": step.backend_name,
        "losses": [float(l) for l in gl],
    }
    step.close()
    return report
