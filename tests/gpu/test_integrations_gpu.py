"""The framework integrations on a real GPU: each trains a few dozen steps with graphstep and the same
framework run without it, in deterministic mode, compares losses and parameters bitwise, and times both.

Step times (ms, second half of each run, synchronised) are printed and, when $OUT is set (as in
scripts/gpu-check.sh), appended as JSON lines to $OUT/integration_times.jsonl. Each test is skipped
when its framework is not installed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest
import torch
from gpu_common import deterministic, needs_cuda, transformers_capture_path

import graphstep
from graphstep.demo.gpt import GPT, GPTConfig, make_batches

pytestmark = [*needs_cuda, pytest.mark.timeout(300)]

CFG = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=128)
STEPS = 40


def report(name: str, graphed_ms: float, plain_ms: float, **extra: object) -> None:
    row = {"test": name, "graphstep_ms": round(graphed_ms, 3), "plain_ms": round(plain_ms, 3), **extra}
    row["speedup"] = round(plain_ms / graphed_ms, 2)
    row["gpu"] = torch.cuda.get_device_name()
    row["torch"] = torch.__version__
    print(f"\n{name}: graphstep {graphed_ms:.2f} ms/step, without {plain_ms:.2f} ms/step ({row['speedup']}x)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "integration_times.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


# -- PyTorch Lightning --------------------------------------------------------------------------


def _lightning_module(pl, manual: bool):
    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(CFG)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            loss = self.gpt(*batch)
            self.log("train_loss", loss)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                opt.step()
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if manual:
                self.lr_schedulers().step()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            graphstep.optim.make_capturable(opt, self.device)  # the same settings with and without graphstep
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return GPTModule()


def _fit_lightning(pl, manual: bool, callbacks: list):
    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []
            self.start = self.end = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == STEPS // 2:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].clone())

        def on_train_end(self, trainer, pl_module):
            torch.cuda.synchronize()
            self.end = time.perf_counter()

    data = make_batches(CFG, batch_size=8, n_batches=STEPS, device="cpu")
    record = Record()
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        gradient_clip_val=None if manual else 1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *callbacks],
    )
    module = _lightning_module(pl, manual)
    with deterministic():
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    ms = (record.end - record.start) / (STEPS - STEPS // 2) * 1e3
    return record.losses, module, float(trainer.callback_metrics["train_loss"]), trainer.global_step, ms


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_lightning_callback_bitwise_equal_to_plain_lightning(manual):
    pl = pytest.importorskip("pytorch_lightning", reason="needs pytorch-lightning")
    from graphstep.integrations.lightning import GraphStepCallback

    losses, module, logged, steps, plain_ms = _fit_lightning(pl, manual, [])
    callback = GraphStepCallback()
    g_losses, g_module, g_logged, g_steps, graphed_ms = _fit_lightning(pl, manual, [callback])
    s = callback.stats
    assert (s.captures, s.replays) == (1, STEPS - 3), s  # on CUDA the capturing call replays too
    assert g_steps == steps == STEPS and g_logged == logged
    for i, (a, b) in enumerate(zip(losses, g_losses, strict=True)):
        assert torch.equal(a, b), f"step {i}: {a.item()} != {b.item()}"
    for (name, p), q in zip(module.named_parameters(), g_module.parameters()):
        assert torch.equal(p, q), name
    report(f"lightning_{'manual' if manual else 'automatic'}", graphed_ms, plain_ms, steps=STEPS)


# -- Hugging Face ---------------------------------------------------------------------------------


def _tiny_bert(transformers):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
    )
    return transformers.BertForSequenceClassification(config)


def _rows(n: int, *, mask: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        row = {
            "input_ids": torch.randint(0, 256, (64,), generator=g),
            "labels": torch.randint(0, 2, (), generator=g),
        }
        if mask:
            row["attention_mask"] = torch.ones(64, dtype=torch.long)
        rows.append(row)
    return rows


def _train_hf(transformers, trainer_class, *, mask: bool = False):
    class Timer(transformers.TrainerCallback):
        start = end = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == STEPS // 2:
                torch.cuda.synchronize()
                Timer.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            Timer.end = time.perf_counter()

    model = _tiny_bert(transformers)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=STEPS,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        warmup_steps=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = trainer_class(
        model=model, args=args, train_dataset=_rows(STEPS * 32, mask=mask), callbacks=[Timer()]
    )
    with deterministic():
        trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return trainer, model, logs, (Timer.end - Timer.start) / (STEPS - STEPS // 2) * 1e3


def test_graphstep_trainer_bitwise_equal_to_the_trainer():
    """transformers computes differently while a stream captures (`is_tracing()`), so the plain
    Trainer runs on that path too for the bitwise check; the difference to a plain Trainer on
    its usual path is measured and reported, not asserted."""
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from graphstep.integrations.huggingface import GraphStepTrainer

    with transformers_capture_path():
        _, model, logs, plain_ms = _train_hf(transformers, transformers.Trainer)
        trainer, g_model, g_logs, graphed_ms = _train_hf(transformers, GraphStepTrainer)
    s = trainer.graphstep_stats
    # Two graphs (gradients synchronised or not); on CUDA each capturing call replays too.
    assert s.captures == 2 and s.replays == 2 * STEPS - 6, s
    assert g_logs == logs and len(logs) == STEPS
    for (name, p), q in zip(model.named_parameters(), g_model.parameters()):
        assert torch.equal(p, q), name
    _, usual_model, usual_logs, _ = _train_hf(transformers, transformers.Trainer)
    first = next((i for i, (a, b) in enumerate(zip(usual_logs, g_logs)) if a != b), None)
    drift = max((p - q).abs().max().item() for p, q in zip(usual_model.parameters(), g_model.parameters()))
    report(
        "hf_trainer",
        graphed_ms,
        plain_ms,
        steps=STEPS,
        gradient_accumulation_steps=2,
        vs_trainer_on_its_usual_path={"first_differing_log": first, "max_abs_param_difference": drift},
    )


def test_graphstep_trainer_with_an_attention_mask():
    """transformers checks `attention_mask.all()` on the host, except while a stream captures
    (graphstep's warm-ups take that path too), and with an explicit mask both paths compute the
    same as a plain Trainer's (H100, 2026-11-23: bitwise)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from graphstep.integrations.huggingface import GraphStepTrainer

    _, model, logs, _ = _train_hf(transformers, transformers.Trainer, mask=True)
    _, g_model, g_logs, _ = _train_hf(transformers, GraphStepTrainer, mask=True)
    assert g_logs == logs
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), g_model.parameters()))


