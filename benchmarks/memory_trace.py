"""The analysis of benchmarks/break_memory_snapshot.py, plain Python on the dict that
`torch.cuda.memory._snapshot()` returns (so tests/test_break_memory.py runs it on the CPU): the calls
found in the allocator's trace by their markers, a call's peak and what is live there, each allocation's
pool (the step's current pool, other private pools, the default pool) and category (what holds it at
the end, else its stack), the markdown table, and the pickle kept small.

Loading a results pickle on any machine:

    import pickle, sys; sys.path.insert(0, "benchmarks"); import memory_trace
    snapshot = pickle.load(open("benchmarks/results/snapshots/eager_graphstep.pickle", "rb"))
    meta = json.load(open("benchmarks/results/snapshots/eager_graphstep_meta.json"))
    memory_trace.breakdown(snapshot, meta)
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from pathlib import Path

GIB = 2**30
MARK_BYTES = 512 * 1409  # a size no step allocates: finds the marker if frames were trimmed
PICKLE_LIMIT = 20 * 2**20
DEFAULT_POOL = (0, 0)
# What a stack tells about an allocation, first match from the innermost frame outward (path pieces).
FRAME_CATEGORIES = (
    ("graphstep/backends/buffers.py", "static inputs"),
    ("graphstep/backends/output_ring.py", "output ring"),
    ("graphstep/backends/loose.py", "loose arguments"),
    ("graphstep/backends/autograd_segments.py", "segment boundary (autograd)"),
    ("graphstep/backends/grad_order.py", "segment grads summed (grad_order)"),
    ("graphstep/backends/segments.py", "segment boundary"),
    ("graphstep/backends/cuda.py", "graphstep cuda backend"),
    ("graphstep/optim/", "optimizer (graphstep live tensors)"),
    ("graphstep/", "graphstep (other)"),
    ("torch/optim/", "optimizer step"),
    ("torch/nn/utils/clip_grad.py", "grad clipping"),
    ("torch/autograd/", "backward"),
    ("transformers/", "forward (model)"),
    ("torch/nn/", "forward (torch.nn)"),
    ("graphstep/bench/", "bench step"),
)


def frame_category(frames: list[dict]) -> str:
    """The category of an allocation from its stack (innermost frame first, as torch records it)."""
    for f in frames:
        name = f.get("filename", "").replace("\\", "/")
        for piece, category in FRAME_CATEGORIES:
            if piece in name:
                return category
    return "other" if frames else "no stack"


def stack_top(frames: list[dict], depth: int = 2) -> str:
    """The innermost frames outside torch and this script: where the allocation was asked for."""
    keep = [
        f
        for f in frames
        if "/torch/" not in f.get("filename", "").replace("\\", "/") and f.get("name") != "_mark"
    ]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in keep[:depth]) or "?"


def call_windows(trace: list[dict], labels: list[str]) -> list[dict]:
    """The trace's index range of each call: the marker allocations (`_mark`) before each call and
    after the last. Calls whose start marker fell out of the ring buffer are left out."""
    marks = [
        i
        for i, e in enumerate(trace)
        if e["action"] == "alloc"
        and e["size"] == MARK_BYTES
        and (not e.get("frames") or any(f.get("name") == "_mark" for f in e["frames"][:3]))
    ]
    first = len(labels) + 1 - len(marks)  # marks lost at the start of the ring buffer
    out = []
    for k in range(len(marks) - 1):
        call = first + k
        if call >= 0:  # the call begins once the marker is freed
            start = next((i for i in range(marks[k], marks[k + 1]) if trace[i]["action"] == "free_completed"
                          and trace[i].get("addr") == trace[marks[k]]["addr"]), marks[k])  # fmt: skip
            out.append({"call": call + 1, "label": labels[call], "start": start + 1, "end": marks[k + 1]})
    return out


class Segments:
    """Each segment's pool at each point of the trace: a segment's lifetime from the trace's
    `segment_alloc`/`segment_free`, its pool from the segments listed after each call."""

    def __init__(self, trace: list[dict], listings: list[tuple[int, list[dict]]], initial: list[dict]):
        # listings: (trace index of the call's end marker, [{address, total_size, pool}, ...])
        self.spans: list[dict] = []  # {addr, size, start, end, pool}
        open_: dict[int, dict] = {}
        for s in initial:  # segments made before the trace began
            open_[s["address"]] = span = dict(addr=s["address"], size=s["total_size"], start=-1, end=None,
                                              pool=tuple(s["pool"]))  # fmt: skip
            self.spans.append(span)
        at = iter(sorted(listings, key=lambda x: x[0]))
        upcoming = next(at, None)
        for i, e in enumerate(trace):
            while upcoming is not None and upcoming[0] <= i:
                self._name_pools(open_, upcoming[1])
                upcoming = next(at, None)
            if e["action"] in ("segment_alloc", "segment_map"):
                pool = tuple(e["pool_id"]) if e.get("pool_id") is not None else None  # torch >= 2.12
                open_[e["addr"]] = span = dict(addr=e["addr"], size=e["size"], start=i, end=None, pool=pool)
                self.spans.append(span)
            elif e["action"] in ("segment_free", "segment_unmap") and e["addr"] in open_:
                open_.pop(e["addr"])["end"] = i
        while upcoming is not None:
            self._name_pools(open_, upcoming[1])
            upcoming = next(at, None)

    @staticmethod
    def _name_pools(open_: dict[int, dict], listing: list[dict]) -> None:
        by_addr = {s["address"]: tuple(s["pool"]) for s in listing}
        for addr, span in open_.items():
            if span["pool"] is None and addr in by_addr:
                span["pool"] = by_addr[addr]

    def live_at(self, i: int) -> list[dict]:
        return [s for s in self.spans if s["start"] <= i and (s["end"] is None or s["end"] > i)]

    def pool_of(self, addr: int, i: int) -> tuple | None:
        for s in self.live_at(i):
            if s["addr"] <= addr < s["addr"] + s["size"]:
                return s["pool"]
        return None


def replay(trace: list[dict], start: int, end: int) -> dict:
    """Replay the trace up to `end`; within [start, end) find the peak of bytes allocated and the
    allocations live there: {addr: (size, trace index of its alloc)}."""
    live: dict[int, tuple] = {}
    total, peak, peak_at = 0, -1, start
    for i in range(end):
        e = trace[i]
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        if i >= start and total > peak:
            peak, peak_at = total, i
    # A second pass is cheaper than copying the live set at every new peak.
    return {
        "peak": max(peak, 0),
        "peak_at": peak_at,
        "at_peak": _live_at(trace, peak_at) if peak >= 0 else {},
    }


def _live_at(trace: list[dict], index: int) -> dict[int, tuple]:
    live: dict[int, tuple] = {}
    for i in range(index + 1):
        e = trace[i]
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return live


def pool_kind(pool: tuple | None, current: tuple | None) -> str:
    if pool is None:
        return "pool unknown (segment made and freed within a call)"
    if tuple(pool) == DEFAULT_POOL:
        return "default pool"
    return "current pool" if current is not None and tuple(pool) == tuple(current) else "other pool"


def breakdown(snapshot: dict, meta: dict) -> dict:
    """At the peak of the last call and between calls (after it): the live bytes by pool kind and
    category, the top stacks of each, and the bytes reserved per pool kind; the peak of every call."""
    trace = snapshot["device_traces"][meta["device"]]
    windows = call_windows(trace, meta["labels"])
    listings = [(trace_index(windows, c), lst) for c, lst in meta["listings"]]
    segments = Segments(trace, listings, meta["initial"])
    per_call = []
    for w in windows:
        r = replay(trace, w["start"], w["end"])
        per_call.append({"call": w["call"], "label": w["label"], "peak_bytes": r["peak"],
                         "peak_gib": round(r["peak"] / GIB, 4)})  # fmt: skip
    if not windows:
        return {"calls": per_call, "error": "no call found in the trace (ring buffer too small?)"}
    last = windows[-1]
    r = replay(trace, last["start"], last["end"])
    at = {"trace": trace, "segments": segments, "end_live": _live_at(trace, len(trace) - 1),
          "labels": {int(k): v for k, v in meta["tensor_labels"].items()},
          "current": tuple(meta["current_pool"]) if meta.get("current_pool") else None}  # fmt: skip
    between = _live_at(trace, last["end"] - 1)
    return {
        "calls": per_call,
        "steady_call": last["call"],
        "peak_allocated_gib": round(r["peak"] / GIB, 4),
        **classify(r["at_peak"], r["peak_at"], at, "at_peak"),
        "between_calls_gib": round(sum(size for size, _ in between.values()) / GIB, 4),
        **classify(between, last["end"] - 1, at, "between_calls"),
    }


def classify(live: dict[int, tuple], index: int, at: dict, name: str) -> dict:
    """`live` ({addr: (size, trace index of its alloc)} at trace index `index`) by pool kind and
    category, with the largest stacks of each; and the bytes reserved per pool kind there."""
    trace, labels, end_live = at["trace"], at["labels"], at["end_live"]
    rows: dict[tuple[str, str], int] = defaultdict(int)
    stacks: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for addr, (size, i) in live.items():
        pool = trace[i].get("pool_id")  # torch >= 2.12 writes it; else from the segment
        pool = tuple(pool) if pool is not None else at["segments"].pool_of(addr, index)
        kind = pool_kind(pool, at["current"])
        still = end_live.get(addr, (None, None))[1] == i  # the same tensor is live at the end
        frames = trace[i].get("frames", [])
        category = labels[addr] if still and addr in labels else frame_category(frames)
        rows[kind, category] += size
        stacks[kind, category][stack_top(frames)] += size
    reserved: dict[str, int] = defaultdict(int)
    for s in at["segments"].live_at(index):
        reserved[pool_kind(s["pool"], at["current"])] += s["size"]
    g = lambda b: round(b / GIB, 4)  # noqa: E731
    top = lambda k, c: [[s, g(n)] for s, n in sorted(stacks[k, c].items(), key=lambda x: -x[1])[:4]]  # noqa: E731
    return {
        f"reserved_{name}_bytes": dict(sorted(reserved.items())),
        f"reserved_{name}_gib": {k: g(v) for k, v in sorted(reserved.items())},
        f"live_{name}": [
            {"pool": k, "category": c, "bytes": b, "gib": g(b), "top_stacks": top(k, c)}
            for (k, c), b in sorted(rows.items(), key=lambda x: -x[1])
        ],
    }


def trace_index(windows: list[dict], call: int) -> int:
    """The trace index where call `call` (from 1) ends, or past the trace when not found."""
    for w in windows:
        if w["call"] == call:
            return w["end"]
    return 1 << 62


def table(experts: str, rows: dict[str, dict]) -> str:
    """Markdown: live GiB at the steady-state peak and between calls by (pool, category), eager against
    graphstep, graphstep's largest stack in each; then reserved by pool kind and each call's peak."""
    eager, gs = rows.get("eager", {}), rows.get("graphstep", {})
    cells: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, ""])
    for col, (r, key) in enumerate(((eager, "live_at_peak"), (gs, "live_at_peak"),
                                    (eager, "live_between_calls"), (gs, "live_between_calls"))):  # fmt: skip
        for item in r.get(key, []):
            cell = cells[item["pool"], item["category"]]
            cell[col] += item["gib"]
            if col % 2 and item["top_stacks"] and not cell[4]:
                cell[4] = item["top_stacks"][0][0]
    out = [f"### experts={experts}: live GiB at the steady-state peak, and between calls", "",
           "| pool | category | peak: eager | graphstep | Δ | between: eager | graphstep | graphstep's largest stack |",
           "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for (pool, cat), (e, g, eb, gb, s) in sorted(cells.items(), key=lambda x: x[1][0] - x[1][1]):
        out.append(f"| {pool} | {cat} | {e:.4f} | {g:.4f} | {g - e:+.4f} | {eb:.4f} | {gb:.4f} | `{s}` |")
    t = [r.get(k, float("nan")) for k in ("peak_allocated_gib", "between_calls_gib") for r in (eager, gs)]
    out.append(
        f"| **all** | allocated | {t[0]:.4f} | {t[1]:.4f} | {t[1] - t[0]:+.4f} | {t[2]:.4f} | {t[3]:.4f} | |"
    )
    for name, r in (("eager", eager), ("graphstep", gs)):
        res = ", ".join(f"{k} {v:.4f}" for k, v in r.get("reserved_at_peak_gib", {}).items())
        calls = ", ".join(f"{c['call']} {c['label']} {c['peak_gib']:.3f}" for c in r.get("calls", []))
        out += [
            "",
            f"{name}: reserved at the peak (GiB): {res or '—'}; peak allocated per call: {calls or '—'}",
        ]
        if "error" in r:
            out.append(f"{name}: ERROR {r['error'][-300:]}")
    return "\n".join(out)


def share_frames(snapshot: dict) -> None:
    """Make equal frames (and equal stacks) one object each: pickle then writes each once (torch
    makes a new dict per frame per entry, several KB an entry)."""
    frames: dict[tuple, dict] = {}
    stacks: dict[tuple, list] = {}

    def shared(stack: list[dict]) -> list[dict]:
        key = tuple((f.get("filename"), f.get("line"), f.get("name")) for f in stack)
        if key not in stacks:
            stacks[key] = [frames.setdefault(k, f) for k, f in zip(key, stack)]
        return stacks[key]

    for seg in snapshot["segments"]:
        for b in seg.get("blocks", []):
            b["frames"] = shared(b.get("frames", []))
    for t in snapshot["device_traces"]:
        for e in t:
            e["frames"] = shared(e.get("frames", []))


def shrink(snapshot: dict, limit: int = PICKLE_LIMIT) -> tuple[bytes, str]:
    """The snapshot pickled under `limit` bytes: equal frames shared, then frames cut to the
    innermost 32, then 16, then the trace's oldest entries dropped (the steady-state calls are at
    its end)."""
    share_frames(snapshot)
    data = pickle.dumps(snapshot)
    if len(data) <= limit:
        return data, "whole"
    for depth in (32, 16):
        for seg in snapshot["segments"]:
            for b in seg.get("blocks", []):
                b["frames"] = b.get("frames", [])[:depth]
        for t in snapshot["device_traces"]:
            for e in t:
                e["frames"] = e.get("frames", [])[:depth]
        share_frames(snapshot)
        data = pickle.dumps(snapshot)
        if len(data) <= limit:
            return data, f"frames cut to {depth}"
    traces = snapshot["device_traces"]
    while len(data) > limit:
        traces[:] = [t[len(t) // 4 :] for t in traces]
        data = pickle.dumps(snapshot)
    return data, f"frames cut to 16, trace cut to its last {max(len(t) for t in traces)} entries"
