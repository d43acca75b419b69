"""benchmarks/break_memory_snapshot.py's analysis on a made-up allocator trace (the script itself needs
CUDA): calls found by their markers, a call's peak and what is live there, each allocation's pool and
category, the pickle kept small. Well under a second."""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util
import pickle
import sys
from pathlib import Path

import pytest
import torch

import graphstep
from break_models import MoENet
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


# ---------------------------------------------------------------- what a break holds (recording backend)


def zero_first_step(model, opt):
    """Gradients set to None at the start of the step: after a call each `.grad` is the one it made."""

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


SEGMENT_CONFIG = graphstep.Config(backend="recording", warmup_steps=2, optimizer_mode="graph")


def train_beside_eager(model, segments, calls, momentum=0.0, after_call=lambda twin: None):
    """`model`'s `segments(model)` modules made eager segments, its step captured (recording backend) and
    trained `calls` times beside an eager twin: every loss and, at the end, every parameter bitwise.
    `after_call(twin)` runs after each pair of calls. Returns the captured step and the twin."""
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum) for m in (model, twin))
    for module in segments(model):
        graphstep.eager_segment(module)
    step = graphstep.capture(zero_first_step(model, opt), model=model, optimizer=opt, config=SEGMENT_CONFIG)
    eager = zero_first_step(twin, twin_opt)
    g = torch.Generator().manual_seed(0)
    for i in range(calls):
        x, y = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 1, generator=g)
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(step(x, y), want), f"call {i}"
        after_call(twin)
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    return step, twin


def experts_of(model):
    return [block.experts for block in model.blocks]


def test_a_segments_parameter_gradient_is_the_segments_own_buffer_not_a_copy():
    """Eager's autograd makes the fresh gradient a `.grad` that was None; at a break, the gradient the
    segment's backward writes is that `.grad` (one buffer), where it was copied into a second one in
    the graph's pool. Bitwise as before."""
    torch.manual_seed(0)
    model = MoENet()
    step, twin = train_beside_eager(model, experts_of, 6, momentum=0.9)
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    (life,) = step._lives.values()
    backwards = [s for s in life.current.recording.segments if type(s).__name__ == "BackwardSegment"]
    assert len(backwards) == 2
    for bwd in backwards:
        n_inputs = len(bwd.slots) - len(bwd.params)
        for p, slot in zip(bwd.params, bwd.slots[n_inputs:]):
            assert p.grad.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()
    step.close()


class SyncingHead(torch.nn.Module):
    """A head that reads the host (a second break, at the end of the forward, after the experts' segments)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if h.abs().max().item() < 1e6 else 0.5  # a host read: no graph can record it
        return self.out(h) * scale


def recorders() -> set[int]:
    """The recording backend's recorders alive now, by id: each holds every tensor its capture made."""
    from graphstep.backends import recording

    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is recording._Recorder}


def moe_step(calls: int, late_break: bool = False, **config):
    """An MoE step (a break at its experts; at its head too with `late_break`) called `calls` times."""
    torch.manual_seed(0)
    model = MoENet()
    if late_break:
        model.out = SyncingHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = dataclasses.replace(SEGMENT_CONFIG, **config)
    step = graphstep.capture(zero_first_step(model, opt), model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(0)
    for _ in range(calls):
        step(torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 1, generator=g))
    assert step.stats.graph_breaks == 1 + late_break and step.stats.captures == 1, step.stats
    return step


def test_no_capture_is_left_alive_by_a_step_with_graph_breaks():
    """Each segment's boundary node holds its plan, and through it the capture's session, buffers and
    the forward graph with its activations, in a cycle through autograd's C++ graph that no garbage
    collection frees. A capture stopped by a host sync after a segment left all of it, on a GPU in the
    pool it abandoned, for good (39 MiB on the MoE row); the capture that succeeded left it until the
    process ended, `close()` or not. The recording backend's recorder of a capture holds every tensor
    it made: none is left once the capture is over (the replays need none)."""
    before = recorders()
    step = moe_step(6, late_break=True)
    alive = len(recorders() - before)
    assert not alive, f"{alive} captures' recorders are alive"
    step.close()


