"""Step time of the demo GPT under DDP, FSDP2, tensor parallelism and FSDP2 x tensor parallel on a 2-D
mesh (`fsdp_tp`: 2-way tensor parallel, the rest data parallel): eager, a hand-written whole-step
`torch.cuda.graph`, and graphstep, side by side on the same GPUs in one run.

Pipeline parallelism (`pp_gpipe`, `pp_1f1b`, `pp_interleaved`: the GPT split into one stage per GPU, two
for the interleaved schedule, `torch.distributed.pipelining`, fp32): the eager schedule, graphstep
capturing each rank's whole step (schedule, sends and receives, optimizer), and the per-layer approach
(each stage's forward and backward graphed by `torch.cuda.make_graphed_callables`, one pair per
micro-batch, the schedule and optimizer eager: graphstep.bench.pipeline).

Also times the vote graphstep holds before every call of a distributed step (`Ranks.agree`:
shared memory on one host). Rank 0 writes benchmarks/results/<gpu>x<n>_<date>_distributed.{json,md}.
Run: `torchrun --nproc_per_node N benchmarks/distributed.py [--steps 100] [--kinds ddp,fsdp_tp] [--out DIR]`
with N = 2, 4 or 8 (every GPU of the host: scripts/gpu-check-distributed.sh). Without GPUs (gloo) only
the pipeline rows run, eager and graphstep: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import graphstep
from graphstep.bench.parallel import KINDS, KINDS_2D, mesh_2d, parallelize, parallelize_2d
from graphstep.bench.pipeline import per_stage_graphs, pipelined_gpt
from graphstep.bench.runner import ManualGraphStep, gpu_slug
from graphstep.demo.gpt import GPT, TINY, make_batches
from graphstep.demo.train import StepFn, make_train_step
from graphstep.distributed.ranks import DDP_WARMUP_STEPS, Phase, Ranks

BATCH = 16
PIPELINES = ("pp_gpipe", "pp_1f1b", "pp_interleaved")
MICRO_BATCHES = 4
PP_LAYERS = 8
"""The pipeline rows' GPT: TINY with 8 blocks, one or more per stage up to 8 stages (interleaved on 4 GPUs)."""


