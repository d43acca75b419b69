"""What graphstep's vote before each call of a distributed step costs, by number of ranks and
transport: shared memory (every rank on one host) against one gloo all-reduce.

Starts N CPU processes joined by gloo for each N, each builds the vote of a step
(`graphstep.distributed.Ranks`) and times `Ranks.agree` back to back: the host time one call of
a captured step spends agreeing with the other ranks before it replays. Writes
benchmarks/results/cpu_<date>_vote-cost.{json,md}.

Run: `PYTHONPATH=src python benchmarks/vote_cost.py [--ranks 2,4,8,16,32] [--calls 2000]`.
On a machine with fewer cores than ranks the processes take turns on the cores: the numbers
then measure the operating system's scheduling as much as the vote (the table says so).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

METHODS = {"shm": "shared memory", "gloo": "gloo all-reduce"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, port: int, method: str, calls: int, out: object) -> None:
    os.environ["GRAPHSTEP_VOTE"] = "gloo" if method == "gloo" else ""
    import torch.distributed as dist

    from graphstep.distributed.ranks import Phase, Ranks

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        ranks = Ranks(dist.group.WORLD)
        for _ in range(min(200, calls)):
            ranks.agree(Phase.REPLAY, False)
        dist.barrier()
        times = []
        start = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            ranks.agree(Phase.REPLAY, False)
            times.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        dist.barrier()
        dist.destroy_process_group()
        times.sort()
        out.put(
            (
                rank,
                {
                    "board": ranks.board.name,
                    "median_us": statistics.median(times) * 1e6,
                    "p90_us": times[int(0.9 * len(times))] * 1e6,
                    "mean_us": total / calls * 1e6,
                },
            )
        )
    except Exception as exc:  # reported, not hung
        out.put((rank, {"error": repr(exc)}))


def measure(size: int, method: str, calls: int, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, size, port, method, calls, out), daemon=True) for r in range(size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(size):
            rank, value = out.get(timeout=timeout)
            results[rank] = value
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if len(results) < size or any("error" in r for r in results.values()):
        return {"ranks": size, "method": method, "error": str(results)[:500] or "timed out"}
    per_rank = [results[r] for r in range(size)]
    return {
        "ranks": size,
        "method": method,
        "board": per_rank[0]["board"],
        "calls": calls,
        "median_us": statistics.median(r["median_us"] for r in per_rank),
        "worst_rank_median_us": max(r["median_us"] for r in per_rank),
        "p90_us": statistics.median(r["p90_us"] for r in per_rank),
        "mean_us": statistics.median(r["mean_us"] for r in per_rank),
    }


def machine() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_before": os.getloadavg(),
    }


def markdown(info: dict, rows: list[dict]) -> str:
    lines = [
        f"# Vote cost per call by rank count — CPU ({info['cpu']}, {info['cores']} cores), "
        f"torch {info['torch']}, {info['date']}",
        "",
        "`Ranks.agree` timed back to back in N gloo CPU processes on one host (the host time a call of a "
        "distributed step spends agreeing before it replays). Median over ranks of each rank's median; "
        f"{rows[0].get('calls', '?')} calls per rank after 200 warm-up calls. Load average of the (shared) "
        f"machine before: {info['load_average_before']}, after: {info['load_average_after']}.",
        "",
        "| ranks | shared memory µs (median / p90 / mean) | gloo all-reduce µs (median / p90 / mean) | gloo / shm |",
        "|---|---|---|---|",
    ]
    by = {(r["ranks"], r["method"]): r for r in rows}
    for size in sorted({r["ranks"] for r in rows}):
        cells = []
        for method in METHODS:
            r = by.get((size, method), {})
            if "median_us" in r:
                cells.append(f"{r['median_us']:.1f} / {r['p90_us']:.1f} / {r['mean_us']:.1f}")
            else:
                cells.append(r.get("error", "—")[:80])
        shm, gloo = by.get((size, "shm"), {}), by.get((size, "gloo"), {})
        ratio = (
            f"{gloo['median_us'] / shm['median_us']:.0f}x"
            if "median_us" in shm and "median_us" in gloo
            else ""
        )
        over = " (oversubscribed)" if size > info["cores"] else ""
        lines.append(f"| {size}{over} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="2,4,8,16,32")
    parser.add_argument("--methods", default="shm,gloo")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    info = machine()
    rows = []
    for size in (int(n) for n in args.ranks.split(",")):
        for method in args.methods.split(","):
            # Fewer calls where each takes milliseconds (many processes sharing few cores).
            calls = args.calls if size <= 2 * info["cores"] else max(200, args.calls // (size // 4))
            row = measure(size, method, calls, args.timeout)
            print(json.dumps(row), flush=True)
            rows.append(row)
    info["load_average_after"] = os.getloadavg()
    info["date"] = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_{info['date']}_vote-cost"
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(info, rows))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
