"""What guarding a config object the step reads costs per replay, against a plain dict.

A step multiplies its loss by a number computed from 20 keys of a config that a global holds: a
plain dict, an OmegaConf `DictConfig` (read through its storage, configs.py), the same `DictConfig`
read through the Mapping protocol (the fallback where OmegaConf's storage is not laid out as
expected), a `DictConfig` with 5 of its 20 keys interpolations (`${base.w0}`: the storage of the
whole tree compared), one with an interpolation through a resolver (`${oc.env:...}`: resolved again
on every replay), and an ml_collections `ConfigDict`. For each: host microseconds per `StateGuard.holds()`
(what every replay pays before it launches), per `ReadGuard.holds()` (the reads part, on the Python
path) and per whole call (copy the input in, guard, replay the recorded operations, hand the loss
out) on the recording backend, on this CPU; with the C++ helper where it is built and on the
pure-Python path. Writes benchmarks/results/cpu_<date>_config-guard-cost.json.

    python benchmarks/config_guard_cost.py
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import graphstep
from graphstep.guards import configs, fastcheck

KEYS = [f"w{i}" for i in range(20)]
CFG: object = None  # the config the step reads; set per row


def factor() -> float:
    return sum(float(CFG[k]) for k in KEYS) / len(KEYS)


def dict_config():
    return {k: 1.0 for k in KEYS}


def omegaconf_config(interpolations: int = 0, resolver: bool = False):
    from omegaconf import OmegaConf

    values = {k: (f"${{base.{k}}}" if i < interpolations else 1.0) for i, k in enumerate(KEYS)}
    if resolver:  # an environment variable that is not set: its default
        values[KEYS[-1]] = "${oc.env:GRAPHSTEP_BENCH_UNSET,1.0}"
    return OmegaConf.create({**values, "base": {k: 1.0 for k in KEYS[:interpolations]}})


def configdict_config():
    import ml_collections

    return ml_collections.ConfigDict(dict_config())


ROWS = {
    "dict, 20 keys": (dict_config, False),
    "DictConfig, 20 keys": (omegaconf_config, False),
    "DictConfig, 20 keys, through the Mapping protocol": (omegaconf_config, True),
    "DictConfig, 20 keys, 5 interpolations": (lambda: omegaconf_config(5), False),
    "DictConfig, 20 keys, 1 through a resolver": (lambda: omegaconf_config(resolver=True), False),
    "ConfigDict, 20 keys": (configdict_config, False),
}
ROUNDS = 5


def median_us(fn, n: int) -> float:
    """The lowest of ROUNDS medians of n / ROUNDS timed calls each: robust to a busy host."""
    medians = []
    for _ in range(ROUNDS):
        times = []
        for _ in range(max(1, n // ROUNDS)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def measure(make, through_protocol: bool, n: int) -> dict:
    global CFG
    CFG = make()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step(x):
        loss = model(x).square().mean() * factor()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    captured = graphstep.capture(
        step, model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    x = torch.randn(8, 16)
    # The protocol row: OmegaConf's storage not recognised (as under a version laid out otherwise).
    unrecognised = mock.patch.object(configs, "_omegaconf", lambda cfg, omegaconf: None)
    with unrecognised if through_protocol else contextlib.nullcontext():
        for _ in range(5):  # warm-ups, the capture, replays
            captured(x)
    guard = next(iter(captured._lives.values())).current.guard
    assert guard.holds() and captured.stats.captures == 1
    roots = guard.reads.contents.roots
    row = {
        "content_roots": [r.label.split(" in ")[0] for r in roots],
        "entries_by_content": sum(r.walk.entries for r in roots),
        "config_checks_per_replay": len(guard.reads.contents.calls),
        "identity_pass": guard._identity is not None,
        "guard_us": round(median_us(guard.holds, n), 2),
        "reads_us": round(median_us(guard.reads.holds, n), 2),
        "replay_call_us": round(median_us(lambda: captured(x), n // 4), 1),
    }
    captured.close()
    return row


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("-n", type=int, default=4000, help="timed calls per measurement")
    args = parser.parse_args()
    rows = []
    for path in ("helper", "python"):
        fastcheck.helper.cache_clear()
        os.environ["GRAPHSTEP_FASTCHECK"] = "1" if path == "helper" else "0"
        if path == "helper" and fastcheck.helper() is None:
            print("the C++ helper is not built here: the Python path only")
            continue
        for name, (make, through_protocol) in ROWS.items():
            try:
                row = {"guards": path, "reads": name, **measure(make, through_protocol, args.n)}
            except ImportError as exc:
                print(f"{name}: skipped ({exc})")
                continue
            rows.append(row)
            print(
                f"{path:6s} {name:50s} holds() {row['guard_us']:7.2f} us   reads part {row['reads_us']:7.2f} us"
                f"   whole replay call {row['replay_call_us']:7.1f} us"
            )
    today = datetime.date.today().isoformat()
    result = {
        "device": "cpu",
        "hardware": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": today,
        "versions": {m: _version(m) for m in ("omegaconf", "ml-collections")},
        "config": "recording backend, check='full'; Linear(16,16)-ReLU-Linear(16,1), SGD(momentum=0.9); the step "
        "multiplies its loss by the mean of 20 keys of a config held by a global; guard_us: lowest of "
        f"{ROUNDS} medians of StateGuard.holds() over {args.n // ROUNDS} calls each (after no change: with "
        "the helper, its one C++ identity pass); reads_us: ReadGuard.holds() alone (the Python path of the "
        "reads); replay_call_us: a whole call of the captured step (input copied in, guard, the recorded "
        "operations replayed on the CPU, loss handed out), timed the same way over a quarter as many calls",
        "rows": rows,
    }
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cpu_{today}_config-guard-cost.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
