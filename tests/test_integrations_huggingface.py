"""Hugging Face: `GraphStepTrainer` against a plain `transformers.Trainer`, and `capture_accelerated` against
the same `accelerate` loop run eagerly; a few steps each on CPU, bitwise equal.

The recording backend bakes Python like a CUDA graph, so replays here check that nothing the Trainer's
Python does per step is lost: gradient accumulation (2 micro-batches, 2 graphs: synchronised or not),
`max_grad_norm`, dropout, the linear schedule with warm-up and the logged losses.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import graphstep

STEPS = 8


@pytest.fixture(scope="module", autouse=True)
def transformers():
    """transformers, imported by the tests that use it: collecting the suite imports no framework."""
    return pytest.importorskip(
        "transformers", reason="needs transformers (pip install graphstep[huggingface])"
    )


def tiny_bert() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertForSequenceClassification(config)


def examples(n: int = 40, *, mask: bool = False) -> list[dict[str, torch.Tensor]]:
    # With an attention_mask, transformers reads `mask.all()` on the host in the warm-ups (not while
    # a stream captures): graphstep judges host syncs at capture, so that must not stop it.
    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "input_ids": torch.randint(0, 100, (16,), generator=g),
            "labels": torch.randint(0, 2, (), generator=g),
        }
        for _ in range(n)
    ]
    for row in rows if mask else ():
        row["attention_mask"] = torch.ones(16, dtype=torch.long)
    return rows


def train(trainer_class: type, *, mask: bool = False, **kwargs):
    import transformers

    model = tiny_bert()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trainer_class(model=model, args=args, train_dataset=examples(mask=mask), **kwargs)
    trainer.train()
    logs = [
        (h["step"], h["loss"], h["grad_norm"], h["learning_rate"])
        for h in trainer.state.log_history
        if "loss" in h
    ]
    return trainer, model, logs


@pytest.mark.parametrize(("backend", "mask"), [("recording", False), ("recording", True), ("eager", False)])
def test_graphstep_trainer_trains_like_the_trainer(transformers, backend, mask):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from graphstep.integrations.huggingface import GraphStepTrainer

    _, plain_model, plain_logs = train(transformers.Trainer, mask=mask)
    config = graphstep.Config(backend=backend)
    trainer, model, logs = train(GraphStepTrainer, mask=mask, graphstep_config=config)
    assert logs == plain_logs and len(logs) == STEPS
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    s = trainer.graphstep_stats
    if backend == "recording":  # two signatures (sync or not), each: 3 warm-ups, 1 capture, replays
        assert (s.warmup_calls, s.captures, s.replays) == (6, 2, 2 * STEPS - 8), s
    assert trainer.graphstep_step is None  # closed when train() returned


def test_accelerate_loop_captured_equals_eager():
    accelerate = pytest.importorskip("accelerate", reason="needs accelerate")
    data = [(b["input_ids"].view(2, 8), b["labels"].view(1).repeat(2)) for b in examples(12)]
    runs = [train_accelerated(accelerate, data, captured) for captured in (False, True)]
    (eager_losses, eager_model), (losses, captured_model) = runs
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    assert all(torch.equal(p, q) for p, q in zip(eager_model.parameters(), captured_model.parameters()))


def train_accelerated(accelerate, data: list, captured: bool) -> tuple[list[torch.Tensor], torch.nn.Module]:
    accelerator = accelerate.Accelerator(cpu=True)
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    graphstep.optim.make_capturable(opt, "cpu")  # what graphstep does to the captured one
    model, opt = accelerator.prepare(model, opt)

    def step(input_ids, labels):
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss

    if not captured:
        return [step(x, y) for x, y in data], model
    from graphstep.integrations.huggingface import capture_accelerated

    config = graphstep.Config(backend="recording")
    with capture_accelerated(accelerator, step, model=model, optimizer=opt, config=config) as graphed:
        losses = [graphed(x, y) for x, y in data]
        assert graphed.stats.replays == len(data) - 4, graphed.stats
    return losses, model


def test_warmups_take_transformers_capture_path_and_restore_it():
    """graphstep's CUDA warm-ups and captures tell transformers a stream captures, so warm-ups
    run (and a compiled model compiles) the path the graph replays; outside, nothing changes."""
    from transformers.utils import import_utils

    from graphstep.backends.libraries import as_captured

    original = import_utils.is_cuda_stream_capturing
    assert not import_utils.is_tracing()
    with as_captured():
        assert import_utils.is_tracing(), "transformers must see its capture path inside"
        inner = import_utils.is_cuda_stream_capturing
        with as_captured():  # nested (a capture inside a verified replay): the same function object
            assert import_utils.is_cuda_stream_capturing is inner
        assert import_utils.is_cuda_stream_capturing is inner
    assert import_utils.is_cuda_stream_capturing is original and not import_utils.is_tracing()
    with pytest.raises(RuntimeError), as_captured():
        raise RuntimeError("a failing step")
    assert import_utils.is_cuda_stream_capturing is original, "restored after an error too"