def training(kind: str, base: GPT, device: torch.device, mesh: object = None) -> StepFn:
    model = (
        parallelize_2d(copy.deepcopy(base), mesh)
        if kind in KINDS_2D
        else parallelize(copy.deepcopy(base), kind)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    graphstep.optim.make_capturable(opt, device)
    return make_train_step(model, opt, amp=True)


def ms_per_step(run, data: list, warmup: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for x, y in data[:warmup]:
        run(x, y)
    dist.barrier()
    sync()
    start = time.perf_counter()
    for x, y in data[warmup:]:
        run(x, y)
    sync()
    return (time.perf_counter() - start) * 1e3 / (len(data) - warmup)


def pipeline_row(kind: str, device: torch.device, data: list, warmup: int, hand_written: bool) -> dict:
    """One pipeline row: the eager schedule, graphstep's whole step, the per-stage graphs, and with
    `hand_written` a torch.cuda.graph of the whole pipelined step by hand (opt-in: a capture that fails
    on one rank only would leave the others' replays waiting for its sends)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    schedule = kind.removeprefix("pp_")
    torch.manual_seed(0)
    base = GPT(dataclasses.replace(TINY, n_layer=PP_LAYERS)).to(device)

    def part(graphed_stages=None):
        made = pipelined_gpt(
            base, schedule, rank, size, device, micro_batches=MICRO_BATCHES, graphed_stages=graphed_stages
        )
        graphstep.optim.make_capturable(made.optimizer, device)
        return made

    eager = ms_per_step(part().step, data, warmup)
    made = part()
    step = graphstep.capture(made.step, model=made.modules, optimizer=made.optimizer)
    captured = ms_per_step(step, data, warmup)
    step.close()
    per_stage = hand = None
    if device.type == "cuda":  # (on CPU, a check that the script runs: eager and graphstep's rows only)
        graphs = per_stage_graphs(BATCH // MICRO_BATCHES, TINY.seq_len, TINY.n_embd, MICRO_BATCHES, device)
        per_stage = ms_per_step(part(graphs).step, data, warmup)
        if hand_written:  # a hand-written torch.cuda.graph around the same step: the floor to aim at
            manual = ManualGraphStep(part().step, warmup=3)
            hand = ms_per_step(manual, data, warmup)
            manual.close()
    return {
        "parallelism": kind,
        "eager_ms": round(eager, 3),
        "hand_written_graph_ms": None if hand is None else round(hand, 3),
        "graphstep_ms": round(captured, 3),
        "per_stage_graphs_ms": None if per_stage is None else round(per_stage, 3),
        "speedup_vs_eager": round(eager / captured, 2),
        "graphstep_vs_hand_written": None if hand is None else round(captured / hand, 3),
        "speedup_vs_per_stage_graphs": None if per_stage is None else round(per_stage / captured, 2),
    }


def vote_us(method: str, n: int = 2000) -> float:
    """Median host time of the vote, through shared memory ("shm") or a gloo all-reduce ("gloo")."""
    os.environ["GRAPHSTEP_VOTE"] = "gloo" if method == "gloo" else ""
    ranks = Ranks(dist.group.WORLD)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        ranks.agree(Phase.REPLAY, False)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kinds", default=",".join(KINDS + KINDS_2D + PIPELINES))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--pipeline-hand-written",
        action="store_true",
        help="pipeline rows: also a hand-written torch.cuda.graph",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # without GPUs only the pipeline rows run (eager and graphstep): a check that the script works
        args.kinds = ",".join(k for k in args.kinds.split(",") if k in PIPELINES)
    torch.manual_seed(0)
    base = GPT(TINY).to(device)
    warmup = DDP_WARMUP_STEPS + 5 if cuda else 4
    rows = []
    for kind in args.kinds.split(","):
        if kind == "tp" and TINY.n_head % size:
            if rank == 0:
                print(f"tp skipped: {TINY.n_head} heads do not split over {size} ranks", flush=True)
            continue
        if kind in PIPELINES:  # every stage reads the same batches (first stage the tokens, last the targets)
            data = make_batches(TINY, batch_size=BATCH, n_batches=warmup + args.steps, seed=0, device=device)
            rows.append(pipeline_row(kind, device, data, warmup, args.pipeline_hand_written))
            if rank == 0:  # written after every row: a later row that fails keeps the earlier ones
                print(rows[-1], flush=True)
                write(rows, None, size, args)
            continue
        mesh = mesh_2d("cuda") if kind in KINDS_2D else None
        # Tensor-parallel ranks share batches; on the 2-D mesh, ranks of one data-parallel index do.
        seed = 0 if kind == "tp" else mesh["dp"].get_local_rank() if mesh is not None else rank
        data = make_batches(TINY, batch_size=BATCH, n_batches=warmup + args.steps, seed=seed, device="cuda")
        eager = ms_per_step(training(kind, base, device, mesh), data, warmup)
        manual = ManualGraphStep(training(kind, base, device, mesh), warmup=DDP_WARMUP_STEPS)
        hand = ms_per_step(manual, data, warmup)
        manual.close()
        step = graphstep.capture(training(kind, base, device, mesh))
        captured = ms_per_step(step, data, warmup)
        step.close()
        row = {
            "parallelism": kind,
            "eager_ms": round(eager, 3),
            "hand_written_graph_ms": round(hand, 3),
            "graphstep_ms": round(captured, 3),
            "speedup_vs_eager": round(eager / captured, 2),
            "graphstep_vs_hand_written": round(captured / hand, 3),
        }
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
            write(rows, None, size, args)
    vote = {method: vote_us(method, 2000 if cuda else 50) for method in ("shm", "gloo")}
    if rank == 0:
        write(rows, vote, size, args)
    dist.destroy_process_group()


def write(rows: list, vote: dict[str, float] | None, size: int, args: argparse.Namespace) -> None:
    """The results so far (`vote`: None until the last row has run)."""
    result = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": size,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none",
        "date": datetime.date.today().isoformat(),
        "config": (
            f"demo GPT {TINY} batch {BATCH} per rank, bf16 autocast, AdamW(capturable, tensor lr) + "
            f"clip_grad_norm_; ms/step = wall time of {args.steps} steps after {DDP_WARMUP_STEPS + 5} "
            "warm-up steps, synchronised before and after; DDP built on a side stream; tp: qkv/fc "
            "column-wise, proj/fc_out row-wise, the rest replicated DTensors; fsdp_tp: a (gpus/2, 2) "
            "mesh, tp within pairs of neighbouring ranks, FSDP2 (reshard after forward) across them; "
            f"pp_*: the GPT with {PP_LAYERS} blocks in fp32 split into one stage per GPU (two for interleaved 1F1B), "
            f"{MICRO_BATCHES} micro-batches, AdamW, no clipping; per-stage graphs: "
            "torch.cuda.make_graphed_callables of each stage, one per micro-batch, schedule and optimizer eager"
        ),
        "rows": rows,
        "vote_us_median": None if vote is None else {method: round(us, 1) for method, us in vote.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{gpu_slug(result['gpu'])}x{size}_{result['date']}_distributed"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Distributed step time — {result['gpu']} x{size}, torch {result['torch']}, NCCL {result['nccl']}, {result['date']}",
        "",
        result["config"],
        "",
        "| parallelism | eager ms | hand-written graph ms | per-stage graphs ms | graphstep ms | speed-up vs eager "
        "| graphstep / hand-written |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['parallelism']} | {r['eager_ms']} | {_shown(r['hand_written_graph_ms'])} | "
        f"{_shown(r.get('per_stage_graphs_ms'))} | {r['graphstep_ms']} | {r['speedup_vs_eager']}x | "
        f"{_shown(r['graphstep_vs_hand_written'])} |"
        for r in rows
    ]
    if vote is not None:
        lines += [
            "",
            f"graphstep's vote before each call (median): shared memory {vote['shm']:.1f} µs, "
            f"gloo all-reduce {vote['gloo']:.1f} µs",
        ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if vote is not None:
        print(f"wrote {stem}.json and .md", flush=True)


def _shown(value: object) -> str:
    return "—" if value is None else str(value)


if __name__ == "__main__":
    main()
