"""What tests/test_integrations_lightning.py trains: a LightningModule, a logger and a callback that keep
what each step logged and returned, `fit()` and the comparison of two runs. A module of its own, imported
by the tests' fixture, so that collecting the test suite does not import Lightning."""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers.logger import Logger
from torch.utils.data import DataLoader, TensorDataset

import graphstep
from graphstep.integrations.lightning import GraphStepCallback, callback_class

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from lightning_matrix import progress_counters

__all__ = ["STEPS", "GraphStepCallback", "Net", "assert_same_runs", "callback_class", "fit", "pl"]

STEPS = 12


class Net(pl.LightningModule):
    def __init__(self, *, manual: bool = False, scheduler_inside: bool = False, recipe: str = "adamw"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.automatic_optimization = not manual
        self.scheduler_inside = scheduler_inside
        self.recipe = recipe

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log_dict({"idx": batch_idx.float() if torch.is_tensor(batch_idx) else float(batch_idx)})
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            if self.scheduler_inside:
                self.lr_schedulers().step()
        return {"loss": loss, "scaled": loss * 2}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if not self.automatic_optimization and not self.scheduler_inside:
            self.lr_schedulers().step()

    def configure_optimizers(self):
        if self.recipe == "sgd-one-cycle":  # the vision recipe: its step runs as an eager segment
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        graphstep.optim.make_capturable(opt, "cpu")  # the same settings with and without graphstep
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class MemoryLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class Outputs(pl.Callback):
    def __init__(self):
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append({k: v.clone() for k, v in outputs.items()})


def fit(module: Net, callbacks: list, **trainer_options):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(STEPS * 4, 8, generator=g), torch.randn(STEPS * 4, 1, generator=g))
    outputs, logger = Outputs(), MemoryLogger()
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[outputs, *callbacks],
        **trainer_options,
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer, outputs.outputs, logger.rows


def assert_same_runs(plain, captured, plain_module, captured_module, batches=STEPS):
    (t1, out1, rows1), (t2, out2, rows2) = plain, captured
    assert len(out1) == len(out2) == batches
    for i, (a, b) in enumerate(zip(out1, out2)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"step {i}: {key} {a[key]} != {b[key]}"
    assert t1.global_step == t2.global_step == STEPS
    # Lightning's own progress counters (what a checkpoint resumes from): every one advanced as in
    # plain Lightning, those of code that ran on the device during replays included.
    assert progress_counters(t1.fit_loop.state_dict()) == progress_counters(t2.fit_loop.state_dict())
    train_rows1 = [(s, {k: v for k, v in m.items() if k != "epoch"}) for s, m in rows1]
    train_rows2 = [(s, {k: v for k, v in m.items() if k != "epoch"}) for s, m in rows2]
    assert train_rows1 == train_rows2 and len(train_rows1) >= STEPS
    for p, q in zip(plain_module.parameters(), captured_module.parameters()):
        assert torch.equal(p, q)
