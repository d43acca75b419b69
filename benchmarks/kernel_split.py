"""Where the GPU time of one step goes, per method: the kernels of a `graphstep bench` config.

Made to explain why graphstep needs more kernel time than eager, or graphstep with a compiled model more
than reduce-overhead, on some models (issue 13). Each method's step is warmed up, then 5 steps are
profiled; every GPU event's self time is summed by kernel name, with its launches per step. The
kernels of one method that another lacks are the difference.

`python benchmarks/kernel_split.py [--config vit_s16] [--methods eager,graphstep]` writes
benchmarks/results/<gpu>_<date>_kernel-split_<config>.json. The methods run in this one process, one
after the other (memory is not measured here).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from graphstep.bench.measure import make_method_step
from graphstep.bench.suites import suites
from graphstep.bench.workloads import BuildContext

sys.path.insert(0, str(Path(__file__).parent))
import guard_cost

WARMUP, PROFILED = 8, 5


def split(config: str, method: str, device: str = "cuda") -> dict:
    bc = suites()["models"].get(config) or suites()["gpt"][config]
    workload = bc.build(BuildContext(device=torch.device(device), n_calls=WARMUP + PROFILED))
    step, release, _ = make_method_step(method, workload)
    batches = workload.batches
    for i in range(WARMUP):
        step(*batches[i % len(batches)])
        workload.after_call()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(PROFILED):
            step(*batches[i % len(batches)])
            workload.after_call()
        sync()
    by_name: dict[str, float] = collections.Counter()
    launches: dict[str, int] = collections.Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            by_name[e.name] += e.self_device_time_total / 1e3 / PROFILED
            launches[e.name] += 1
    if release is not None:
        release()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {
        "kernel_ms": round(sum(by_name.values()), 3),
        "top_kernels": [
            {"name": name[:400], "ms_per_step": round(ms, 3), "launches_per_step": launches[name] / PROFILED}
            for name, ms in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="vit_s16")
    parser.add_argument("--methods", default="eager,graphstep")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no GPU kernels)")
    args = parser.parse_args()
    rows = {}
    for method in args.methods.split(","):
        rows[method] = split(args.config, method, args.device)
        print(method, rows[method]["kernel_ms"])
    result = {
        **guard_cost.header(args.device),
        "config": f"{args.config}: {WARMUP} warm-up calls, then {PROFILED} profiled steps; GPU self time per step, "
        "by kernel name, with launches per step (see benchmarks/kernel_split.py)",
        "rows": rows,
    }
    guard_cost.write(result, args.out, f"kernel-split_{args.config}")


if __name__ == "__main__":
    main()
