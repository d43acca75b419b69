"""A LightningModule trained with graphstep's callback (graphstep.integrations.lightning).

    python examples/lightning_module.py                         # CUDA if available, else CPU
    python examples/lightning_module.py --device cpu --steps 12
    python examples/lightning_module.py --manual                # manual optimization

`GraphStepCallback` captures each training step whole: Lightning's closure (training_step, zero_grad,
backward), gradient clipping and the optimizer step in one graph. `self.log` inside training_step works:
the callback logs the replay's values after each call. The scheduler from configure_optimizers is stepped
by Lightning between calls (automatic optimization) or in on_train_batch_end (manual). On CUDA the same
training runs again without the callback and both step times are printed (skip with --no-compare).
Exits cleanly, saying so, when PyTorch Lightning is not installed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import graphstep

try:
    import pytorch_lightning as pl
except ImportError:
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = None


if pl is not None:

    class Regressor(pl.LightningModule):
        def __init__(self, manual: bool = False, total_steps: int = 100) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                torch.nn.Linear(256, 1),
            )  # fmt: skip
            self.automatic_optimization = not manual
            self.total_steps = total_steps

        def training_step(self, batch, batch_idx):
            x, y = batch  # (B, 32), (B, 1)
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, prog_bar=True)
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                opt.step()
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if not self.automatic_optimization:  # outside the captured step: runs every call
                self.lr_schedulers().step()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(device: torch.device, steps: int, *, manual: bool, captured: bool) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * 64, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 2 + 0.1 * torch.randn(steps * 64, 1, generator=g))
    callbacks = [graphstep.integrations.lightning.GraphStepCallback()] if captured else []
    timer = _Timer(steps)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        gradient_clip_val=None if manual else 1.0,
        callbacks=[*callbacks, timer],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    module = Regressor(manual=manual, total_steps=steps)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
    loss = float(trainer.callback_metrics["train_loss"])
    if captured:
        print(f"graphstep: {callbacks[0].stats}")
    return loss, timer.ms()


if pl is not None:

    class _Timer(pl.Callback):
        """ms per step over the second half of training (GPU work included)."""

        def __init__(self, steps: int) -> None:
            self.steps, self.start, self.end = steps, 0.0, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == self.steps // 2:
                _sync(pl_module.device)
                self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            _sync(pl_module.device)
            self.end = time.perf_counter()

        def ms(self) -> float:
            return (self.end - self.start) / max(1, self.steps - self.steps // 2) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--manual", action="store_true", help="manual optimization")
    parser.add_argument("--no-compare", action="store_true", help="on CUDA, skip the run without graphstep")
    args = parser.parse_args()
    if pl is None:
        print(
            "lightning_module: PyTorch Lightning is not installed (pip install 'graphstep[lightning]'); skipping."
        )
        return 0
    import graphstep.integrations.lightning  # noqa: F401 (the callback)

    device = torch.device(args.device)
    loss, ms = fit(device, args.steps, manual=args.manual, captured=True)
    print(f"graphstep: final loss {loss:.4f}, {ms:.2f} ms/step")
    if device.type == "cuda" and not args.no_compare:
        eager_loss, eager_ms = fit(device, args.steps, manual=args.manual, captured=False)
        print(
            f"eager:     final loss {eager_loss:.4f}, {eager_ms:.2f} ms/step ({eager_ms / ms:.1f}x graphstep)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
