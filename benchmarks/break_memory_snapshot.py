"""Where the memory of a step with graph breaks goes, eager against graphstep (issue 42, item 2): one
process per (experts backend, method) on the models suite's MoE row, the allocator's history recorded
from before the model is built (stacks: Python only), one snapshot pickle per process, and at each
method's steady-state peak the bytes live by pool and by what holds them.

graphstep runs until the capture and 3 replays after it (warm-ups, the failed capture that found the
breaks, one more warm-up, the capture); the eager twin runs as many calls. Each call is labelled from
graphstep's counters (warm-up, failed capture + warm-up, capture, replay); a marker allocation between
calls (`_mark`) finds the calls in the allocator's trace. The analysis replays the trace: a call's peak
is the most bytes allocated at once within it; the allocations live there are put in categories by
what holds them at the end (parameters, grads, optimizer state, graphstep's objects by attribute path)
or else by the innermost frame of their stack outside torch (the segment boundary, the output ring, the
model's forward, ...); each allocation's pool comes from the segments seen between calls (the pool of
the current graphs, other private pools such as one abandoned after the failed capture, the default
pool). Reserved bytes per pool at the peak too: a graph's own memory is the pool's, and not counted in
"allocated" while the graph holds it.

    python benchmarks/break_memory_snapshot.py                    # all three experts backends
    python benchmarks/break_memory_snapshot.py --experts eager    # one

Writes benchmarks/results/<gpu>_<date>_break-memory.json, the pickles under
benchmarks/results/snapshots/ (not results: tar them, do not commit them; each kept under 20 MB, frames
and early calls trimmed when needed; open one in https://pytorch.org/memory_viz or with pickle), and
prints the tables. Needs CUDA; the analysis (benchmarks/memory_trace.py) is plain Python on a snapshot
dict, tested on the CPU (tests/test_break_memory.py) and usable on the pickles anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from memory_trace import DEFAULT_POOL, GIB, MARK_BYTES, breakdown, shrink, table  # benchmarks/ is on the path

METHODS = ("eager", "graphstep")
EXPERTS = ("eager", "grouped_mm", "batched_mm")
MAX_CALLS = 24


def _mark() -> None:
    """An allocation of a size no step makes, freed at once: a call's boundary in the trace."""
    torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def _segments(snapshot: dict | None = None) -> list[dict]:
    """Each segment's address, size and pool (the allocator's listing; taking one converts the whole
    trace, seconds with a long history: only before the model and at the end)."""
    return [
        {
            "address": s["address"],
            "total_size": s["total_size"],
            "pool": list(s.get("segment_pool_id", DEFAULT_POOL)),
        }
        for s in (snapshot or torch.cuda.memory._snapshot())["segments"]
    ]


def _walk(root: Any, path: str, out: dict[int, str], seen: set[int], device: str, depth: int = 0) -> None:
    """Label each tensor on `device` reachable from `root` (graphstep's objects, containers) by its path."""
    if depth > 9 or id(root) in seen or len(seen) > 300_000:
        return
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        if root.device.type == device and root.layout == torch.strided:
            out.setdefault(root.untyped_storage().data_ptr(), path)
        return
    if isinstance(root, (torch.nn.Module, torch.optim.Optimizer, str, bytes, int, float, type)):
        return  # modules and optimizers: labelled by role, not by path
    if isinstance(root, dict):
        items = list(root.items())
    elif isinstance(root, (list, tuple, set, frozenset)):
        items = list(enumerate(root))
    elif type(root).__module__.startswith("graphstep"):
        items = list((getattr(root, "__dict__", None) or {}).items())
        items += [(k, getattr(root, k)) for k in getattr(type(root), "__slots__", ()) if hasattr(root, k)]
    else:
        return
    for k, v in items:
        key = f".{k}" if isinstance(k, str) else f"[{k if isinstance(k, int) else type(k).__name__}]"
        _walk(v, path + key, out, seen, device, depth + 1)


