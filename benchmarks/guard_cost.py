"""What the guards cost per replay, for a model with 1,000 parameter tensors.

Times `StateGuard.holds()` (the check every replay pays) for each `Config.check` mode, each part
of it (`StateGuard.breakdown()`: structure epoch, module modes and attributes, reads, optimizers,
grads, requires_grad, data pointers), `holds()` after a module attribute was written with an equal
value (the barrier marks it; one attribute is compared), and on a GPU the host time of a whole
replay call. Writes benchmarks/results/<device>_<date>_guards.json.

On a GPU machine: `python benchmarks/guard_cost.py` (AdamW capturable, the CUDA graph backend).
Without one: `python benchmarks/guard_cost.py --device cpu` (the recording backend and SGD with
momentum: AdamW on a CPU reads its step count on the host, which a graph cannot replay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import graphstep

N_LAYERS = 500  # Linear(16, 16) with bias: 2 tensors each -> 1,000 parameter tensors


def build(check: str, device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(N_LAYERS)]).to(device)
    if device == "cuda":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
        config = graphstep.Config(check=check)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
        config = graphstep.Config(check=check, backend="recording")

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return graphstep.capture(step, model=model, optimizer=opt, config=config), model


ROUNDS = 5


def median_us(fn, n: int, between=None) -> float:
    """The lowest of ROUNDS medians of n / ROUNDS timed calls each: robust to a busy host.
    `between`: called after each timed call, untimed (a device synchronisation, say)."""
    medians = []
    for _ in range(ROUNDS):
        times = []
        for _ in range(max(1, n // ROUNDS)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            if between is not None:
                between()
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def header(device: str) -> dict:
    """What every results file starts with: the machine, the versions, the date."""
    return {
        "device": device,
        "hardware": machine(device)[0],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def machine(device: str) -> tuple[str, str]:
    """(what ran it, the results file's prefix): the GPU's name, or the CPU's."""
    if device == "cuda":
        from graphstep.demo.bench import gpu_slug

        return torch.cuda.get_device_name(), gpu_slug(torch.cuda.get_device_name())
    return platform.processor() or platform.machine(), "cpu"


def write(result: dict, out: str, name: str) -> None:
    """`<out>/<slug>_<date>_<name>.json`."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{machine(result['device'])[1]}_{result['date']}_{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(check: str, device: str, n: int) -> dict:
    step, model = build(check, device)
    x = torch.randn(8, 16, device=device)
    model[0].in_features = 10**20  # not a cached small int: `ten + 0` below is another object
    for _ in range(5):
        step(x)
    sync(device)
    guard = next(iter(step._lives.values())).current.guard
    row = {"check": check, "parameter_tensors": sum(1 for _ in model.parameters())}
    row["tracked_tensors"] = len(guard.tensors) if guard is not None else 0  # pointer-checked
    row["guard_us"] = round(median_us(guard.holds, n), 2) if guard is not None else 0.0
    if guard is not None and hasattr(guard, "breakdown"):
        row["parts_us"] = {name: round(median_us(part, n), 2) for name, part in guard.breakdown().items()}

        # A write of an equal value in another object (a schedule recomputing Dropout.p, say) marks
        # the module dirty: the next holds() compares that one attribute, then adopts the write.
        ten = model[0].in_features

        def write(model=model, ten=ten):
            model[0].in_features = ten + 0  # a new int object, equal

        def write_and_check(guard=guard):
            write()
            return guard.holds()

        assert write_and_check(), "an equal value must not fail the guard"
        row["guard_after_equal_write_us"] = round(median_us(write_and_check, n) - median_us(write, n), 2)
    if device == "cuda":

        def call(step=step):
            step(x)
            torch.cuda.synchronize()

        row["replay_call_us"] = round(median_us(call, 300), 1)
    step.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-n", type=int, default=2000, help="timed calls per measurement")
    parser.add_argument("--tag", default="", help="added to the file name (e.g. before, cpp)")
    args = parser.parse_args()
    rows = []
    for check in ("full", "strict", "off"):
        row = measure(check, args.device, args.n)
        rows.append(row)
        print(f"check={check:6s} holds() {row['guard_us']:8.2f} us   tracked {row['tracked_tensors']}")
        for name, us in row.get("parts_us", {}).items():
            print(f"    {name:26s} {us:8.2f} us")
        if "guard_after_equal_write_us" in row:
            print(f"    {'holds() after equal write':26s} {row['guard_after_equal_write_us']:8.2f} us")
        if "replay_call_us" in row:
            print(f"    whole call, synchronised {row['replay_call_us']:8.1f} us")
    optimizer = "AdamW(capturable, foreach)" if args.device == "cuda" else "SGD(momentum=0.9, foreach)"
    result = {
        **header(args.device),
        "config": f"{N_LAYERS} x Linear(16,16) ({N_LAYERS * 2} parameter tensors), {optimizer}; guard_us: "
        f"lowest of {ROUNDS} medians of StateGuard.holds() over {args.n // ROUNDS} calls each; parts_us: each "
        "part of holds() alone, timed the same way; replay_call_us (GPU): the same for a whole call (copy input, guard, replay, clone loss) followed "
        "by torch.cuda.synchronize(), over 300 calls in all",
        "cpp_helper": bool(rows[0].get("parts_us", {}).get("pointers_and_requires_grad_cpp")),
        "rows": rows,
    }
    write(result, args.out, "guards" + (f"_{args.tag}" if args.tag else ""))


if __name__ == "__main__":
    main()
