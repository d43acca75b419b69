"""`graphstep.profiling.ranged`: named ranges in torch.profiler traces (and NVTX, faked here), and the
lifecycle's ranges around warm-up, capture and replay."""

from __future__ import annotations

import pytest
import torch

import graphstep
from cpu_common import batches, make_training, sgd_step
from graphstep import profiling


def _range_names(prof: torch.profiler.profile) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("graphstep.")]


def test_ranged_shows_in_a_torch_profiler_trace():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiling.ranged("graphstep.replay"):
            torch.ones(3).sum()
        with profiling.ranged("graphstep.capture"), profiling.ranged("graphstep.eager_segment"):
            pass
    assert _range_names(prof) == ["graphstep.replay", "graphstep.capture", "graphstep.eager_segment"]


def test_ranged_enters_record_function_only_under_a_profiler(monkeypatch):
    entered = []
    real = torch.profiler.record_function

    def spy(name):
        entered.append(name)
        return real(name)

    monkeypatch.setattr(torch.profiler, "record_function", spy)
    with profiling.ranged("graphstep.warmup"):
        pass
    assert entered == []  # no profiler: no 6 µs record_function
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
        profiling.ranged("graphstep.warmup"),
    ):
        pass
    assert entered == ["graphstep.warmup"]


class _FakeNvtx:
    def __init__(self):
        self.calls = []

    def range_push(self, name):
        self.calls.append(("push", name))

    def range_pop(self):
        self.calls.append(("pop",))


def test_nvtx_ranges_are_pushed_and_popped_with_cuda_even_on_error(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(profiling, "_nvtx_available", True)
    monkeypatch.setattr(profiling, "_nvtx_on_replays", True)
    monkeypatch.setattr(torch.cuda, "nvtx", fake)
    with (
        pytest.raises(ValueError),
        profiling.ranged("graphstep.replay"),
        profiling.ranged("graphstep.eager_segment"),
    ):
        raise ValueError("inside")
    assert fake.calls == [
        ("push", "graphstep.replay"),
        ("push", "graphstep.eager_segment"),
        ("pop",),
        ("pop",),
    ]


def test_no_nvtx_without_cuda(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(profiling, "_nvtx_available", False)
    monkeypatch.setattr(torch.cuda, "nvtx", fake)
    with profiling.ranged("graphstep.replay"):
        pass
    assert fake.calls == []


def test_a_profiled_step_shows_warmup_capture_and_replay_ranges():
    model, opt = make_training()
    step = graphstep.capture(
        sgd_step(model, opt), model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    data = batches(6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x, y in data:
            step(x, y)
    names = _range_names(prof)
    # warmup_steps=3: three warm-ups, one capture (which also replays its step), then replays.
    assert names.count(profiling.WARMUP) == 3, names
    assert names.count(profiling.CAPTURE) == 1, names
    assert names.count(profiling.REPLAY) >= 2, names
    assert profiling.EAGER_SEGMENT not in names  # no segments in this step


@pytest.mark.parametrize(
    ("environment", "replays_ranged"),
    [
        ({}, False),  # no tool attached: a push and pop per replay would cost several µs for nobody
        ({"NVTX_INJECTION64_PATH": "/opt/nsight/libToolsInjection64.so"}, True),  # a tool attached
        ({"GRAPHSTEP_NVTX": "1"}, True),
        ({"GRAPHSTEP_NVTX": "0", "NVTX_INJECTION64_PATH": "/opt/nsight/libToolsInjection64.so"}, False),
    ],
)
def test_replays_push_nvtx_ranges_only_for_a_tool(monkeypatch, environment, replays_ranged):
    fake = _FakeNvtx()
    for key in ("GRAPHSTEP_NVTX", "NVTX_INJECTION64_PATH"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(profiling, "_nvtx_available", None)
    monkeypatch.setattr(profiling, "_nvtx_on_replays", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "nvtx", fake)
    with profiling.ranged(profiling.REPLAY):
        pass
    with profiling.ranged(profiling.CAPTURE):
        pass
    pushed = [call[1] for call in fake.calls if call[0] == "push"]
    rare = [] if environment.get("GRAPHSTEP_NVTX") == "0" else [profiling.CAPTURE]
    assert pushed == ([profiling.REPLAY] if replays_ranged else []) + rare
    assert profiling.listening_to_replays() is replays_ranged