def tensor_labels(model: Any, optimizer: Any, captured: Any, device: str = "cuda") -> dict[int, str]:
    """Storage address -> what holds it at the end: parameters, grads, optimizer state, graphstep's
    objects (by their attribute path cut to 4 names, indices dropped, so alike tensors sum up)."""
    out: dict[int, str] = {}
    on = lambda t: isinstance(t, torch.Tensor) and t.device.type == device  # noqa: E731
    for p in model.parameters():
        out.setdefault(p.untyped_storage().data_ptr(), "parameters")
        if on(p.grad):
            out.setdefault(p.grad.untyped_storage().data_ptr(), "grads")
    for state in optimizer.state.values():
        for v in state.values():
            if on(v):
                out.setdefault(v.untyped_storage().data_ptr(), "optimizer state")
    if captured is not None:
        found: dict[int, str] = {}
        _walk(captured, "captured", found, set(), device)
        for ptr, path in found.items():
            out.setdefault(ptr, "graphstep: " + ".".join(p.split("[")[0] for p in path.split(".")[:4]))
    return out


def calls(step: Any, workload: Any, captured: Any, replays: int, into: tuple) -> None:
    """Run the step, a marker before each call: graphstep until `replays` replays after its capture,
    the eager twin as many calls as graphstep made (BREAK_MEMORY_CALLS; 8 alone). Each call's label and
    peaks go `into` (labels, per_call)."""
    labels, per_call = into
    batches = itertools.cycle(workload.batches)
    before = None
    n_calls = int(os.environ.get("BREAK_MEMORY_CALLS", 0)) or (None if captured is not None else 8)
    for call in range(1, MAX_CALLS + 1):
        _mark()
        torch.cuda.reset_peak_memory_stats()
        step(*next(batches))
        workload.after_call()
        torch.cuda.synchronize()
        label = "eager"
        if captured is not None:
            s = captured.stats
            now = (s.warmup_calls, s.captures, s.replays, s.graph_breaks, s.eager_calls)
            d = [a - b for a, b in zip(now, before or (0,) * 5)]
            before = now
            label = (
                "capture" if d[1] else "warm-up" if d[0] else "replay" if d[2] else "eager" if d[4] else "?"
            )
            if d[3]:
                label = f"failed capture ({d[3]} breaks) + {label}"
        labels.append(label)
        per_call.append({"call": call, "label": label,
                         "max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 4),
                         "max_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 4)})  # fmt: skip
        if (n_calls and call >= n_calls) or (captured is not None and labels.count("replay") >= replays):
            return


def run(method: str, experts: str, snapshots: Path, max_entries: int, replays: int) -> dict:
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(
        enabled="all", context="alloc", stacks="python", max_entries=max_entries
    )
    initial = _segments()  # before the model: the process's own (cuBLAS workspaces, none usually)
    from graphstep.bench.measure import make_method_step
    from graphstep.bench.models import mixtral_moe
    from graphstep.bench.workloads import BuildContext

    ctx = BuildContext(device=torch.device("cuda"), n_calls=MAX_CALLS)
    workload = mixtral_moe(ctx) if experts == "eager" else mixtral_moe(ctx, experts=experts)
    step, close, captured = make_method_step(method, workload)
    labels, per_call = [], []
    error = None
    try:  # a failing step still leaves its snapshot: the trace up to the failure is what tells
        calls(step, workload, captured, replays, (labels, per_call))
    except Exception as exc:
        import traceback

        error = traceback.format_exc()[-4000:]
        labels.append(f"raised {type(exc).__name__}")  # the failing call's window, to the next marker
        print(f"{experts}/{method}: {exc!r}", file=sys.stderr)
    _mark()
    current = list(captured._ctx.backend.pool) if captured is not None and captured._ctx is not None else None
    meta = {
        "device": torch.cuda.current_device(),
        "labels": labels,
        "listings": [],  # (call, segments): the pools of the segments alive after that call
        "initial": initial,
        "current_pool": current,
        "tensor_labels": tensor_labels(workload.model, workload.optimizer, captured),
    }
    snapshot = torch.cuda.memory._snapshot()
    meta["listings"] = [(len(labels), _segments(snapshot))]
    torch.cuda.memory._record_memory_history(enabled=None)
    try:  # the pickles are written whatever happens here: they can be read again on any machine
        out = breakdown(snapshot, meta)
    except Exception:
        import traceback

        out = {"error": "breakdown: " + traceback.format_exc()[-3000:]}
    out["per_call_stats"] = per_call
    if error is not None:
        out["error"] = error + out.get("error", "")
    if captured is not None:
        s = captured.stats
        out["graphstep"] = {"graph_breaks": s.graph_breaks, "captures": s.captures, "replays": s.replays,
                            "warmup_calls": s.warmup_calls}  # fmt: skip
    snapshots.mkdir(parents=True, exist_ok=True)
    data, how = shrink(snapshot)
    path = snapshots / f"{experts}_{method}.pickle"
    path.write_bytes(data)
    meta_path = snapshots / f"{experts}_{method}_meta.json"
    meta_path.write_text(
        json.dumps({**meta, "tensor_labels": {str(k): v for k, v in meta["tensor_labels"].items()}})
    )
    out["snapshot"] = {"path": str(path), "bytes": len(data), "kept": how, "meta": str(meta_path)}
    if close is not None:
        close()
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--snapshots", default="benchmarks/results/snapshots", help="where the pickles go")
    parser.add_argument("--experts", choices=EXPERTS, action="append", help="experts backend (repeatable)")
    parser.add_argument("--method", choices=METHODS, help="run one method here (the parent runs each alone)")
    parser.add_argument("--max-entries", type=int, default=300_000, help="the allocator trace's ring buffer")
    parser.add_argument("--replays", type=int, default=3, help="graphstep's replays after the capture")
    parser.add_argument("--timeout", type=int, default=300, help="seconds for each child process")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.method:  # a child: one method in a fresh process, its breakdown as JSON on the last line
        out = run(args.method, args.experts[0], Path(args.snapshots), args.max_entries, args.replays)
        print(json.dumps(out))
        return
    import transformers

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
              "config": "bench models suite mixtral_moe (Mixtral 4 x 256, 8 experts top 2, aux loss 0.02, batch "
              "8 x 128, AdamW + cosine, clip 1.0, bf16 autocast); graphstep until its capture + "
              f"{args.replays} replays, the eager twin as many calls; one process each", "rows": {}}  # fmt: skip
    tables = []
    for experts in args.experts or EXPERTS:
        rows: dict[str, dict] = {}
        calls = None
        for method in ("graphstep", "eager"):  # graphstep first: the eager twin runs as many calls
            cmd = [sys.executable, __file__, "--method", method, "--experts", experts, "--snapshots",
                   args.snapshots, "--max-entries", str(args.max_entries), "--replays", str(args.replays)]  # fmt: skip
            env = dict(os.environ, **({"BREAK_MEMORY_CALLS": str(calls)} if calls else {}))
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            except subprocess.TimeoutExpired as exc:
                rows[method] = {"error": f"timed out after {args.timeout} s: {str(exc.stderr)[-2000:]}"}
                print(f"{experts}/{method} timed out")
                continue
            if done.returncode != 0:
                rows[method] = {"error": done.stderr[-4000:]}
                print(f"{experts}/{method} failed:\n{done.stderr[-4000:]}")
                continue
            rows[method] = json.loads(done.stdout.strip().splitlines()[-1])
            calls = calls or len(rows[method].get("per_call_stats", [])) or None
        result["rows"][experts] = rows
        tables.append(table(experts, rows))
    text = "\n\n".join(tables)
    print(text)
    result["tables"] = text
    from graphstep.bench.runner import gpu_slug

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{gpu_slug(result['gpu'])}_{result['date']}_break-memory.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".md").write_text(f"# Memory with graph breaks, by pool and holder ({result['gpu']})\n\n"
                                       f"{result['config']}\n\n{text}\n")  # fmt: skip
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
