"""Where graphstep's extra reserved memory goes on GPT-2 small (bench target: <= 1.05x eager's peak).

Runs eager and graphstep, each in a fresh process on a fresh model (same step as `graphstep bench`), and
after each phase reads the allocator: reserved memory in the step's private pool and outside it, and peak
reserved/allocated. (h100_2026-11-23_memory.json also holds a third method, tried and dropped: warm-up
outside the pool with the default pool's cache emptied before capture, 1.17x eager's peak against 1.005x
for warm-up inside the pool, whose cached blocks the capture re-uses.)
Writes benchmarks/results/<gpu>_<date>_memory.json. Run on a GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

import graphstep
from graphstep.bench.runner import gpu_slug
from graphstep.demo.gpt import GPT, GPT2_SMALL, make_batches
from graphstep.demo.train import make_optimizer, make_train_step

GIB = 2**30


def pool_split(pool) -> dict:
    segments = torch.cuda.memory_snapshot()
    inside = sum(
        s["total_size"] for s in segments if pool is not None and tuple(s.get("segment_pool_id", ())) == pool
    )
    total = sum(s["total_size"] for s in segments)
    return {"pool_gib": round(inside / GIB, 3), "outside_pool_gib": round((total - inside) / GIB, 3)}


METHODS = ("eager", "graphstep")


def run(method: str, data: list) -> dict:
    torch.manual_seed(0)
    model = GPT(GPT2_SMALL).cuda()
    opt = make_optimizer(model, torch.device("cuda"))
    fn = make_train_step(model, opt, amp=True)
    step = graphstep.capture(fn, model=model, optimizer=opt) if method != "eager" else fn
    phases = {}
    for i, (x, y) in enumerate(data):
        step(x, y)
        torch.cuda.synchronize()
        if i in (0, 2, 3, len(data) - 1):  # after 1st warm-up, last warm-up, capture, steady state
            pool = step._ctx.backend.pool if method != "eager" else None
            phases[f"after_call_{i + 1}"] = {
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
                "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
                "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
                **pool_split(pool),
            }
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--method", choices=METHODS, help="run one method here (the parent runs each alone)")
    args = parser.parse_args()
    if args.method:  # a child: one method in a fresh process, its phases as JSON on the last line
        data = make_batches(GPT2_SMALL, batch_size=8, n_batches=8, seed=0, device="cuda")
        print(json.dumps(run(args.method, data)))
        return
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "config": "GPT-2 small, batch 8 x 1024, AdamW (graphstep settings), clip 1.0, bf16 autocast; 8 calls; "
        "each method in a fresh process",
    }
    for method in METHODS:
        out = subprocess.run(
            [sys.executable, __file__, "--method", method], capture_output=True, text=True, check=True
        )
        result[method] = json.loads(out.stdout.strip().splitlines()[-1])
        print(method, json.dumps(result[method], indent=1))
    eager_peak = result["eager"]["after_call_8"]["peak_reserved_gib"]
    result["peak_reserved_over_eager"] = {
        m: round(result[m]["after_call_8"]["peak_reserved_gib"] / eager_peak, 3) for m in METHODS
    }
    print(result["peak_reserved_over_eager"])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{gpu_slug(result['gpu'])}_{result['date']}_memory.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
