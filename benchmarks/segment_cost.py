"""What an eager segment costs, in one run on one GPU.

- `bf16` (default section): the tiny GPT and GPT-2 small, AdamW, bf16, with the optimizer step inside
  the graph (`optimizer_mode="graph"`) and as an eager segment between two graphs (`"eager"`).
  Writes <gpu>_<date>_segment-cost.json.
- `fp16` (issue 22): fp16 autocast + GradScaler + clip, on the tiny GPT and on transformers' GPT-2
  small (random weights): eager vs graphstep, with the default (foreach) AdamW, whose GradScaler.step
  graphstep runs as an eager segment, and with fused AdamW, which stays in one graph. Writes
  <gpu>_<date>_segment-cost-fp16.json and .md.

    python benchmarks/segment_cost.py [OUT_DIR] [bf16|fp16|all]
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import graphstep
from graphstep.demo.gpt import GPT, GPT2_SMALL, TINY, make_batches
from graphstep.demo.train import make_optimizer, make_train_step


def per_step_ms(cfg, batch: int, mode: str, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    opt = make_optimizer(model, torch.device("cuda"))
    step = graphstep.capture(
        make_train_step(model, opt, amp=True),
        model=model,
        optimizer=opt,
        config=graphstep.Config(optimizer_mode=mode),
    )
    data = make_batches(cfg, batch_size=batch, n_batches=4, seed=0, device="cuda")
    for i in range(6):
        step(*data[i % 4])
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(*data[i % 4])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(steps):
        step(*data[i % 4])
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - start) / steps
    step.close()
    return 1e3 * sorted(times)[len(times) // 2], 1e3 * pipelined


def bf16_section(out: Path) -> None:
    rows = []
    for name, cfg, batch, steps in (("tiny GPT", TINY, 8, 100), ("GPT-2 small", GPT2_SMALL, 8, 20)):
        for mode in ("graph", "eager"):
            step_ms, pipelined_ms = per_step_ms(cfg, batch, mode, steps)
            rows.append(
                dict(
                    model=name,
                    optimizer_mode=mode,
                    step_ms=round(step_ms, 3),
                    pipelined_ms=round(pipelined_ms, 3),
                )
            )
            print(rows[-1], flush=True)
    gpu = torch.cuda.get_device_name()
    record = dict(
        gpu=gpu,
        torch=torch.__version__,
        date=str(datetime.date.today()),
        optimizer="AdamW (make_capturable), clip 1.0, bf16",
        rows=rows,
    )
    (out / f"{_slug()}_{datetime.date.today()}_segment-cost.json").write_text(json.dumps(record, indent=2))


# -- fp16 + GradScaler (issue 22) ------------------------------------------------------------------

FP16_VARIANTS = (
    ("eager", "foreach"),
    ("eager", "fused"),
    ("graphstep", "foreach"),  # GradScaler.step(AdamW) runs as an eager segment
    ("graphstep", "fused"),  # one graph
)


def _tiny_gpt() -> tuple[torch.nn.Module, Callable, list]:
    model = GPT(TINY).cuda()
    data = make_batches(TINY, batch_size=8, n_batches=4, seed=0, device="cuda")
    return model, lambda m, x, y: m(x, y), data


def _hf_gpt2() -> tuple[torch.nn.Module, Callable, list]:
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()  # GPT-2 small, random weights
    g = torch.Generator().manual_seed(0)
    data = [
        (ids.cuda(), ids.cuda()) for ids in (torch.randint(50257, (8, 1024), generator=g) for _ in range(4))
    ]
    return model, lambda m, x, y: m(input_ids=x, labels=y).loss, data


def _scaled_step(model, loss_of, opt, scaler) -> Callable:
    def train_step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fp16_time(make: Callable, runner: str, impl: str, steps: int) -> dict:
    torch.manual_seed(0)
    model, loss_of, data = make()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if impl == "fused" else {}))
    scaler = torch.amp.GradScaler("cuda")
    step = _scaled_step(model, loss_of, opt, scaler)
    lines = _Lines()
    logging.getLogger("graphstep").addHandler(lines)
    if runner == "graphstep":
        step = graphstep.capture(step, model=model, optimizer=opt)
    start = time.perf_counter()
    for i in range(6):
        step(*data[i % 4])
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(*data[i % 4])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(steps):
        loss = step(*data[i % 4])
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - start) / steps
    logging.getLogger("graphstep").removeHandler(lines)
    row = dict(
        runner=runner,
        adamw=impl,
        step_ms=round(1e3 * sorted(times)[len(times) // 2], 3),
        pipelined_ms=round(1e3 * pipelined, 3),
        first_6_calls_s=round(first_s, 2),
        final_loss=round(float(loss), 4),
        scale=scaler.get_scale(),
    )
    if runner == "graphstep":
        row["segment_log"] = [line for line in lines.lines if "eager segment" in line]
        row["replays"] = step.stats.replays
        step.close()
    del model, opt, step
    torch.cuda.empty_cache()
    return row


def fp16_section(out: Path) -> None:
    rows = []
    for name, make, steps in (("tiny GPT", _tiny_gpt, 100), ("GPT-2 small (transformers)", _hf_gpt2, 20)):
        for runner, impl in FP16_VARIANTS:
            rows.append({"model": name, **fp16_time(make, runner, impl, steps)})
            print(rows[-1], flush=True)
    record = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=str(datetime.date.today()),
        config=(
            "fp16 autocast, GradScaler (default settings), scaler.unscale_ + clip_grad_norm_(1.0), "
            "AdamW lr 3e-4 (foreach default, or fused=True); tiny GPT batch 8 x 64 tokens, 100 timed steps; "
            "GPT-2 small (transformers GPT2LMHeadModel, random weights) batch 8 x 1024 tokens, 20 timed "
            "steps. step_ms: median of synchronised steps; pipelined_ms: mean of back-to-back steps."
        ),
        rows=rows,
    )
    stem = out / f"{_slug()}_{datetime.date.today()}_segment-cost-fp16"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    table = [
        f"# fp16 + GradScaler: the eager segment's cost ({record['gpu']}, torch {record['torch']}, {record['date']})",
        "",
        record["config"],
        "",
        "| model | runner | AdamW | ms/step (synchronised) | ms/step (pipelined) |",
        "|---|---|---|---|---|",
        *(
            f"| {r['model']} | {r['runner']} | {r['adamw']} | {r['step_ms']:.2f} | {r['pipelined_ms']:.2f} |"
            for r in rows
        ),
    ]
    stem.with_suffix(".md").write_text("\n".join(table) + "\n")


def _slug() -> str:
    gpu = torch.cuda.get_device_name()
    return "h100" if "H100" in gpu else "h200" if "H200" in gpu else "gpu"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    section = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    if section in ("bf16", "all"):
        bf16_section(out)
    if section in ("fp16", "all"):
        fp16_section(out)


if __name__ == "__main__":
    main()
