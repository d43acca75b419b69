"""Peak memory of the models suite's MoE row, eager against graphstep, per experts backend (issue 42: with
graph breaks graphstep reserved 2.2x eager's peak; the target is <= 1.1x).

Each (experts backend, method) runs in a fresh process on a fresh model: the bench's `mixtral_moe` workload
(transformers Mixtral, 4 x 256, 8 experts top 2, auxiliary loss, AdamW + cosine, clip 1.0, bf16 autocast,
batch 8 x 128), 12 calls. After the first call, the last warm-up, the capture and the last call it reads
the allocator: peak allocated and reserved, reserved in the step's current pool, in other private pools
(a pool a failed capture left behind, and what its free segments still hold), and in the default pool;
graphstep's breaks and its segments' host time per call.

    python benchmarks/moe_memory.py                       # every backend, both methods
    python benchmarks/moe_memory.py --experts eager       # one backend

Writes benchmarks/results/<gpu>_<date>_moe-memory.json and prints a markdown table. Run on a GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

GIB = 2**30
METHODS = ("eager", "graphstep")
EXPERTS = ("eager", "grouped_mm", "batched_mm")
CALLS = 12


def pools(current) -> dict:
    """Reserved memory by pool: the step's current pool, other private pools, the default pool; and the
    bytes of wholly free segments in other private pools (what a stranded pool keeps from the driver)."""
    inside = other = default = stranded = 0
    for s in torch.cuda.memory_snapshot():
        pool = tuple(s.get("segment_pool_id", (0, 0)))
        if current is not None and pool == tuple(current):
            inside += s["total_size"]
        elif pool == (0, 0):
            default += s["total_size"]
        else:
            other += s["total_size"]
            stranded += s["total_size"] if s["allocated_size"] == 0 else 0
    g = lambda b: round(b / GIB, 4)  # noqa: E731
    return {"pool_gib": g(inside), "other_pools_gib": g(other), "free_in_other_pools_gib": g(stranded),
            "default_pool_gib": g(default)}  # fmt: skip


def run(method: str, experts: str) -> dict:
    from graphstep.bench.measure import make_method_step, segments_host_ms
    from graphstep.bench.models import mixtral_moe
    from graphstep.bench.workloads import BuildContext

    device = torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # (cpu: a smoke test of this script)
    ctx = BuildContext(device=device, n_calls=CALLS, tiny=device.type == "cpu")
    # main before issue 42 has the "eager" row only: `--experts eager` runs against it too
    workload = mixtral_moe(ctx) if experts == "eager" else mixtral_moe(ctx, experts=experts)
    step, close, captured = make_method_step(method, workload)
    batches = itertools.cycle(workload.batches)
    phases = {}
    for i in range(CALLS):
        step(*next(batches))
        workload.after_call()
        torch.cuda.synchronize()
        if i in (0, 2, 4, CALLS - 1):
            current = getattr(captured._ctx.backend, "pool", None) if captured is not None else None
            phases[f"after_call_{i + 1}"] = {
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 4),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 4),
                "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 4),
                "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 4),
                **pools(current),
            }
    out = {"phases": phases, "last": phases[f"after_call_{CALLS}"]}
    if captured is not None:
        s = captured.stats
        out["graphstep"] = {"graph_breaks": s.graph_breaks, "captures": s.captures, "replays": s.replays,
                            "segments_host_ms": segments_host_ms(captured) if device.type == "cuda" else None}  # fmt: skip
    if close is not None:
        close()
    return out


def _ratio(row: dict, eager: dict | None, key: str) -> str:
    return f"{row[key] / eager[key]:.2f}" if eager and eager[key] else "—"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--experts", choices=EXPERTS, action="append", help="experts backend (repeatable)")
    parser.add_argument("--method", choices=METHODS, help="run one method here (the parent runs each alone)")
    args = parser.parse_args()
    if args.method:  # a child: one method in a fresh process, its phases as JSON on the last line
        print(json.dumps(run(args.method, args.experts[0])))
        return
    import transformers

    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "config": "bench models suite mixtral_moe: Mixtral 4 x 256, 8 experts top 2, aux loss 0.02, batch 8 x 128, "
        f"AdamW + cosine, clip 1.0, bf16 autocast; {CALLS} calls; each (experts, method) in a fresh process",
        "rows": {},
    }
    lines = ["| experts | method | peak allocated GiB | × eager | peak reserved GiB | × eager | left in other pools "
             "GiB (free) | breaks | segments' host ms/call |", "|---|---|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for experts in args.experts or EXPERTS:
        rows = {}
        for method in METHODS:
            cmd = [sys.executable, __file__, "--method", method, "--experts", experts]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                rows[method] = {"error": done.stderr[-3000:]}
                print(f"{experts}/{method} failed:\n{done.stderr[-3000:]}")
                continue
            rows[method] = json.loads(done.stdout.strip().splitlines()[-1])
        result["rows"][experts] = rows
        eager = rows.get("eager", {}).get("last")
        for method, row in rows.items():
            last = row.get("last")
            if last is None:
                lines.append(f"| {experts} | {method} | error | | | | | | |")
                continue
            gs = row.get("graphstep", {})
            seg = gs.get("segments_host_ms")
            lines.append(
                f"| {experts} | {method} | {last['peak_allocated_gib']:.3f} | {_ratio(last, eager, 'peak_allocated_gib')} | "
                f"{last['peak_reserved_gib']:.3f} | {_ratio(last, eager, 'peak_reserved_gib')} | {last['other_pools_gib']:.3f} "
                f"({last['free_in_other_pools_gib']:.3f}) | {gs.get('graph_breaks', '')} | "
                f"{'' if seg is None else f'{seg:.2f}'} |"
            )
    table = "\n".join(lines)
    print(table)
    result["table"] = table
    from graphstep.bench.runner import gpu_slug

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{gpu_slug(result['gpu'])}_{result['date']}_moe-memory.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
