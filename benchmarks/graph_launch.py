"""Where the host time of a pipelined call goes, graphstep against the bench's hand-written graph (tiny GPT).

benchmarks/pipelined_host.py found graphstep's calls at ~96 µs against the hand-written graph's ~37 in the
bench's measure (the median host time of one call, 100 calls in a row, the GPU queue growing). This script
asks what that measure leaves out and what a launch itself costs:

- for each variant, the median time of one call (the bench's measure) and the median time from one call's
  start to the next's (the whole loop: it also holds what the driver still does after a call returned);
- `graph.replay()` alone on each graph, and on synthetic graphs of N small kernels (what a node costs);
- the parts of a call on graphstep's graph: the input copies, the launch, the copy of the loss, and the copy of
  the loss after 30 µs of host work (is it slow right after a launch?);
- the same rounds again after one profiler session in the process (CUPTI stays attached);
- what one replay runs, per graph (profiler): kernels, copies, sets, GPU µs, host ops.

Variants are run in rounds interleaved with the others (rounds vary by tens of µs on a shared host); the value is
the median of the round medians. Run on a GPU machine; writes benchmarks/results/<gpu>_<date>_graph-launch.json.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import guard_cost
import pipelined_host

CALLS = 100
ROUNDS = 7


def one_round(fn, batches) -> tuple[float, float]:
    """(median µs of one call, median µs from a call's start to the next's), `CALLS` calls in a row."""
    torch.cuda.synchronize()
    starts, calls = [], []
    for _ in range(CALLS):
        args = next(batches)
        t0 = time.perf_counter_ns()
        fn(*args)
        calls.append(time.perf_counter_ns() - t0)
        starts.append(t0)
    torch.cuda.synchronize()
    loop = [b - a for a, b in itertools.pairwise(starts)]
    return statistics.median(calls) / 1e3, statistics.median(loop) / 1e3


def spin(us: float) -> None:
    end = time.perf_counter_ns() + us * 1e3
    while time.perf_counter_ns() < end:
        pass


def replay_profile(replay, n: int = 3) -> dict:
    """GPU work of one replay by kind, its GPU µs, and the host ops a replay ran."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    kinds: collections.Counter = collections.Counter()
    host_ops: collections.Counter = collections.Counter()
    gpu_us = 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            lowered = e.name.lower()
            kinds["memcpy" if "memcpy" in lowered else "memset" if "memset" in lowered else "kernel"] += 1
            gpu_us += e.self_device_time_total
        elif e.device_type == DeviceType.CPU:
            host_ops[e.name] += 1
    return {
        "per_replay": {k: v / n for k, v in kinds.items()},
        "gpu_us_per_replay": round(gpu_us / n, 1),
        "host_ops_per_replay": {k: v / n for k, v in host_ops.most_common(10)},
    }


def synthetic_graph(nodes: int) -> torch.cuda.CUDAGraph:
    x = torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1)
    graph.keep_alive = x  # type: ignore[attr-defined]
    return graph


def main() -> None:
    args = pipelined_host.parse_args(__doc__)
    steps, closers = pipelined_host.warmed_steps()
    torch.cuda.synchronize()
    manual_graph = steps["manual_graph"][0].graph
    step, batches, _ = steps["graphstep"]
    # Launched by hand below: the step whose outputs are the graph's (an output ring would lose count).
    life = next(iter(steps["graphstep_outputs_graph"][2]._lives.values()))
    (graph,) = life.current.recording.cuda_graphs
    buffers, loss = life.inputs.tensors, life.current.recording.outputs
    split = collections.defaultdict(list)

    def copy_in(*a):
        for buffer, t in zip(buffers, a):
            buffer.copy_(t)

    def hand(*a):
        copy_in(*a)
        graph.replay()
        return loss

    def hand_clone(*a):
        return hand(*a).clone()

    def hand_split(*a, delay_us=0.0):
        t0 = time.perf_counter_ns()
        copy_in(*a)
        t1 = time.perf_counter_ns()
        graph.replay()
        t2 = time.perf_counter_ns()
        if delay_us:
            spin(delay_us)
        t3 = time.perf_counter_ns()
        out = loss.clone()
        t4 = time.perf_counter_ns()
        tag = f"after_{delay_us:.0f}us" if delay_us else "right_after"
        split["copies"].append(t1 - t0)
        split["launch"].append(t2 - t1)
        split[f"loss_copy_{tag}"].append(t4 - t3)
        return out

    synthetic = {n: synthetic_graph(n) for n in (10, 100, 300)}
    variants = {
        "manual_graph": steps["manual_graph"][:2],
        "graphstep": (step, batches),
        "graphstep_outputs_graph": steps["graphstep_outputs_graph"][:2],
        "hand": (hand, batches),
        "hand_clone": (hand_clone, batches),
        "hand_split": (hand_split, batches),
        "hand_split_delay": (lambda *a: hand_split(*a, delay_us=30.0), batches),
        "replay_manual_graph": (lambda *a: manual_graph.replay(), batches),
        "replay_graphstep_graph": (lambda *a: graph.replay(), batches),
        **{f"replay_synthetic_{n}": (lambda *a, g=g: g.replay(), batches) for n, g in synthetic.items()},
    }

    def rounds() -> dict:
        call, loop = collections.defaultdict(list), collections.defaultdict(list)
        split.clear()
        for _ in range(ROUNDS):
            for name, (fn, data) in variants.items():
                c, w = one_round(fn, data)
                call[name].append(c)
                loop[name].append(w)
        return {
            "call_us": {k: round(statistics.median(v), 1) for k, v in call.items()},
            "loop_us": {k: round(statistics.median(v), 1) for k, v in loop.items()},
            "call_rounds_us": {k: [round(x, 1) for x in v] for k, v in call.items()},
            "hand_split_us": {k: round(statistics.median(v) / 1e3, 1) for k, v in split.items()},
        }

    clean = rounds()
    profiles = {
        "graphstep": replay_profile(graph.replay),
        "manual_graph": replay_profile(manual_graph.replay),
    }
    after_profiler = rounds()
    for close in closers:
        close()
    result = {
        **guard_cost.header("cuda"),
        "config": f"tiny GPT as in `graphstep bench --suite gpt`; {CALLS} calls in a row per round; call_us: "
        "median host time of one call (the bench's measure); loop_us: median time from a call's start to the "
        f"next's (fetching the next batch included); {ROUNDS} rounds of every variant interleaved; values are "
        "medians of round medians. Synthetic graphs: N in-place adds on 256 floats. `after_profiler`: the same "
        "rounds after one torch.profiler session in the process.",
        "clean": clean,
        "after_profiler": after_profiler,
        "profiles": profiles,
    }
    for phase in ("clean", "after_profiler"):
        print(f"== {phase}")
        for k, v in result[phase]["call_us"].items():
            print(f"{k:28s} call {v:8.1f} µs   loop {result[phase]['loop_us'][k]:8.1f} µs")
        print("split", result[phase]["hand_split_us"])
    for name, p in profiles.items():
        print(name, p)
    guard_cost.write(result, args.out, "graph-launch")


if __name__ == "__main__":
    main()
