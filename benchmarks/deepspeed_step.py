"""Step time of a DeepSpeed ZeRO-2 bf16 engine on one GPU: the engine eagerly, and its step captured with
graphstep.integrations.deepspeed (issue 39's bench row).

The model is graphstep's demo GPT (4 layers, width 256, 256 tokens, vocab 4096; batch 16), trained by a
DeepSpeed engine: ZeRO stage 2, bf16, gradient clipping 1.0, DeepSpeed's torch AdamW (`torch_adam`: the
GPU machine's DeepSpeed is built without its fused ops), WarmupLR, `overlap_comm: false` (graphstep
refuses it on a GPU), the throughput timer unsynchronised, a one-rank NCCL group. The step is
`engine(x, y)`, `engine.backward(loss)`, `engine.step()`; with graphstep the forward and backward are one
graph and `engine.step()` an eager segment. Rows: DeepSpeed's bf16 default, whose step reads its overflow
check and gradient norm on the host (a wait for the GPU per step, eager and graphstep alike), and
`_nocheck`: bf16 `check_grad_overflow: false`, whose step reads nothing on the host (the host can run
ahead of the GPU). Each method runs in its own process. After
WARMUP calls (graphstep's capture among them), TIMED calls:

- `step_ms`: wall time of the TIMED calls in a row (the GPU's queue kept full, as training runs), per call;
- `host_ms`: median time for a call to return to Python;
- `peak_mib`: peak memory allocated by torch over the whole run (graphstep's private pool included).

Writes `<out>/<gpu>_<date>_deepspeed-step.{json,md}`. Whole run < 3 minutes on one H100:

    PYTHONPATH=/tmp/stacks/site-packages:$PWD/src python3 benchmarks/deepspeed_step.py --out $OUT
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

from method_processes import arguments, failure, rows_line, run_each, write

METHODS = ["eager", "graphstep", "eager_nocheck", "graphstep_nocheck"]
WARMUP, TIMED, BATCH = 10, 50, 16
MODEL = {"vocab_size": 4096, "seq_len": 256, "n_layer": 4, "n_head": 4, "n_embd": 256}
ZERO = {
    "stage": 2,
    "overlap_comm": False,
    "reduce_bucket_size": 5 * 10**7,
    "allgather_bucket_size": 5 * 10**7,
}


def ds_config(check_overflow: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True, "check_grad_overflow": check_overflow},
        # DeepSpeed's throughput timer synchronises the device at every step by default: off for every
        # row, so that what is measured is the step, not that wait.
        "timers": {"throughput": {"enabled": True, "synchronized": False}},
        "zero_optimization": ZERO,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100, "warmup_max_lr": 3e-4}},
        "steps_per_print": 10**9,
    }


def one(method: str) -> dict:
    """Runs in its own process: one method."""
    import deepspeed
    import torch

    import graphstep
    from graphstep.demo.gpt import GPT, GPTConfig, make_batches
    from graphstep.integrations import deepspeed as gs_deepspeed

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg).cuda()
    graphed = method.startswith("graphstep")
    init = gs_deepspeed.initialize if graphed else deepspeed.initialize
    config = ds_config(check_overflow=not method.endswith("_nocheck"))
    engine, _, _, _ = init(model=model, config=config, model_parameters=model.parameters())
    data = make_batches(cfg, batch_size=BATCH, n_batches=4, device="cuda")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    step = gs_deepspeed.capture_engine_step(engine, train_step) if graphed else train_step
    torch.cuda.reset_peak_memory_stats()
    for i in range(WARMUP):
        step(*data[i % len(data)])
    torch.cuda.synchronize()
    host = []
    start = time.perf_counter()
    for i in range(TIMED):
        before = time.perf_counter()
        step(*data[i % len(data)])
        host.append(time.perf_counter() - before)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    row = {
        "method": method,
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms": wall / TIMED * 1e3,
        "host_ms": statistics.median(host) * 1e3,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
    }
    if isinstance(step, graphstep.CapturedStep):
        stats = step.stats
        row.update(captures=stats.captures, replays=stats.replays, eager_calls=stats.eager_calls)
        step.close()
    print(rows_line(row), flush=True)
    return row


def main() -> None:
    a = arguments(__doc__, budget_s=170.0)
    if a.one:
        one(a.one)
        return
    from importlib.metadata import version

    import torch

    from graphstep.bench.report import gpu_slug

    start, rows = time.monotonic(), []
    for method, found, why in run_each(__file__, METHODS, a.budget, first_port=29631, min_left_s=15):
        if found is None:
            rows.append({"method": method, "skipped": why})
            continue
        rows.append(found[0] if found else {"method": method, "error": why})
        print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name()
    meta = {
        "gpu": gpu,
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "date": datetime.date.today().isoformat(),
        "model": MODEL,
        "batch": BATCH,
        "zero_optimization": ZERO,
        "config": ds_config(),
        "nocheck_config": ds_config(check_overflow=False),
        "warmup": WARMUP,
        "timed": TIMED,
        "wall_s": round(time.monotonic() - start, 1),
    }
    lines = [
        f"# DeepSpeed ZeRO-2 bf16 engine, one step ({gpu}, torch {meta['torch']}, deepspeed "
        f"{meta['deepspeed']}, {meta['date']})",
        "",
        f"demo GPT {MODEL}, batch {BATCH}; torch AdamW, clipping 1.0, WarmupLR, overlap_comm off, throughput "
        f"timer unsynchronised, one rank; `_nocheck`: bf16 check_grad_overflow false. {TIMED} timed calls "
        f"after {WARMUP}.",
        "",
        "| method | step ms | host ms per step | peak MiB | captures / replays |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['method']} | - | - | - | {failure(r, 300)} |")
            continue
        graphs = f"{r['captures']} / {r['replays']}" if "captures" in r else "-"
        lines.append(
            f"| {r['method']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {r['peak_mib']:.0f} | {graphs} |"
        )
    write(a.out, f"{gpu_slug(gpu)}_{meta['date']}_deepspeed-step", meta, rows, lines)


if __name__ == "__main__":
    main()
