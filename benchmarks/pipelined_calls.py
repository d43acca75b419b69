"""Every call's host time in the bench's pipelined loop, tiny GPT: where the hand-written loop and graphstep block.

The tiny GPT's step is GPU-bound (~0.8 ms of kernels, ~50 µs of host per call), so 100 calls in a row fill the
GPU's launch queue and from then on calls wait for it. `graphstep bench` reports the median host time of those
calls; when more than half of them wait, the median jumps from ~50 µs to ~300 µs. This script records every
call's host time (and the whole loop iteration's, batch and scheduler included) for:

- `manual_graph`: the bench's hand-written graph (two `copy_`s and a launch);
- `graphstep`: the default step (one `_foreach_copy_` for the inputs, outputs from the ring);
- `graphstep_plain_copies`: the same with the inputs copied one `copy_` each (`_foreach_copy_` made to fail,
  so the loader takes its per-tensor path);

rounds interleaved, and reports per variant: median, mean, calls over 200 µs, the first such call, the loop's
wall time per call. Writes benchmarks/results/<gpu>_<date>_pipelined-calls.json (per-call times included).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

import graphstep

sys.path.insert(0, str(Path(__file__).parent))
import guard_cost
import pipelined_host

CALLS = 100
ROUNDS = 7
WAITED_US = 200.0


@contextlib.contextmanager
def plain_copies():
    """`torch._foreach_copy_` raises: graphstep's loader falls back to one `copy_` per input."""
    real = torch._foreach_copy_

    def refuse(*args, **kwargs):
        raise RuntimeError("diagnostic: per-tensor copies")

    torch._foreach_copy_ = refuse
    try:
        yield
    finally:
        torch._foreach_copy_ = real


def one_round(step, batches, after_call) -> dict:
    torch.cuda.synchronize()
    call_us, iteration_us = [], []
    start = time.perf_counter_ns()
    for _ in range(CALLS):
        i0 = time.perf_counter_ns()
        args = next(batches)
        c0 = time.perf_counter_ns()
        step(*args)
        c1 = time.perf_counter_ns()
        after_call()
        iteration_us.append((time.perf_counter_ns() - i0) / 1e3)
        call_us.append((c1 - c0) / 1e3)
    host_end = time.perf_counter_ns()
    torch.cuda.synchronize()
    end = time.perf_counter_ns()
    waited = [i for i, t in enumerate(call_us) if t > WAITED_US]
    return {
        "median_us": statistics.median(call_us),
        "mean_us": statistics.mean(call_us),
        "calls_over_200us": len(waited),
        "first_over_200us": waited[0] if waited else None,
        "outside_call_us": sum(iteration_us) - sum(call_us),
        "host_loop_ms": (host_end - start) / 1e6,
        "wall_ms_per_call": (end - start) / 1e6 / CALLS,
        "call_us": [round(t, 1) for t in call_us],
    }


def main() -> None:
    args = pipelined_host.parse_args(__doc__)
    steps, closers = pipelined_host.warmed_steps()
    variants = {
        "manual_graph": (steps["manual_graph"][:2], contextlib.nullcontext),
        "graphstep": (steps["graphstep"][:2], contextlib.nullcontext),
        "graphstep_plain_copies": (steps["graphstep"][:2], plain_copies),
    }
    no_scheduler = lambda: None  # noqa: E731 - the gpt suite has no scheduler; the bench calls after_call()
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, ((step, batches), context) in variants.items():
            with context():
                rounds[name].append(one_round(step, batches, no_scheduler))
    for close in closers:
        close()
    summary = {}
    for name, rs in rounds.items():
        summary[name] = {
            key: [round(r[key], 1) if isinstance(r[key], float) else r[key] for r in rs]
            for key in rs[0]
            if key != "call_us"
        }
        print(name)
        for key, values in summary[name].items():
            print(f"  {key:20s} {values}")
    result = {
        **guard_cost.header("cuda"),
        "graphstep": graphstep.__version__,
        "config": f"tiny GPT as in `graphstep bench --suite gpt`; {CALLS} calls in a row per round after a "
        f"synchronize, {ROUNDS} rounds, variants interleaved; 'over 200 µs' = a call that waited for the GPU",
        "summary": summary,
        "call_us": {name: [r["call_us"] for r in rs] for name, rs in rounds.items()},
    }
    guard_cost.write(result, args.out, "pipelined-calls")


if __name__ == "__main__":
    main()