def test_a_graph_breaks_failed_capture_is_let_go_before_the_warm_up_that_follows(monkeypatch):
    """The capture that finds a break fails; that call warms up once more while its error is handled,
    and the error's frames held everything the capture made (on a GPU: a break at the end of the forward
    held its activations through that warm-up, 14.9 GiB against eager's 8.8 on the batched_mm row)."""
    from graphstep import lifecycle

    before = recorders()
    alive = []
    warm_up_again = lifecycle._warm_up_again

    def counting(life, again, *args):
        alive.append(len(recorders() - before))
        return warm_up_again(life, again, *args)

    monkeypatch.setattr(lifecycle, "_warm_up_again", counting)
    step = moe_step(5)
    assert alive == [0], alive
    step.close()


class CachingExperts(torch.nn.Module):
    """Experts that keep their last result (a module's cache, as a logging hook would)."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.experts = experts
        self.last = None

    def forward(self, *args):
        self.last = self.experts(*args)
        return self.last


def results_on_their_buffers(model) -> list[bool]:
    """Per result of each of `model`'s segments: after a replay of a step that stops before the backward
    (its results still wait for it), whether the result shares its buffer's memory."""
    probe = graphstep.capture(lambda x: model(x).sum(), model=model, config=SEGMENT_CONFIG)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        probe(torch.randn(4, 8, 16, generator=g))
    (life,) = probe._lives.values()
    forwards = [s for s in life.current.recording.segments if type(s).__name__ == "ForwardSegment"]
    pairs = [(t, b) for f in forwards if f.live is not None for t, b in zip(f.live[1], f.outputs)]
    probe.close()
    return [t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for t, b in pairs]


def test_a_segments_results_take_their_buffers_memory_until_its_backward_unless_it_kept_them():
    """A replay copies a segment's results into the buffers the next graph reads; the results then wait
    for the segment's backward, which needs only their autograd nodes. Held as they were, each result
    took its memory twice until then (40 MiB of the grouped_mm row on the H100). Results nothing else
    holds take their buffer's memory instead; one the segment kept keeps its own, and its values stay its
    own when later replays overwrite the buffer. Bitwise both ways."""
    torch.manual_seed(0)
    model = MoENet()
    model.blocks[1].experts = CachingExperts(model.blocks[1].experts)
    kept, twin_kept = [], []

    def keep(twin):
        kept.append(model.blocks[1].experts.last)
        twin_kept.append(twin.blocks[1].experts.last)

    step, _ = train_beside_eager(model, experts_of, 5, after_call=keep)
    step.close()
    for i, (a, b) in enumerate(zip(kept, twin_kept)):
        assert torch.equal(a, b), f"the result the segment kept at call {i} changed since"
    assert results_on_their_buffers(model) == [True, False], "the kept result keeps its own memory"


class SavesItsResult(torch.nn.Module):
    """Returns `y` and `y * scale`: the product's node saves `y` itself (for `scale`'s gradient)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        y = self.lin(x)
        return y, y * self.scale


class TwoOutputs(torch.nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        self.seg = SavesItsResult(dim)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, x):
        y, z = self.seg(torch.tanh(self.inp(x)))
        return self.out(torch.tanh(y) + z)


def test_a_result_a_node_inside_the_segment_saved_keeps_its_own_memory():
    """`y * scale` saves `y`, and the segment's backward reads it after the next graph, which on a GPU
    may have reused the buffer's memory by then: `y` keeps its own memory, the product (saved by
    nothing) takes its buffer's. Bitwise against eager."""
    torch.manual_seed(0)
    model = TwoOutputs()
    step, _ = train_beside_eager(model, lambda m: [m.seg], 5)
    step.close()
    assert results_on_their_buffers(model) == [False, True]
