"""Fine-tuning a transformers model with graphstep: AdamW + get_linear_schedule_with_warmup.

    python examples/hf_finetune.py                       # CUDA if available, else CPU
    python examples/hf_finetune.py --device cpu --steps 12
    python examples/hf_finetune.py --trainer             # the same with transformers.Trainer

A tiny BERT classifier (or `--model llama`: a tiny Llama language model) with random weights, on random
token ids: no download. The loop is a plain PyTorch loop around `graphstep.capture`; `--trainer` runs
graphstep's `GraphStepTrainer` (graphstep.integrations.huggingface) instead. On CUDA the plain loop is
timed against the same loop without graphstep (skip with --no-compare). Exits cleanly, saying so, when
transformers is not installed.

The batches have no padding, so no attention_mask is passed. One would work as well: transformers checks a
mask on the host only outside a capture, in the eager warm-ups, and graphstep judges host syncs at capture
(docs/limits.md: transformers' capture path).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

import graphstep


def make_model(kind: str, vocab: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=128, **small)
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(vocab_size=vocab, max_position_embeddings=128, num_labels=2, **small)
    return transformers.BertForSequenceClassification(config)


def batches(kind: str, n: int, batch_size: int, vocab: int, seq: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
        labels = ids if kind == "llama" else torch.randint(0, 2, (batch_size,), generator=g)
        out.append({"input_ids": ids, "labels": labels})
    return out


def train_loop(kind: str, device: torch.device, steps: int, *, captured: bool) -> tuple[float, float]:
    """The plain loop; returns (last loss, ms per step over the second half)."""
    import transformers

    vocab = 256
    model = make_model(kind, vocab).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    sched = transformers.get_linear_schedule_with_warmup(
        opt, num_warmup_steps=steps // 10, num_training_steps=steps
    )

    def train_step(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (B, T), (B,) or (B, T)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    if captured:
        train_step = graphstep.capture(train_step, model=model, optimizer=opt)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(kind, min(steps, 16), 8, vocab)]
    start, timed_from = 0.0, steps // 2
    for i in range(steps):
        if i == timed_from:
            _sync(device)
            start = time.perf_counter()
        loss = train_step(**data[i % len(data)])
        sched.step()  # LambdaLR: honoured without re-capture, AdamW's lr is a device tensor
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            print(f"{'graphstep' if captured else 'eager'} step {i:4d}  loss {loss.item():.4f}")
    _sync(device)
    if captured:
        train_step.close()
    return loss.item(), (time.perf_counter() - start) / max(1, steps - timed_from) * 1e3


def train_trainer(kind: str, device: torch.device, steps: int) -> float:
    """The same model with graphstep's `GraphStepTrainer` (a transformers.Trainer)."""
    import transformers

    from graphstep.integrations.huggingface import GraphStepTrainer

    vocab = 256
    rows = [{k: v[j] for k, v in b.items()} for b in batches(kind, 8, 8, vocab) for j in range(8)]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=5e-4,
        warmup_steps=steps // 10,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=max(1, steps // 5),
        report_to=[],
        save_strategy="no",
        use_cpu=device.type == "cpu",
        disable_tqdm=True,
    )
    trainer = GraphStepTrainer(model=make_model(kind, vocab), args=args, train_dataset=rows)
    result = trainer.train()
    print(f"graphstep: {trainer.graphstep_stats}")
    return result.training_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=["bert", "llama"], default="bert")
    parser.add_argument("--trainer", action="store_true", help="use GraphStepTrainer instead of a plain loop")
    parser.add_argument("--no-compare", action="store_true", help="on CUDA, skip the eager run")
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_finetune: transformers is not installed (pip install 'graphstep[huggingface]'); skipping.")
        return 0
    device = torch.device(args.device)
    if args.trainer:
        print(f"GraphStepTrainer: mean training loss {train_trainer(args.model, device, args.steps):.4f}")
        return 0
    loss, ms = train_loop(args.model, device, args.steps, captured=True)
    print(f"graphstep: final loss {loss:.4f}, {ms:.2f} ms/step")
    if device.type == "cuda" and not args.no_compare:
        eager_loss, eager_ms = train_loop(args.model, device, args.steps, captured=False)
        print(
            f"eager:     final loss {eager_loss:.4f}, {eager_ms:.2f} ms/step ({eager_ms / ms:.1f}x graphstep)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
