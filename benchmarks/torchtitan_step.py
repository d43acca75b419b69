"""Step time of torchtitan's debug models (Llama 3, DeepSeek-V3) on one GPU: eager, graphstep, with
torchtitan's per-block `torch.compile`, eagerly and under graphstep (issue 39's bench row).

Each method runs in its own process (nothing of another method's allocator, dynamo or graphs left
over), the two models one after the other, built and trained with torchtitan's own train spec and docs/frameworks.md's recipe
(tests/titan_common.py): a one-rank process group, torchtitan's optimizer container (fused AdamW), its lr
warm-up stepped after each call, batch 8 × 256 tokens. After WARMUP calls (graphstep's capture among them,
compiling among them), TIMED calls:

- `step_ms`: wall time of the TIMED calls in a row (the GPU's queue kept full, as training runs), per call;
- `host_ms`: median time for a call (the recipe's step and the schedulers' step) to return to Python;
- `peak_mib`: peak memory allocated by torch over the whole run (graphstep's private pool included).

torchtitan 0.2.2's own CUDA graph option lives in `torchtitan.experiments.compiler_toolkit` (its own trainer:
`--compile.passes cudagraph` on SimpleFSDP's traced joint graph); the main trainer has none, so it is not a
row here. Writes `<out>/<gpu>_<date>_torchtitan-step.{json,md}`. Whole run < 90 s on one H100 (the budget
skips the last methods if not; each row says so):

    PYTHONPATH=/tmp/stacks/site-packages python3 benchmarks/torchtitan_step.py --out $OUT
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

from method_processes import arguments, failure, rows_line, run_each, write

HERE = Path(__file__).resolve().parent
MODELS = ["llama3", "deepseek_v3"]
METHODS = ["eager", "graphstep", "eager_compiled", "graphstep_compiled"]  # the budget cuts from the end
WARMUP, TIMED, BATCH, SEQ = 8, 30, 8, 256


class _GraphstepLog(logging.Handler):
    """The first lines graphstep logs for a row (INFO and above), shortened: kept in the row's JSON."""

    def __init__(self, keep: int = 12) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.keep = keep

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < self.keep:
            self.lines.append(record.getMessage()[:400])


def one(method: str) -> list[dict]:
    """Runs in its own process: one method, each model in turn (the first one's step closed and freed
    before the next is built; peak memory counted per model)."""
    import gc

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE.parent / "tests"))
    import graphstep
    from titan_common import batches, build, train_step, valid_tokens

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    rows = []
    for model_name in MODELS:
        torch.cuda.reset_peak_memory_stats()
        t = build(model_name, "cuda", seq_len=SEQ, compile_blocks=method.endswith("_compiled"))
        data = batches(t.args.vocab_size, 4, SEQ, "cuda", batch=BATCH)
        step = train_step(t, "cuda")
        captured, said = None, _GraphstepLog()
        if method.startswith("graphstep"):
            captured = graphstep.capture(step, model=t.model, optimizer=t.optimizers.optimizers)
            step = captured
            logging.getLogger("graphstep").addHandler(said)
            logging.getLogger("graphstep").setLevel(logging.INFO)

        def call(i: int, step=step, t=t, data=data) -> None:
            x, y = data[i % len(data)]
            step(x, y, valid_tokens(y, t))
            t.lr_schedulers.step()

        for i in range(WARMUP):
            call(i)
        torch.cuda.synchronize()
        host = []
        start = time.perf_counter()
        for i in range(TIMED):
            before = time.perf_counter()
            call(i)
            host.append(time.perf_counter() - before)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        row = {
            "model": model_name,
            "flavor": "debugmodel",
            "method": method,
            "params": sum(p.numel() for p in t.model.parameters()),
            "step_ms": wall / TIMED * 1e3,
            "host_ms": statistics.median(host) * 1e3,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        }
        if captured is not None:
            stats = captured.stats
            row.update(captures=stats.captures, graph_breaks=stats.graph_breaks, replays=stats.replays)
            row["pool_mib"] = stats.pool_bytes / 2**20
            row["graphstep_log"] = said.lines  # what graphstep decided: segments, breaks, eager optimizers
            logging.getLogger("graphstep").removeHandler(said)
            captured.close()
        rows.append(row)
        print(rows_line(row), flush=True)
        del t, step, captured, call
        gc.collect()
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return rows


def main() -> None:
    a = arguments(__doc__, budget_s=85.0)
    if a.one:
        one(a.one)
        return
    from importlib.metadata import version

    import torch

    from graphstep.bench.report import gpu_slug

    start, rows = time.monotonic(), []
    for method, found, why in run_each(__file__, METHODS, a.budget, first_port=29611, min_left_s=10):
        if found is None:
            rows += [{"model": m, "method": method, "skipped": why} for m in MODELS]
            continue
        by_model = {r["model"]: r for r in found}
        for m in MODELS:
            rows.append(by_model.get(m, {"model": m, "method": method, "error": why}))
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name()
    meta = {
        "gpu": gpu,
        "torch": torch.__version__,
        "torchtitan": version("torchtitan"),
        "date": datetime.date.today().isoformat(),
        "batch": BATCH,
        "seq_len": SEQ,
        "warmup": WARMUP,
        "timed": TIMED,
        "wall_s": round(time.monotonic() - start, 1),
    }
    lines = [
        f"# torchtitan debug models, one step ({gpu}, torch {meta['torch']}, torchtitan {meta['torchtitan']}, "
        f"{meta['date']})",
        "",
        f"batch {BATCH} × {SEQ} tokens, fused AdamW, lr warm-up; {TIMED} timed calls after {WARMUP}.",
        "",
        "| model | method | step ms | host ms per step | peak MiB | captures / breaks |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['model']} | {r['method']} | - | - | - | {failure(r, 200)} |")
            continue
        graphs = f"{r['captures']} / {r['graph_breaks']}" if "captures" in r else "-"
        lines.append(
            f"| {r['model']} | {r['method']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {r['peak_mib']:.0f} | {graphs} |"
        )
    write(a.out, f"{gpu_slug(gpu)}_{meta['date']}_torchtitan-step", meta, rows, lines)


if __name__ == "__main__":
    main()
