"""PyTorch Lightning with `GraphStepCallback`: a few steps with and without it, equal on CPU.

The recording backend (a CPU stand-in for a CUDA graph that bakes Python like one) checks what a
replay needs from the callback: the closure's loss for Lightning, the logged values, the optimizer
step count. The optimizer is fused AdamW made capturable in both runs (what graphstep does to a
captured one), so the runs are bitwise comparable.
"""

from __future__ import annotations

import sys
from pathlib import Path

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

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from lightning_matrix import progress_counters  # noqa: E402

STEPS = 12
pytestmark = pytest.mark.timeout(120)  # a wrong step count would train forever (max_steps never reached)
BACKENDS = ["recording", "eager"]


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


def test_sgd_with_one_cycle_runs_its_update_as_a_segment_and_trains_like_plain_lightning():
    """Lightning calls `optimizer.step(closure)`; OneCycleLR cycles SGD's baked momentum, so the
    update runs as an eager segment while the closure (forward, backward, clipping) is captured."""
    plain_module = Net(recipe="sgd-one-cycle")
    plain = fit(plain_module, [], gradient_clip_val=0.5)
    callback = GraphStepCallback(config=graphstep.Config(backend="recording"))
    captured_module = Net(recipe="sgd-one-cycle")
    captured = fit(captured_module, [callback], gradient_clip_val=0.5)
    assert_same_runs(plain, captured, plain_module, captured_module)
    s = callback.stats
    assert (s.warmup_calls, s.captures, s.replays) == (3, 1, STEPS - 4), s


@pytest.mark.parametrize("recipe", ["adamw", "sgd-one-cycle"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_gradient_accumulation_trains_like_plain_lightning(accumulate, recipe):
    """Micro-batches that only accumulate get their own graph (Lightning calls its closure itself),
    the one that steps another; the first of each window (zero_grad) its own too."""
    options = {"gradient_clip_val": 0.5, "accumulate_grad_batches": accumulate}
    plain_module = Net(recipe=recipe)
    plain = fit(plain_module, [], **options)
    callback = GraphStepCallback(config=graphstep.Config(backend="recording"))
    captured_module = Net(recipe=recipe)
    captured = fit(captured_module, [callback], **options)
    assert_same_runs(plain, captured, plain_module, captured_module, batches=STEPS * accumulate)
    s = callback.stats
    kinds = 2 if accumulate == 2 else 3  # (accumulate, zero_grad), [(accumulate, none),] (step, none)
    assert s.captures == kinds and s.replays > 0, s
    # Every batch went through the captured step once: a warm-up, a capture or a replay.
    assert s.warmup_calls + s.captures + s.replays == STEPS * accumulate, s


def test_gradient_accumulation_on_the_eager_backend_trains_like_plain_lightning():
    options = {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}
    plain_module, captured_module = Net(recipe="sgd-one-cycle"), Net(recipe="sgd-one-cycle")
    plain = fit(plain_module, [], **options)
    captured = fit(captured_module, [GraphStepCallback(config=graphstep.Config(backend="eager"))], **options)
    assert_same_runs(plain, captured, plain_module, captured_module, batches=STEPS * 2)


def test_scheduler_step_inside_a_manual_training_step_is_refused():
    with pytest.raises(GraphStepError, match="on_train_batch_end"):
        fit(Net(manual=True, scheduler_inside=True), [GraphStepCallback()])


def test_the_callback_is_a_callback_of_the_package_in_use():
    assert issubclass(callback_class("pytorch_lightning"), pl.Callback)
