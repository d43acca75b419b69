"""What a capture spends on watching the step's Python, kept small without watching less: the step
function found without a pass over the heap, graphstep's own optimizer walk left untraced, the
hooks a capture installs (benchmarks/capture_breakdown.py measures them)."""

from __future__ import annotations

import sys

import torch

import graphstep
from cpu_common import batches, each_tracer, make_training, sgd_step  # noqa: F401  (each tracer)
from graphstep.effects.writes import WriteWatch
from graphstep.guards import reads, tracing

RECORDING = graphstep.Config(backend="recording")


def test_the_capture_finds_the_step_closure_without_a_pass_over_the_heap(monkeypatch):
    model, opt = make_training()
    scale = [2.0]

    def make(model, opt):
        inner = sgd_step(model, opt)

        def step(x, y):  # a closure: its cells are guarded
            return inner(x * scale[0], y)

        return step

    heap_passes = []
    original = reads.gc.get_referrers
    monkeypatch.setattr(reads.gc, "get_referrers", lambda *objs: heap_passes.append(objs) or original(*objs))
    captured = graphstep.capture(make(model, opt), model=model, optimizer=opt, config=RECORDING)
    data = batches(8)
    for x, y in data[:5]:
        captured(x, y)
    assert captured.stats.captures == 1 and heap_passes == []
    # The closure's contents are still read and guarded: a new value, a new graph.
    scale[0] = 3.0
    captured(*data[5])
    assert captured.stats.captures == 2 and captured.stats.variants == 1, captured.stats
    captured.close()


def test_graphsteps_optimizer_walk_is_not_traced_at_capture(monkeypatch):
    model, opt = make_training()
    traced = set()
    original = WriteWatch.opcode

    def opcode(self, frame, offset):
        traced.add((frame.f_code.co_filename, frame.f_code.co_name))
        return original(self, frame, offset)

    monkeypatch.setattr(WriteWatch, "opcode", opcode)
    captured = graphstep.capture(sgd_step(model, opt), model=model, optimizer=opt, config=RECORDING)
    for x, y in batches(5):
        captured(x, y)
    assert captured.stats.captures == 1
    walked = {name for file, name in traced if file.endswith("python_state.py")}
    assert not walked & {"grad_references", "changes"}, walked
    assert any(file.endswith("sgd.py") for file, _ in traced)  # torch's optimizer is still judged
    captured.close()


def test_a_capture_leaves_no_hook_behind():
    model, opt = make_training()
    captured = graphstep.capture(sgd_step(model, opt), model=model, optimizer=opt, config=RECORDING)
    for x, y in batches(5):
        captured(x, y)
    assert captured.stats.captures == 1
    assert sys.gettrace() is None and sys.getprofile() is None
    if hasattr(sys, "monitoring"):
        assert all(sys.monitoring.get_tool(tool) is None for tool in tracing._TOOL_IDS)
    captured.close()
    assert torch.is_grad_enabled()
