"""graphstep's replay call on the tiny GPT, stage by stage, in the bench's pipelined loop and after a sync.

benchmarks/graph_launch.py showed that graphstep's graph launches as cheaply as the hand-written one and that
the bench's median hides no deferred work; the gap is in graphstep's own call. This script runs the stages of
`CapturedStep.__call__` for a replay by hand, in order, with a clock read between them: the signature, the
live hyperparameters, the plan (the guards), the input copies, the replay (the output ring's turn, the launch,
the grads put back), the outputs handed out (a copy, or the ring's tensors).
`pipelined`: 100 calls in a row (the queue growing, as in the bench); `synced`: a synchronize before each call.
The sum is compared with the real call, and with the bench's hand-written graph, in the same rounds. Rounds of the variants interleaved, 7 rounds; values
are medians of round medians. Writes benchmarks/results/<gpu>_<date>_replay-stages.json.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from graphstep.bench.measure import make_method_step
from graphstep.signature import Signature

sys.path.insert(0, str(Path(__file__).parent))
import guard_cost
import pipelined_host

CALLS = 100
ROUNDS = 7


def main() -> None:
    args = pipelined_host.parse_args(__doc__)
    wl = pipelined_host.build()
    step, close, captured = make_method_step("graphstep", wl)
    manual_wl = pipelined_host.build()
    manual, _, _ = make_method_step("manual_graph", manual_wl)
    batches = itertools.cycle(wl.batches)
    for _ in range(8):
        step(*next(batches))
        manual(*next(batches))
    torch.cuda.synchronize()
    ctx = captured._ctx
    times: dict[str, list[int]] = collections.defaultdict(list)

    def staged(*a):
        t = [time.perf_counter_ns()]
        signature, leaves = Signature.of(a, {})
        t.append(time.perf_counter_ns())
        ctx.optim.before_call()
        t.append(time.perf_counter_ns())
        life = captured._lifecycle(signature)
        t.append(time.perf_counter_ns())
        life.plan()
        t.append(time.perf_counter_ns())
        life.inputs.load(leaves)
        t.append(time.perf_counter_ns())
        recording = life.current.recording
        outputs = recording.replay(a, {})  # the output ring's turn, the launch, the grads put back
        t.append(time.perf_counter_ns())
        out = life.deliver(outputs)
        t.append(time.perf_counter_ns())
        for name, t0, t1 in zip(STAGES, t, t[1:]):
            times[name].append(t1 - t0)
        return out

    def one_round(fn, sync: bool) -> float:
        torch.cuda.synchronize()
        calls = []
        for _ in range(CALLS):
            a = next(batches)
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            fn(*a)
            calls.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        return statistics.median(calls) / 1e3

    result = {
        **guard_cost.header("cuda"),
        "config": f"tiny GPT as in `graphstep bench --suite gpt`; {CALLS} calls per round, {ROUNDS} rounds, "
        "interleaved; medians of round medians, µs",
        "grads_put_back_per_replay": len(life_of(captured).current.recording.grads_after),
        "output_ring": life_of(captured).current.recording.ring is not None,
    }
    for mode in ("pipelined", "synced"):
        calls = collections.defaultdict(list)
        stage_rounds = collections.defaultdict(list)
        for _ in range(ROUNDS):
            calls["manual_graph"].append(one_round(manual, mode == "synced"))
            calls["graphstep"].append(one_round(step, mode == "synced"))
            times.clear()
            calls["staged"].append(one_round(staged, mode == "synced"))
            for name, v in times.items():
                stage_rounds[name].append(statistics.median(v) / 1e3)
        result[mode] = {
            "call_us": {k: round(statistics.median(v), 1) for k, v in calls.items()},
            "stages_us": {k: round(statistics.median(v), 2) for k, v in stage_rounds.items()},
        }
        print(mode, result[mode])
    close()
    guard_cost.write(result, args.out, "replay-stages")


STAGES = (
    "signature",
    "live_hyperparameters",
    "lifecycle",
    "plan_guards",
    "input_copies",
    "replay",
    "outputs",
)


def life_of(captured):
    return next(iter(captured._lives.values()))


if __name__ == "__main__":
    main()
