"""A plain PyTorch training loop with graphstep: the README's example, runnable.

    python examples/plain_loop.py                    # CUDA if available, else CPU (graphstep's eager backend)
    python examples/plain_loop.py --device cpu --steps 20

Trains graphstep's built-in tiny GPT on synthetic tokens with AdamW, a cosine schedule, gradient clipping
and (on CUDA) bf16 autocast. The first calls warm up eagerly, the next one captures the step into a CUDA
graph, the rest replay it. On CUDA it then trains the same model again without graphstep and prints both
step times (skip with --no-compare).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import graphstep
from graphstep.demo.gpt import GPT, TINY, make_batches


def train(device: torch.device, steps: int, *, captured: bool) -> tuple[float, float]:
    """Train for `steps` steps; returns (last loss, ms per step over the second half)."""
    torch.manual_seed(0)
    model = GPT(TINY).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x, y: (B, T) token ids
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    if captured:
        train_step = graphstep.capture(train_step, model=model, optimizer=opt)

    loader = make_batches(TINY, batch_size=8, n_batches=steps, device=device)
    start, timed_from = 0.0, steps // 2
    for i, (x, y) in enumerate(loader):
        if i == timed_from:
            _sync(device)
            start = time.perf_counter()
        loss = train_step(x, y)  # warm-up calls run eagerly, then one capture, then replays
        sched.step()  # honoured without re-capture: graphstep keeps AdamW's lr in a device tensor
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            print(f"{'graphstep' if captured else 'eager'} step {i:4d}  loss {loss.item():.4f}")
    _sync(device)
    ms = (time.perf_counter() - start) / max(1, steps - timed_from) * 1e3
    if captured:
        train_step.close()
    return loss.item(), ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compare", action="store_true", help="on CUDA, skip the eager run")
    args = parser.parse_args()
    device = torch.device(args.device)
    loss, ms = train(device, args.steps, captured=True)
    print(f"graphstep: final loss {loss:.4f}, {ms:.2f} ms/step")
    if device.type == "cuda" and not args.no_compare:
        eager_loss, eager_ms = train(device, args.steps, captured=False)
        print(
            f"eager:     final loss {eager_loss:.4f}, {eager_ms:.2f} ms/step ({eager_ms / ms:.1f}x graphstep)"
        )


if __name__ == "__main__":
    main()
