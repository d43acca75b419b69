"""What an eager optimizer segment costs: the tiny GPT and GPT-2 small, AdamW, bf16, with the
optimizer step inside the graph (`optimizer_mode="graph"`) and as an eager segment between two graphs
(`"eager"`), in one run on one GPU. Writes benchmarks/results/<gpu>_<date>_segment-cost.json."""

from __future__ import annotations

import datetime
import json
import sys
import time
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


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
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
    slug = "h100" if "H100" in gpu else "h200" if "H200" in gpu else "gpu"
    (out / f"{slug}_{datetime.date.today()}_segment-cost.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
