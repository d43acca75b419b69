"""benchmarks/break_memory_snapshot.py's analysis on a made-up allocator trace (the script itself needs
CUDA): calls found by their markers, a call's peak and what is live there, each allocation's pool and
category, the pickle kept small. Well under a second."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import pytest

import graphstep
from cpu_common import batches, make_twins, plain_step

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if not (BENCHMARKS / "memory_trace.py").exists():
    pytest.skip("graphstep is installed without its repository", allow_module_level=True)


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the script imports memory_trace by name, as run from benchmarks/
    spec.loader.exec_module(module)
    return module


bms = load("memory_trace")
script = load("break_memory_snapshot")

SITE = "/venv/lib/python3.12/site-packages"
MODEL = [
    {"filename": f"{SITE}/transformers/models/mixtral/modeling_mixtral.py", "line": 85, "name": "forward"}
]
RING = [{"filename": "/repo/src/graphstep/backends/output_ring.py", "line": 40, "name": "take"}]
TORCH = [{"filename": f"{SITE}/torch/nn/modules/linear.py", "line": 125, "name": "forward"}]
MARK = [{"filename": "/repo/benchmarks/break_memory_snapshot.py", "line": 300, "name": "_mark"}]
RECORDING = graphstep.Config(backend="recording")
POOL = (1, 7)
OLD_POOL = (1, 3)


class Trace:
    """Builds an allocator trace as torch.cuda.memory._snapshot() writes it."""

    def __init__(self):
        self.entries: list[dict] = []
        self.listings: list[tuple[int, list[dict]]] = []
        self.segments: dict[int, tuple] = {}  # addr -> (size, pool)
        self.calls = 0

    def segment(self, addr: int, size: int, pool: tuple) -> None:
        self.segments[addr] = (size, pool)
        self.entries.append(
            {"action": "segment_alloc", "addr": addr, "size": size, "stream": 0, "frames": []}
        )

    def alloc(self, addr: int, size: int, frames: list[dict]) -> None:
        self.entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames})

    def free(self, addr: int, size: int) -> None:
        for action in ("free_requested", "free_completed"):
            self.entries.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": []})

    def mark(self) -> None:
        """The end of a call (its segments listed) and the start of the next."""
        if self.calls:
            listing = [
                {"address": a, "total_size": s, "pool": list(p)} for a, (s, p) in self.segments.items()
            ]
            self.listings.append((self.calls, listing))
        self.calls += 1
        self.alloc(1 << 40, bms.MARK_BYTES, MARK + TORCH)
        self.free(1 << 40, bms.MARK_BYTES)


def made_up_run() -> tuple[dict, dict]:
    """Two calls: a warm-up (activations peak at 300 in the default pool) and a replay (the graph's
    outputs in its pool, 100 bytes an old pool keeps, a 50-byte ring slot, an activation of 20)."""
    t = Trace()
    t.segment(0x1000, 4096, (0, 0))
    t.alloc(0x1000, 64, TORCH)  # the parameter
    t.mark()
    t.alloc(0x1100, 300, MODEL)  # call 1: an activation, freed
    t.free(0x1100, 300)
    t.segment(0x9000, 4096, OLD_POOL)
    t.alloc(0x9000, 100, MODEL)  # kept by the abandoned pool past the call
    t.mark()
    t.segment(0x5000, 4096, POOL)
    t.alloc(0x5000, 50, RING)
    t.alloc(0x1200, 20, MODEL)  # call 2's peak: 64 + 100 + 50 + 20
    t.free(0x1200, 20)
    t.mark()
    snapshot = {"segments": [], "device_traces": [t.entries]}
    meta = {"device": 0, "labels": ["warm-up", "replay"], "listings": t.listings, "initial": [],
            "current_pool": list(POOL), "tensor_labels": {str(0x1000): "parameters"}}  # fmt: skip
    return snapshot, meta


def test_calls_are_found_by_their_markers_and_each_peak_is_its_own():
    snapshot, meta = made_up_run()
    out = bms.breakdown(snapshot, meta)
    assert [(c["call"], c["label"]) for c in out["calls"]] == [(1, "warm-up"), (2, "replay")]
    assert [c["peak_bytes"] for c in out["calls"]] == [364, 234]
    assert out["steady_call"] == 2


def test_the_steady_peak_is_split_by_pool_and_by_what_holds_each_allocation():
    snapshot, meta = made_up_run()
    out = bms.breakdown(snapshot, meta)
    live = {(r["pool"], r["category"]): r["bytes"] for r in out["live_at_peak"]}
    assert live == {
        ("default pool", "parameters"): 64,  # labelled by what holds it at the end
        ("default pool", "forward (model)"): 20,  # by its stack
        ("other pool", "forward (model)"): 100,
        ("current pool", "output ring"): 50,
    }
    tops = {(r["pool"], r["category"]): r["top_stacks"][0][0] for r in out["live_at_peak"]}
    assert tops["other pool", "forward (model)"] == "modeling_mixtral.py:85 forward"
    assert out["reserved_at_peak_bytes"] == {"current pool": 4096, "default pool": 4096, "other pool": 4096}
    between = {(r["pool"], r["category"]): r["bytes"] for r in out["live_between_calls"]}
    assert between == {
        ("default pool", "parameters"): 64,
        ("other pool", "forward (model)"): 100,
        ("current pool", "output ring"): 50,
    }
    text = bms.table("eager", {"eager": out, "graphstep": out})
    assert "| other pool | forward (model) |" in text and "| **all** | allocated |" in text


def test_a_captured_steps_tensors_are_labelled_by_what_holds_them():
    """The walk over graphstep's objects runs on a real captured step (the recording backend; CPU
    tensors stand in for CUDA's) and finds the step's buffers beside parameters and optimizer state."""
    (_, _), (model, opt) = make_twins()
    step = graphstep.capture(plain_step(model, opt), model=model, optimizer=opt, config=RECORDING)
    for x, y in batches(5):
        step(x, y)
    labels = script.tensor_labels(model, opt, step, device="cpu")
    kinds = set(labels.values())
    assert {"parameters", "optimizer state"} <= kinds
    assert any(k.startswith("graphstep: captured.") for k in kinds), kinds
    step.close()


def test_calls_lost_off_the_front_of_the_ring_buffer_are_left_out():
    snapshot, meta = made_up_run()
    trace = snapshot["device_traces"][0]
    second = [i for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] == bms.MARK_BYTES][1]
    windows = bms.call_windows(trace[second:], meta["labels"])
    assert [(w["call"], w["label"]) for w in windows] == [(2, "replay")]


def test_frames_are_shared_and_the_pickle_cut_under_its_limit():
    snapshot, _ = made_up_run()
    deep = [{"filename": f"/x/f{i}.py", "line": i, "name": "g"} for i in range(40)]
    for i in range(300):
        snapshot["device_traces"][0].append(
            {"action": "alloc", "addr": i, "size": 8, "frames": [dict(f) for f in deep]}
        )
    whole, how = bms.shrink(pickle.loads(pickle.dumps(snapshot)), limit=1 << 30)
    assert how == "whole"
    back = pickle.loads(whole)
    assert back["device_traces"][0][-1]["frames"] is back["device_traces"][0][-2]["frames"]
    assert back["device_traces"][0][-1]["frames"] == deep
    data, how = bms.shrink(pickle.loads(pickle.dumps(snapshot)), limit=2000)
    assert len(data) <= 2000 and "trace cut" in how


def test_arguments():
    args = script.parse([])
    assert args.experts is None and args.method is None and args.replays == 3
    assert script.parse(["--experts", "eager", "--experts", "batched_mm"]).experts == ["eager", "batched_mm"]
    with pytest.raises(SystemExit):
        script.parse(["--experts", "nope"])
    assert bms.frame_category(RING + MODEL) == "output ring"
    assert bms.frame_category([]) == "no stack"
