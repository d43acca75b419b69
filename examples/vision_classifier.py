"""An image classifier with SGD + momentum and OneCycleLR, captured with graphstep.

    python examples/vision_classifier.py                          # CUDA if available, else CPU
    python examples/vision_classifier.py --device cpu --steps 12

Uses torchvision's resnet18 (10 classes, random weights) when torchvision is importable, else a small
CNN defined below (with BatchNorm, like resnet18); it says which. The data are random 32x32 images,
so the loss only shows that training runs. On CUDA it trains the same model again without graphstep
and prints both step times (skip with --no-compare).

OneCycleLR changes lr and (cycle_momentum=True, the default) momentum on every step. graphstep turns
SGD's lr into a device tensor only with fused=True, and momentum stays a Python number baked into the
graph, so on CUDA each change re-captures, up to Config.max_recaptures; then graphstep raises
StaleGraphError naming what changed (work on optimizers in graphstep will lift this).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def make_model() -> tuple[nn.Module, str]:
    try:
        import torchvision
    except ImportError:
        return SmallCNN(), "a small CNN (torchvision is not installed)"
    return torchvision.models.resnet18(num_classes=10), "torchvision resnet18"


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        return self.head(self.features(x))


def train(device: torch.device, steps: int, batch_size: int, *, captured: bool) -> tuple[float, float]:
    """Train for `steps` steps; returns (last loss, ms per step over the second half)."""
    import graphstep

    torch.manual_seed(0)
    model, _ = make_model()
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

    def train_step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32), (B,)
        loss = loss_fn(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if captured:
        train_step = graphstep.capture(train_step, model=model, optimizer=opt)

    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
        for _ in range(min(steps, 16))
    ]
    start, timed_from = 0.0, steps // 2
    for i in range(steps):
        if i == timed_from:
            _sync(device)
            start = time.perf_counter()
        images, labels = (t.to(device, non_blocking=True) for t in data[i % len(data)])
        loss = train_step(images, labels)
        sched.step()
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
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=None, help="default: 64 on CUDA, 8 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compare", action="store_true", help="on CUDA, skip the eager run")
    args = parser.parse_args()
    device = torch.device(args.device)
    batch_size = args.batch_size or (64 if device.type == "cuda" else 8)
    print(f"model: {make_model()[1]}, batch {batch_size}, {args.steps} steps on {device}")
    loss, ms = train(device, args.steps, batch_size, captured=True)
    print(f"graphstep: final loss {loss:.4f}, {ms:.2f} ms/step")
    if device.type == "cuda" and not args.no_compare:
        eager_loss, eager_ms = train(device, args.steps, batch_size, captured=False)
        print(
            f"eager:     final loss {eager_loss:.4f}, {eager_ms:.2f} ms/step ({eager_ms / ms:.1f}x graphstep)"
        )


if __name__ == "__main__":
    main()
