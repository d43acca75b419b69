"""Host time per call in the bench's pipelined loop (100 calls in a row, the GPU queue growing), on the tiny
GPT: graphstep against the hand-written graph, and what in between costs what.

`graphstep bench` reports the median host time of a pipelined call. There, graphstep's own Python costs
several times what it costs in short bursts (benchmarks/host_cost.py), while the hand-written loop's CUDA calls
cost about the same. This script puts the two side by side and splits the difference, each variant run in
rounds interleaved with the others (rounds vary by tens of µs on a shared host), median of round medians:

- `manual_graph`: the bench's hand-written graph (copy inputs, launch; returns its output buffer);
- `hand`, `hand_clone`: the same calls on graphstep's own graph, without and with a copy of the loss;
- `python_then_hand_clone`: graphstep's per-replay Python (signature, live hyperparameters, guards), then
  `hand_clone`: what the Python costs when interleaved with a deep queue;
- `graphstep`, `graphstep_outputs_graph` (`Config(outputs="graph")`: no copy of the outputs), and
  `graphstep_gc_off` (Python's cyclic GC disabled during the round).

Also the GC's allocation count per call and collections per 300 calls. Run on a GPU machine; writes
benchmarks/results/<gpu>_<date>_pipelined-host.json.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import statistics
import sys
from pathlib import Path

import torch

import graphstep
from graphstep.bench.measure import calls_in_a_row, make_method_step
from graphstep.bench.suites import suites
from graphstep.bench.workloads import BuildContext
from graphstep.signature import Signature

sys.path.insert(0, str(Path(__file__).parent))
import guard_cost

CALLS = 100
ROUNDS = 7


def build():
    return suites()["gpt"]["tiny"].build(BuildContext(device=torch.device("cuda"), n_calls=400))


def round_median_us(step, batches) -> float:
    torch.cuda.synchronize()
    times = calls_in_a_row(step, batches, CALLS)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def warmed_steps() -> tuple[dict, list]:
    """The tiny GPT as graphstep, graphstep with `outputs="graph"` and the hand-written graph, each
    past its capture: {name: (step, batches, CapturedStep or None)}, and what closes them."""
    steps, closers = {}, []
    for name, config in (
        ("graphstep", None),
        ("graphstep_outputs_graph", {"outputs": "graph"}),
        ("manual_graph", None),
    ):
        wl = build()
        step, close, captured = make_method_step(name.removesuffix("_outputs_graph"), wl, config)
        for i in range(8):
            step(*wl.batches[i % len(wl.batches)])
        steps[name] = (step, itertools.cycle(wl.batches), captured)
        closers.append(close)
    return steps, closers


def parse_args(description: str) -> argparse.Namespace:
    """`--out`, the results folder, with the script's docstring as help."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results")
    return parser.parse_args()


def main() -> None:
    args = parse_args(__doc__)
    steps, closers = warmed_steps()
    torch.cuda.synchronize()
    step, batches, _ = steps["graphstep"]
    # Launched by hand below: the step whose outputs are the graph's (an output ring would lose count).
    hand_step = steps["graphstep_outputs_graph"][2]
    life = next(iter(hand_step._lives.values()))
    ctx, recording = hand_step._ctx, life.current.recording
    buffers, loss = life.inputs.tensors, recording.outputs

    def hand(*a):
        for buffer, t in zip(buffers, a):
            buffer.copy_(t)
        for part in recording.parts:
            part()
        return loss

    def hand_clone(*a):
        return hand(*a).clone()

    def python_then_hand_clone(*a):
        Signature.of(a, {})
        ctx.optim.before_call()
        life.plan()
        return hand_clone(*a)

    variants = {
        "manual_graph": steps["manual_graph"][:2],
        "hand": (hand, batches),
        "hand_clone": (hand_clone, batches),
        "python_then_hand_clone": (python_then_hand_clone, batches),
        "graphstep": (step, batches),
        "graphstep_outputs_graph": steps["graphstep_outputs_graph"][:2],
    }
    rounds = collections.defaultdict(list)
    for _ in range(ROUNDS):
        for name, (fn, data) in variants.items():
            rounds[name].append(round_median_us(fn, data))
        gc.disable()
        rounds["graphstep_gc_off"].append(round_median_us(step, batches))
        gc.enable()
    gc.collect()
    count = gc.get_count()[0]
    gc.disable()
    for _ in range(CALLS):
        step(*next(batches))
    allocations = (gc.get_count()[0] - count) / CALLS
    gc.enable()
    collections_seen = [0]
    gc.callbacks.append(
        lambda phase, info: collections_seen.__setitem__(0, collections_seen[0] + (phase == "start"))
    )
    for _ in range(300):
        step(*next(batches))
    gc.callbacks.pop()
    for close in closers:
        close()
    result = {
        **guard_cost.header("cuda"),
        "graphstep": graphstep.__version__,
        "config": f"tiny GPT as in `graphstep bench --suite gpt` (bf16 autocast, AdamW made capturable, clip 1.0); "
        f"{CALLS} calls in a row per round, host time of each call, median per round; {ROUNDS} rounds of every "
        "variant interleaved; the value is the median of the round medians",
        "median_us": {k: round(statistics.median(v), 1) for k, v in rounds.items()},
        "rounds_us": {k: [round(x, 1) for x in v] for k, v in rounds.items()},
        "gc_count_per_graphstep_call": allocations,
        "gc_collections_in_300_graphstep_calls": collections_seen[0],
    }
    for k, v in result["median_us"].items():
        print(f"{k:26s} {v:8.1f} µs   rounds {result['rounds_us'][k]}")
    guard_cost.write(result, args.out, "pipelined-host")


if __name__ == "__main__":
    main()
