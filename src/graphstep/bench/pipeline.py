"""The demo GPT split into pipeline stages (`torch.distributed.pipelining`), for the distributed benchmark
and the pipeline tests.

`pipelined_gpt` gives one rank's training step: its stage(s) of the GPT (embeddings on the first,
LayerNorm and head on the last, the blocks shared out evenly), a schedule (GPipe, 1F1B, interleaved 1F1B
with two stages per rank), AdamW over the rank's parameters, and a step function as a user writes it:
the schedule's `step()` (micro-batches, sends and receives, the losses collected on the last stage),
then the optimizer. `per_stage_graphs` is the per-layer approach to compare with (as Megatron and
TransformerEngine capture): each stage's forward and backward captured by
`torch.cuda.make_graphed_callables`, once per micro-batch, while the schedule, its sends and receives
and the optimizer run eagerly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..demo.gpt import GPT

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class GPTStage(nn.Module):
    """A slice of the demo GPT: the embeddings (first stage), some blocks, the LayerNorm and head (last)."""

    def __init__(self, base: GPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.tok = copy.deepcopy(base.tok) if first else None
        self.pos = copy.deepcopy(base.pos) if first else None
        self.blocks = nn.ModuleList(copy.deepcopy(base.blocks[i]) for i in blocks)
        self.ln_f = copy.deepcopy(base.ln_f) if last else None
        self.head = copy.deepcopy(base.head) if last else None

    def forward(self, x: Tensor) -> Tensor:  # first stage: (B, T) token ids; others: (B, T, C)
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The demo GPT's own loss, on the last stage's logits."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


@dataclasses.dataclass
class PipelinedStep:
    """One rank's part of a pipelined training step."""

    step: Callable[[Tensor, Tensor], Tensor]
    """`step(x, y)`: the schedule's step and the optimizer; returns the summed micro-batch losses on the
    rank holding the last stage, a zero elsewhere."""
    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    schedule: object


def stage_indices(schedule: str, rank: int, ranks: int) -> tuple[list[int], int]:
    """The stages of `rank` and the number of stages: one per rank, two (looped) when interleaved."""
    per_rank = 2 if schedule == "interleaved" else 1
    return [rank + k * ranks for k in range(per_rank)], ranks * per_rank


def pipelined_gpt(
    base: GPT,
    schedule: str,
    rank: int,
    ranks: int,
    device: torch.device,
    *,
    micro_batches: int = 4,
    group: object = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    amp: bool = False,
    graphed_stages: Callable[[nn.Module, int], nn.Module] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> PipelinedStep:
    """`rank`'s step of `base` (copied) pipelined over `ranks` ranks of `group` with `schedule`. `wrap`:
    data parallelism on each stage (FSDP2, replicate). `graphed_stages(module, index)`: replaces each
    stage's module (`per_stage_graphs`). `optimizer(params)`: AdamW(lr=3e-4) unless given."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    indices, n_stages = stage_indices(schedule, rank, ranks)
    layers = len(base.blocks)
    if layers < n_stages:
        raise ValueError(
            f"{layers} blocks cannot fill {n_stages} stages: give the GPT at least one per stage"
        )
    modules = []
    for i in indices:
        blocks = range(i * layers // n_stages, (i + 1) * layers // n_stages)
        module = GPTStage(base, blocks, first=i == 0, last=i == n_stages - 1).to(device)
        modules.append(wrap(module) if wrap is not None else module)
    run = [graphed_stages(m, i) if graphed_stages is not None else m for m, i in zip(modules, indices)]
    stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(run, indices)]
    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], micro_batches, loss_fn=gpt_loss)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], micro_batches, loss_fn=gpt_loss)
    elif schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=gpt_loss)
    else:
        raise ValueError(f"unknown schedule {schedule!r}: one of {SCHEDULES}")
    params = [p for m in modules for p in m.parameters()]
    opt = optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=3e-4)
    first, last = 0 in indices, n_stages - 1 in indices

    turns = [m for m in run if isinstance(m, _InTurn)]

    def step(x: Tensor, y: Tensor) -> Tensor:  # x, y: (B, T) token ids, the whole batch
        for m in turns:  # (per-stage graphs) micro-batch 0's graphs first, whatever ran before
            m.restart()
        losses: list[Tensor] = []  # made here: the schedule fills it in every call
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            sched.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).sum() if last else torch.zeros((), device=device)

    step.__qualname__ = f"pipelined_step_{schedule}"
    return PipelinedStep(step, modules, opt, sched)


def per_stage_graphs(
    micro_batch: int, seq_len: int, embd: int, micro_batches: int, device: torch.device
) -> Callable[[nn.Module, int], nn.Module]:
    """`graphed_stages` for `pipelined_gpt`: each stage's forward and backward as CUDA graphs, one pair
    per micro-batch (a graph's outputs are its own static memory: micro-batches in flight at once
    need graphs of their own), taken in turn as the schedule runs the micro-batches in order."""

    def graphed(module: nn.Module, index: int) -> nn.Module:
        if index == 0:
            sample = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        else:
            sample = torch.zeros(micro_batch, seq_len, embd, device=device)
        needs_grad = index != 0  # (stage 0 takes token ids)
        copies = []
        for _ in range(micro_batches):
            # A module gets its graphed forward as an instance attribute: take it, and give the module
            # back its own forward before the next capture (which must not capture a replay). Each sample
            # is a leaf: a clone of a tensor that requires grad has autograd history, and the backward's
            # capture would reach back to where it was made ("would make the legacy stream depend on a
            # capturing blocking stream").
            torch.cuda.make_graphed_callables(module, (sample.clone().requires_grad_(needs_grad),))
            copies.append(module.__dict__.pop("forward"))
        return _InTurn(module, copies)

    return graphed


class _InTurn(nn.Module):
    """Calls its graphed copies in turn, one per micro-batch (the schedule's forwards go in order)."""

    def __init__(self, module: nn.Module, graphed: list[Callable]):
        super().__init__()
        self.module = module  # its parameters, for the optimizer and the stage
        self._graphed = graphed
        self._next = 0

    def restart(self) -> None:
        self._next = 0

    def forward(self, x: Tensor) -> Tensor:
        fn = self._graphed[self._next]
        self._next = (self._next + 1) % len(self._graphed)
        return fn(x)
