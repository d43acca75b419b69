"""Where graphstep's host time per replayed call goes (issue 13: <= 25 us on the tiny GPT, <= 50 us
on the 1,000-tensor model of guard_cost.py with check="full").

For each model, after capture, every stage of a replayed call is timed alone, and the whole call:

- `signature`: flattening the arguments and building the key that picks a graph;
- `live_hyperparameters`: `OptimizerAdapter.before_call()` (numbers a scheduler assigned go into the
  graph's tensors);
- `plan_and_guards`: `Lifecycle.plan()`, i.e. `StateGuard.holds()`;
- `input_copies`: copying the call's tensors into the graph's input buffers;
- `replay`: `Recording.replay` (the graph launch(es) plus re-attaching grads);
- `outputs`: cloning the outputs;
- `whole_call`: `step(*args)`;
- `bare_launch`: the graph parts alone (`CUDAGraph.replay()`);
- `hand_written_call`: what the loop of a hand-written whole-step graph does per step: copy the inputs
  into the graph's buffers, launch, clone the loss.

`graphstep_us = whole_call - hand_written_call`: graphstep's own host time per call. (On the H100 a
launch right after the input copies costs more than a launch on an idle stream, so the stages do not
add up to the whole call; the hand-written loop pays that too.) Each number is the lowest of 5 medians of n/5 calls; on a GPU
the device is synchronised after every timed call, outside the timing, so no call waits for an earlier
one. On a CPU the recording backend stands in for CUDA graphs, and its recorded operations are replaced
by no-ops after capture: what is left is graphstep's own Python, the same as on a GPU.

Synchronised calls are the worst case for host time: each starts after the host thread sat waiting
for the GPU, with its caches (and, on some hosts, its clock) cold. A training loop that does not
synchronise runs its calls back to back while the GPU works through the queue. `back_to_back` times
that too, for the whole call and the hand-written one: after a synchronisation and 2 untimed calls,
`BURST` calls in a row, host time divided by `BURST` (few enough that the GPU queue never fills, so
no launch waits for the GPU); the lowest of 5 medians of such bursts.

Writes benchmarks/results/<device>_<date>_host-cost[_TAG].json. `--tag before --calls-only` with PYTHONPATH
pointing at an older checkout's src gives the before column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import graphstep
from graphstep.signature import Signature

sys.path.insert(0, str(Path(__file__).parent))
import guard_cost


def tiny_gpt(device: str):
    from graphstep.demo.gpt import GPT, TINY, make_batches
    from graphstep.demo.train import make_optimizer, make_train_step

    torch.manual_seed(0)
    model = GPT(TINY).to(device)
    if device == "cuda":
        opt = make_optimizer(model, torch.device(device))
        config = graphstep.Config()
    else:  # AdamW on a CPU reads its step count on the host: SGD with momentum stands in
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
        config = graphstep.Config(backend="recording")
    fn = make_train_step(model, opt, amp=device == "cuda")
    x, y = make_batches(TINY, batch_size=8, n_batches=1, device=device)[0]
    return graphstep.capture(fn, model=model, optimizer=opt, config=config), (x, y)


def thousand_tensors(device: str):
    step, _ = guard_cost.build("full", device)
    return step, (torch.randn(8, 16, device=device),)


BURST = 10
"""Calls per timed burst: the tiny GPT queues about 1 ms of GPU work per call, the 1,000-tensor
model more, so 12 calls stay far from the launch queue's depth."""


def back_to_back_us(fn, n: int, sync) -> float:
    """Host time of one call among calls in a row: see the module's docstring."""

    def burst() -> None:
        for _ in range(BURST):
            fn()

    def settle() -> None:
        sync()
        fn()
        fn()

    settle()
    return guard_cost.median_us(burst, max(guard_cost.ROUNDS, n // BURST), between=settle) / BURST


def stages(step, args: tuple, n: int, sync, calls_only: bool = False) -> dict:
    for _ in range(5):
        step(*args)
    sync()
    life = next(iter(step._lives.values()))
    ctx = step._ctx
    recording = life.current.recording
    if ctx.backend.name != "cuda":  # time graphstep's Python, not the recording's operations
        recording.parts = [lambda: None for _ in recording.parts]
    _, leaves = Signature.of(args, {})

    def bare_launch():
        recording.launch()

    inputs = getattr(life, "inputs", None)
    buffers = inputs.tensors if inputs is not None else life.buffers  # the latter: before buffers.py
    outputs = recording.outputs

    def hand_written():  # what a hand-written graph's loop does per step
        for buffer, t in zip(buffers, leaves):
            if t is not buffer:
                buffer.copy_(t)
        bare_launch()
        return outputs.clone()

    parts = (
        {}
        if calls_only
        else {
            "signature": lambda: Signature.of(args, {}),
            "live_hyperparameters": ctx.optim.before_call,
            "plan_and_guards": life.plan,
            "input_copies": lambda: life.inputs.load(leaves),
            "replay": lambda: recording.replay(args, {}),
            "outputs": lambda: life.deliver(recording.outputs),
            "bare_launch": bare_launch,
        }
    )
    parts.update(whole_call=lambda: step(*args), hand_written_call=hand_written)
    row = {name: round(guard_cost.median_us(fn, n, between=sync), 2) for name, fn in parts.items()}
    row["graphstep_us"] = round(row["whole_call"] - row["hand_written_call"], 2)
    whole, hand = (back_to_back_us(parts[name], n, sync) for name in ("whole_call", "hand_written_call"))
    row["back_to_back"] = {
        "whole_call": round(whole, 2),
        "hand_written_call": round(hand, 2),
        "graphstep_us": round(whole - hand, 2),
    }
    row["parameter_tensors"] = sum(1 for m in step._state.modules for _ in m.parameters())
    guard = life.current.guard
    row["cpp_guard_helper"] = getattr(guard, "fast", None) is not None
    step.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-n", type=int, default=1000, help="timed calls per stage")
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--calls-only",
        action="store_true",
        help="time the whole call and the hand-written one only (an older checkout, whose stages differ)",
    )
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = {}
    for name, build in (("tiny_gpt", tiny_gpt), ("1000_tensors_check_full", thousand_tensors)):
        step, inputs = build(args.device)
        rows[name] = stages(step, inputs, args.n, sync, args.calls_only)
        print(name, json.dumps(rows[name]))
    result = {
        **guard_cost.header(args.device),
        "graphstep_from": graphstep.__file__,
        "config": "tiny GPT (batch 8x64, AdamW capturable on CUDA, SGD momentum on CPU, bf16 autocast on "
        "CUDA); 500 x Linear(16,16) with check='full' (guard_cost.py). Stages timed alone after capture: "
        f"lowest of {guard_cost.ROUNDS} medians over {args.n // guard_cost.ROUNDS} calls each, device synchronised between calls "
        "outside the timing. graphstep_us = whole_call - hand_written_call (copy inputs, launch, clone loss). "
        f"back_to_back: the same two calls {BURST} in a row after a synchronisation and 2 untimed calls, host "
        f"time / {BURST}, lowest of {guard_cost.ROUNDS} medians.",
        "rows": rows,
    }
    guard_cost.write(result, args.out, "host-cost" + (f"_{args.tag}" if args.tag else ""))


if __name__ == "__main__":
    main()
