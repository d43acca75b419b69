"""Data-parallel training with graphstep under torchrun: DDP or FSDP2, collectives inside the graph.

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py                 # DDP, NCCL on GPUs
    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --fsdp          # FSDP2 (fully_shard)
    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --device cpu --steps 12   # gloo, eager backend

Each rank trains graphstep's tiny GPT on its own shard of synthetic tokens. On GPUs the all-reduce (DDP)
or all-gather and reduce-scatter (FSDP2) are captured with the rest of the step; every rank warms up,
captures and re-captures together. DDP must be constructed on graphstep's capture stream. On CPU the
same code runs over gloo with graphstep's eager backend. Rank 0 prints the loss and, on GPUs, the step
time against the same loop without graphstep (skip with --no-compare).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import graphstep
from graphstep.demo.gpt import GPT, TINY, make_batches


def build(device: torch.device, fsdp: bool) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(TINY).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    if device.type == "cuda":
        # DDP keeps its gradient hooks on the stream it was built on: build it on graphstep's.
        with torch.cuda.stream(graphstep.capture_stream(device)):
            return DistributedDataParallel(model, device_ids=[device.index])
    return DistributedDataParallel(model)


def train(device: torch.device, steps: int, *, fsdp: bool, captured: bool) -> tuple[float, float]:
    """Returns (this rank's last loss, ms per step over the second half)."""
    model = build(device, fsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # (B, T) token ids
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    if captured:
        train_step = graphstep.capture(train_step, model=model, optimizer=opt)
    data = make_batches(TINY, batch_size=8, n_batches=min(steps, 16), seed=dist.get_rank(), device=device)
    start, timed_from = 0.0, steps // 2
    for i in range(steps):
        if i == timed_from:
            _sync(device)
            start = time.perf_counter()
        loss = train_step(*data[i % len(data)])
        if dist.get_rank() == 0 and (i % max(1, steps // 5) == 0 or i == steps - 1):
            print(f"{'graphstep' if captured else 'eager'} step {i:4d}  loss {loss.item():.4f} (rank 0)")
    _sync(device)
    ms = (time.perf_counter() - start) / max(1, steps - timed_from) * 1e3
    if captured:
        train_step.close()  # before destroy_process_group (which would also close it)
    return loss.item(), ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--no-compare", action="store_true", help="on CUDA, skip the eager run")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    try:
        loss, ms = train(device, args.steps, fsdp=args.fsdp, captured=True)
        if dist.get_rank() == 0:
            print(f"graphstep: final loss {loss:.4f}, {ms:.2f} ms/step on {dist.get_world_size()} ranks")
        if device.type == "cuda" and not args.no_compare:
            eager_loss, eager_ms = train(device, args.steps, fsdp=args.fsdp, captured=False)
            if dist.get_rank() == 0:
                print(
                    f"eager:     final loss {eager_loss:.4f}, {eager_ms:.2f} ms/step ({eager_ms / ms:.1f}x graphstep)"
                )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
