"""What the guards cost per replay, for a model with 1,000 parameter tensors (AdamW: 2,000 state tensors).

Times `StateGuard.holds()` (the check every replay pays) for each `Config.check` mode, and the host
time of a whole replay call with and without checks. Writes benchmarks/results/<gpu>_<date>_guards.json.
Run on a GPU machine: `python benchmarks/guard_cost.py [--out DIR]`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import graphstep
from graphstep.demo.bench import gpu_slug

N_LAYERS = 500  # Linear(16, 16) with bias: 2 tensors each -> 1,000 parameter tensors


def build(check: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(N_LAYERS)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return graphstep.capture(step, model=model, optimizer=opt, config=graphstep.Config(check=check)), model


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    x = torch.randn(8, 16, device="cuda")
    rows = []
    for check in ("full", "strict", "off"):
        step, model = build(check)
        for _ in range(5):
            step(x)
        torch.cuda.synchronize()
        entry = next(iter(step._entries.values()))
        guard_us = median_us(entry.guard.holds, 2000) if entry.guard is not None else 0.0

        def call(step=step):
            step(x)
            torch.cuda.synchronize()

        call_us = median_us(call, 300)
        parts = {}
        if entry.guard is not None:
            g = entry.guard
            from graphstep import guards

            parts["pointers_cpp_us"] = (
                median_us(lambda g=g: guards._ptrs_equal_in_cpp(g.tensors, g.ptrs, g.indices), 2000)
                if guards._ptrs_equal_in_cpp is not None
                else None
            )
            parts["pointers_python_us"] = median_us(
                lambda g=g: list(map(guards._data_ptr, g.tensors)) == g.ptrs, 2000
            )
            parts["modes_us"] = median_us(
                lambda g=g: list(map(guards._get_training, g.modules)) == g.training, 2000
            )
            print("   parts:", {k: round(v, 2) if v is not None else None for k, v in parts.items()})
        n_params = sum(1 for _ in model.parameters())
        tracked = len(entry.guard.tensors) if entry.guard is not None else 0  # pointer-checked
        rows.append(
            {
                "check": check,
                "guard_us": round(guard_us, 2),
                "replay_call_us": round(call_us, 1),
                "parameter_tensors": n_params,
                "tracked_tensors": tracked,
                **parts,
            }
        )
        print(
            f"check={check:5s} guard {guard_us:8.2f} us   whole call (synchronised) {call_us:8.1f} us   tracked {tracked}"
        )
        step.close()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "config": f"{N_LAYERS} x Linear(16,16) ({N_LAYERS * 2} parameter tensors), AdamW(capturable, foreach), "
        "guard_us: median of StateGuard.holds() over 2000 calls; replay_call_us: median of a whole call "
        "(copy input, guard, replay, clone loss) followed by torch.cuda.synchronize(), over 300 calls",
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu_slug(torch.cuda.get_device_name())}_{result['date']}_guards.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
