"""PyTorch Lightning with `GraphStepCallback`: a few steps with and without it, equal on CPU.

The recording backend (a CPU stand-in for a CUDA graph that bakes Python like one) checks what a
replay needs from the callback: the closure's loss for Lightning, the logged values, the optimizer
step count. The optimizer is fused AdamW made capturable in both runs (what graphstep does to a
captured one), so the runs are bitwise comparable.
"""

from __future__ import annotations

import pytest
import torch

import graphstep

pl = pytest.importorskip(
    "pytorch_lightning", reason="needs pytorch-lightning (pip install graphstep[lightning])"
)
from pytorch_lightning.loggers.logger import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from graphstep.errors import GraphStepError  # noqa: E402
from graphstep.integrations.lightning import GraphStepCallback, callback_class  # noqa: E402

STEPS = 12
pytestmark = pytest.mark.timeout(120)  # a wrong step count would train forever (max_steps never reached)
BACKENDS = ["recording", "eager"]


class Net(pl.LightningModule):
    def __init__(self, *, manual: bool = False, scheduler_inside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.automatic_optimization = not manual
        self.scheduler_inside = scheduler_inside

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
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        graphstep.optim.make_capturable(opt, "cpu")  # the same settings with and without graphstep
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
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


def assert_same_runs(plain, captured, plain_module, captured_module):
    (t1, out1, rows1), (t2, out2, rows2) = plain, captured
    assert len(out1) == len(out2) == STEPS
    for i, (a, b) in enumerate(zip(out1, out2)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"step {i}: {key} {a[key]} != {b[key]}"
    assert t1.global_step == t2.global_step == STEPS
    train_rows1 = [(s, {k: v for k, v in m.items() if k != "epoch"}) for s, m in rows1]
    train_rows2 = [(s, {k: v for k, v in m.items() if k != "epoch"}) for s, m in rows2]
    assert train_rows1 == train_rows2 and len(train_rows1) == STEPS
    for p, q in zip(plain_module.parameters(), captured_module.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_callback_trains_like_plain_lightning(backend, manual):
    clip = {} if manual else {"gradient_clip_val": 0.5}
    plain_module = Net(manual=manual)
    plain = fit(plain_module, [], **clip)
    callback = GraphStepCallback(config=graphstep.Config(backend=backend))
    captured_module = Net(manual=manual)
    captured = fit(captured_module, [callback], **clip)
    assert_same_runs(plain, captured, plain_module, captured_module)
    s = callback.stats
    if backend == "recording":  # 3 warm-ups, 1 capture, then replays: the callback's Python ran 4 times
        assert (s.warmup_calls, s.captures, s.replays) == (3, 1, STEPS - 4), s
    assert callback.step is None and "training_step" not in captured_module.__dict__  # restored


def test_gradient_accumulation_is_refused_with_a_way_out():
    with pytest.raises(GraphStepError, match="accumulate_grad_batches=2"):
        fit(Net(), [GraphStepCallback()], accumulate_grad_batches=2)


def test_scheduler_step_inside_a_manual_training_step_is_refused():
    with pytest.raises(GraphStepError, match="on_train_batch_end"):
        fit(Net(manual=True, scheduler_inside=True), [GraphStepCallback()])


def test_the_callback_is_a_callback_of_the_package_in_use():
    assert issubclass(callback_class("pytorch_lightning"), pl.Callback)
