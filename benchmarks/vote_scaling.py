"""The vote's cost by rank count: a CPU simulation with 8, 16 and 32 gloo processes on one host.

Every call of a distributed step starts with the vote (`Ranks.agree`, distributed/vote.py): one
element-wise maximum of four integers over the ranks. This starts N processes (a gloo process group,
no GPU), and in each times `calls` votes of a replaying step through both transports, shared memory
(one host) and a gloo all-reduce (what ranks on several hosts use today), and through the two-level
vote docs/distributed.md proposes past one host (`TwoLevelBoard`: shared memory within simulated
hosts of 8 ranks, gloo between one leader per host). The ranks do nothing else: the
numbers are the vote alone. On a machine with fewer cores than ranks the processes share cores, so
the times include the operating system's scheduling (see the result's "cores").

Run: `python benchmarks/vote_scaling.py [--ranks 8,16,32] [--calls 300] [--out benchmarks/results]`;
writes cpu_<date>_vote-scaling.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

METHODS = ("shm", "gloo", "two_level")
NAMES = {"shm": "shared memory", "gloo": "gloo", "two_level": "two-level"}
HOST = 8
"""Ranks per simulated host in the two-level vote (a host of eight GPUs)."""


class TwoLevelBoard:
    """The vote across hosts as docs/distributed.md proposes it, simulated on one host: ranks in groups
    of HOST ("hosts") take the maximum through shared memory, one leader per group takes the maximum of
    the leaders' over gloo, and hands it back through shared memory. The maximum is associative, so the
    answer is the flat one's."""

    name = "two-level"

    def __init__(self, rank: int, size: int):
        from graphstep.distributed import vote

        self.rank, self.size = rank, size
        hosts = [list(range(h, min(h + HOST, size))) for h in range(0, size, HOST)]
        groups = [dist.new_group(members) for members in hosts]  # every rank makes every group
        leaders = dist.new_group([members[0] for members in hosts])
        self.local = vote.open_board(groups[rank // HOST])
        self.leaders = vote.GlooBoard(leaders) if rank % HOST == 0 else None

    def max(self, values: list[int]) -> list[int]:
        top = self.local.max(values)
        if self.leaders is not None:
            top = self.leaders.max(top)
        return self.local.max(top)  # the leader's is the largest: everyone reads the global maximum

    def gather_text(self, text: str) -> list[str]:
        raise NotImplementedError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, port: int, calls: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    from graphstep.distributed.ranks import Phase, Ranks

    result = {}
    for method in METHODS:
        os.environ["GRAPHSTEP_VOTE"] = "gloo" if method == "gloo" else ""
        ranks = Ranks(dist.group.WORLD)
        if method == "two_level":
            ranks.board = TwoLevelBoard(rank, size)
        assert ranks.board.name == NAMES[method], ranks.board.name
        for _ in range(10):  # connections made, caches warm
            ranks.agree(Phase.REPLAY, False)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            ranks.agree(Phase.REPLAY, False)
            times.append(time.perf_counter() - start)
        times.sort()
        result[method] = (statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6)
    out.put((rank, result))
    dist.destroy_process_group()


def measure(size: int, calls: int) -> dict:
    ctx = mp.get_context("fork")  # torch is imported once, here: starting 32 ranks stays cheap
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, calls, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in range(size))
    for p in procs:
        p.join(timeout=30)
    row: dict = {"ranks": size}
    for method in METHODS:
        # A vote ends for every rank at about the same moment: the slowest rank's median is the cost.
        row[f"{method}_median_us"] = round(max(r[method][0] for r in results.values()), 1)
        row[f"{method}_p90_us"] = round(max(r[method][1] for r in results.values()), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="8,16,32")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = []
    for size in map(int, args.ranks.split(",")):
        rows.append(measure(size, args.calls))
        print(rows[-1], flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    result = {
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "config": (
            f"N gloo processes on one host, each timing {args.calls} votes of a replaying step "
            "(Ranks.agree(Phase.REPLAY)) after 10 untimed; per transport the slowest rank's median "
            f"and 90th percentile; two-level: simulated hosts of {HOST} ranks (shared memory), one "
            "leader each exchanging over gloo"
        ),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_{result['date']}_vote-scaling"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# The vote's cost by rank count — {result['machine']}, torch {result['torch']}, {result['date']}",
        "",
        result["config"] + ". More ranks than cores: the times include the scheduler's.",
        "",
        "| ranks | shared memory, median µs | p90 µs | gloo all-reduce, median µs | p90 µs | "
        f"two-level ({HOST} per host), median µs | p90 µs |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['ranks']} | {r['shm_median_us']} | {r['shm_p90_us']} | {r['gloo_median_us']} | {r['gloo_p90_us']} | "
        f"{r['two_level_median_us']} | {r['two_level_p90_us']} |"
        for r in rows
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md", flush=True)


if __name__ == "__main__":
    main()