def _accelerate_run(accelerate, captured: bool):
    from graphstep.integrations.huggingface import capture_accelerated

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # an earlier test made one
    accelerator = accelerate.Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphstep.optim.make_capturable(opt, "cuda")
    model, opt = accelerator.prepare(model, opt)

    def step(x, y):
        loss = model(x, y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    if captured:
        step = capture_accelerated(accelerator, step, model=model, optimizer=opt)
    data = make_batches(CFG, batch_size=8, n_batches=STEPS, device="cuda")
    losses = []
    with deterministic():
        for i, (x, y) in enumerate(data):
            if i == STEPS // 2:
                torch.cuda.synchronize()
                start = time.perf_counter()
            losses.append(step(x, y))
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / (STEPS - STEPS // 2) * 1e3
    if captured:
        assert step.stats.replays == STEPS - 3, step.stats
        step.close()
    return losses, model, ms


def test_accelerate_loop_bitwise_equal_to_eager():
    accelerate = pytest.importorskip("accelerate", reason="needs accelerate")
    losses, model, plain_ms = _accelerate_run(accelerate, captured=False)
    g_losses, g_model, graphed_ms = _accelerate_run(accelerate, captured=True)
    for i, (a, b) in enumerate(zip(losses, g_losses, strict=True)):
        assert torch.equal(a, b), f"step {i}: {a.item()} != {b.item()}"
    for (name, p), q in zip(model.named_parameters(), g_model.parameters()):
        assert torch.equal(p, q), name
    report("accelerate_loop", graphed_ms, plain_ms, steps=STEPS, mixed_precision="bf16")


def _accumulate_run(accelerate, steps: int, precision: str, clip: bool, captured: bool):
    """A plain accelerate loop with `accelerator.accumulate(model)` around one micro-batch per call;
    returns the losses, the optimizer's step count after every call, and the model."""
    from graphstep.integrations.huggingface import capture_accelerated

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()
    accelerator = accelerate.Accelerator(mixed_precision=precision, gradient_accumulation_steps=steps)
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphstep.optim.make_capturable(opt, "cuda")
    model, opt = accelerator.prepare(model, opt)

    def step(x, y):
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return loss

    if captured:
        step = capture_accelerated(accelerator, step, model=model, optimizer=opt)
    losses, counts = [], []
    first = next(iter(model.parameters()))
    with deterministic():
        for x, y in make_batches(CFG, batch_size=8, n_batches=6 * steps + 4, device="cuda"):
            losses.append(step(x, y))
            counts.append(int(opt.optimizer.state[first]["step"]) if opt.optimizer.state else 0)
        torch.cuda.synchronize()
    if captured:
        assert step.stats.replays > 0, step.stats
        step.close()
    return losses, counts, model


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("steps", [2, 4])
def test_accelerate_accumulate_bitwise_equal_to_eager(steps, precision, clip):
    """accelerate's own gradient accumulation through capture_accelerated: one graph per phase
    (accumulate only, or sync and step), every call one eager step (fp16: GradScaler's inf check
    and the optimizer's update run as an eager segment)."""
    accelerate = pytest.importorskip("accelerate", reason="needs accelerate")
    losses, counts, model = _accumulate_run(accelerate, steps, precision, clip, captured=False)
    g_losses, g_counts, g_model = _accumulate_run(accelerate, steps, precision, clip, captured=True)
    assert counts[: 2 * steps] == [(i + 1) // steps for i in range(2 * steps)] or precision == "fp16", counts
    assert g_counts == counts
    for i, (a, b) in enumerate(zip(losses, g_losses, strict=True)):
        assert torch.equal(a, b), f"call {i}: {a.item()} != {b.item()}"
    for (name, p), q in zip(model.named_parameters(), g_model.parameters()):
        assert torch.equal(p, q), name
