"""What the guards cost per replay, for a model with 1,000 parameter tensors.

Times `StateGuard.holds()` (the check every replay pays) for each `Config.check` mode, each part
of it (`state_guard.holds_parts()`: structure epoch, module modes and attributes, reads, optimizers,
grads, requires_grad, data pointers), `holds()` after a module attribute was written with an equal
value (the barrier marks it; one attribute is compared), and on a GPU the host time of a whole
replay call. Then the same step reading numbers inside containers (`contents.py`): none, 100 dict
entries (10 dicts of 10 in one global dict), 100 list items (10 lists of 10), with `holds()` after
no change and after one entry was written with an equal value. Writes
benchmarks/results/<device>_<date>_guards.json.

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
from graphstep.guards.state_guard import holds_parts

N_LAYERS = 500  # Linear(16, 16) with bias: 2 tensors each -> 1,000 parameter tensors


# Containers a step reads (guarded by content): 100 numbers in dicts, 100 in lists.
DICTS = {f"group{i}": {f"w{j}": 1.0 for j in range(10)} for i in range(10)}
LISTS = [[1.0] * 10 for _ in range(10)]


def no_factor() -> float:
    return 1.0


def dict_factor() -> float:
    return sum(w for group in DICTS.values() for w in group.values()) / 100


def list_factor() -> float:
    return sum(w for group in LISTS for w in group) / 100


FACTORS = {"none": no_factor, "100 dict entries": dict_factor, "100 list items": list_factor}


def build(check: str, device: str, factor=no_factor):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(N_LAYERS)]).to(device)
    if device == "cuda":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
        config = graphstep.Config(check=check)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
        config = graphstep.Config(check=check, backend="recording")

    def step(x):
        loss = model(x).square().mean() * factor()
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
        from graphstep.bench.runner import gpu_slug

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
    if guard is not None:
        row["parts_us"] = {name: round(median_us(part, n), 2) for name, part in holds_parts(guard).items()}

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


def measure_reads(device: str, n: int) -> list[dict]:
    """`holds()` and its reads part for a step reading no container, 100 dict entries, 100 list items."""
    rows = []
    for name, factor in FACTORS.items():
        step, _ = build("full", device, factor)
        x = torch.randn(8, 16, device=device)
        for _ in range(5):
            step(x)
        sync(device)
        guard = next(iter(step._lives.values())).current.guard
        contents = guard.reads.contents
        row = {
            "reads": name,
            "content_roots": len(contents.roots),
            "dicts_watched": len(contents.watched_dicts),
            "containers_compared_per_replay": len(contents.dicts)
            + len(contents.seqs)
            + len(contents.subsets),
            "guard_us": round(median_us(guard.holds, n), 2),
            "reads_us": round(median_us(guard.reads.holds, n), 2),
        }
        if name != "none":
            group = DICTS["group0"] if factor is dict_factor else LISTS[0]
            key = "w0" if factor is dict_factor else 0
            one = 1.0

            def write_equal(group=group, key=key, one=one):
                group[key] = one + 0.0  # equal, another float object

            def write_and_check(guard=guard):
                write_equal()
                return guard.reads.holds()

            assert write_and_check(), "an equal value must not fail the guard"
            row["reads_after_equal_write_us"] = round(
                median_us(write_and_check, n // 4) - median_us(write_equal, n // 4), 2
            )
        if device == "cuda":

            def call(step=step, x=x):
                step(x)
                torch.cuda.synchronize()

            row["replay_call_us"] = round(median_us(call, 300), 1)
        step.close()
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-n", type=int, default=2000, help="timed calls per measurement")
    parser.add_argument("--tag", default="", help="added to the file name (e.g. before, cpp)")
    parser.add_argument("--reads-only", action="store_true", help="only the rows of container reads")
    args = parser.parse_args()
    rows = []
    for check in () if args.reads_only else ("full", "strict", "off"):
        row = measure(check, args.device, args.n)
        rows.append(row)
        print(f"check={check:6s} holds() {row['guard_us']:8.2f} us   tracked {row['tracked_tensors']}")
        for name, us in row.get("parts_us", {}).items():
            print(f"    {name:26s} {us:8.2f} us")
        if "guard_after_equal_write_us" in row:
            print(f"    {'holds() after equal write':26s} {row['guard_after_equal_write_us']:8.2f} us")
        if "replay_call_us" in row:
            print(f"    whole call, synchronised {row['replay_call_us']:8.1f} us")
    from graphstep.guards import fastcheck

    read_rows = measure_reads(args.device, args.n)
    for row in read_rows:
        extra = (
            f"  after an equal write {row['reads_after_equal_write_us']:.2f} us"
            if "reads_after_equal_write_us" in row
            else ""
        )
        call = f"  whole call {row['replay_call_us']:.1f} us" if "replay_call_us" in row else ""
        print(
            f"reads={row['reads']:17s} holds() {row['guard_us']:8.2f} us   reads part {row['reads_us']:6.2f} us"
            f"   dicts watched {row['dicts_watched']}{extra}{call}"
        )
    optimizer = "AdamW(capturable, foreach)" if args.device == "cuda" else "SGD(momentum=0.9, foreach)"
    result = {
        **header(args.device),
        "config": f"{N_LAYERS} x Linear(16,16) ({N_LAYERS * 2} parameter tensors), {optimizer}; guard_us: "
        f"lowest of {ROUNDS} medians of StateGuard.holds() over {args.n // ROUNDS} calls each; parts_us: each "
        "part of holds() alone, timed the same way; replay_call_us (GPU): the same for a whole call (copy input, guard, replay, clone loss) followed "
        "by torch.cuda.synchronize(), over 300 calls in all",
        "cpp_helper": fastcheck.helper() is not None,
        "rows": rows,
        "dict_watcher": bool(getattr(fastcheck.helper(), "watches_dicts", False)),
        "reads_rows": read_rows,
        "reads_config": "check='full'; the step multiplies its loss by a Python number computed from the "
        "containers; reads_us: ReadGuard.holds() alone (bindings and contents); reads_after_equal_write_us: "
        "one entry rewritten with an equal float before each check (the check compares, then adopts), less "
        "the write itself",
    }
    write(result, args.out, "guards" + (f"_{args.tag}" if args.tag else ""))


if __name__ == "__main__":
    main()
