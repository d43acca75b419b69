"""The output ring (backends/output_ring.py): results handed out without a copy per call, never
changed while the caller holds them. On the CPU with the recording backend; tests/gpu covers CUDA."""

from __future__ import annotations

import pytest
import torch

import graphstep
from cpu_common import batches, make_twins, sgd_step
from graphstep.backends import output_ring
from graphstep.guards import fastcheck
from graphstep.signature import TensorMeta

pytestmark = pytest.mark.skipif(
    getattr(fastcheck.helper(), "OutputRing", None) is None, reason="the C++ helper is not built"
)

RECORDING = graphstep.Config(backend="recording", warmup_steps=1)


def ring_of(step):
    (life,) = step._lives.values()
    return life.current.recording.ring


class FakeGraph:
    """Writes `value` into the slot a replay writes, as the recorded `where`s would."""

    def __init__(self):
        self.slots = [[torch.zeros(()), torch.zeros(3)] for _ in range(2)]
        self.ring = fastcheck.helper().OutputRing(self.slots, torch.zeros((), dtype=torch.bool))
        self.next = 0

    def replay(self, value: float) -> list[torch.Tensor]:
        self.ring.before_replay()
        for t in self.slots[self.next]:
            t.fill_(value)
        self.next ^= 1
        return self.ring.hand_out()


def test_a_result_let_go_costs_no_copy_and_a_held_one_keeps_its_value():
    graph = FakeGraph()
    first = graph.replay(1.0)
    assert first[0].data_ptr() == graph.slots[0][0].data_ptr()  # no copy
    graph.replay(2.0)  # the second slot; the one handed out is dropped at once
    third = graph.replay(3.0)  # the first slot again: `first` is held, so it moves to a copy
    assert graph.ring.copies == 2
    assert first[0].item() == 1.0 and first[1].tolist() == [1.0] * 3
    assert third[0].item() == 3.0 and first[0].data_ptr() != graph.slots[0][0].data_ptr()
    graph.replay(4.0)  # the second slot, let go: nothing to copy
    assert graph.ring.copies == 2


def test_views_and_detached_aliases_of_a_result_count_as_held():
    graph = FakeGraph()
    out = graph.replay(1.0)
    view, alias = out[1][1:], out[0].detach()
    del out
    graph.replay(2.0)
    graph.replay(3.0)  # rewrites the slot `view` and `alias` are over
    assert view.tolist() == [1.0, 1.0] and alias.item() == 1.0
    assert graph.ring.copies == 2


def test_results_dropped_at_once_alternate_between_two_slots_with_eager_values():
    (m_e, o_e), (m_g, o_g) = make_twins()
    data = batches(8)
    torch.manual_seed(7)  # the model has dropout
    eager = [sgd_step(m_e, o_e)(x, y).item() for x, y in data]
    step = graphstep.capture(sgd_step(m_g, o_g), model=m_g, optimizer=o_g, config=RECORDING)
    torch.manual_seed(7)
    values, addresses = [], set()
    for x, y in data:
        loss = step(x, y)
        values.append(loss.item())
        if step.stats.captures:
            addresses.add(loss.data_ptr())
    assert values == eager
    assert len(addresses) == 2 and ring_of(step).copies == 0


def test_held_results_survive_replays_and_the_release_of_the_graph():
    step = graphstep.capture(lambda x: {"sum": x.sum(), "twice": x * 2}, config=RECORDING)
    kept = [step(torch.full((3,), float(i))) for i in range(6)]
    assert ring_of(step).copies > 0
    step.reset()
    step(torch.zeros(3))  # warms up again; the ring's memory stays with the results that hold it
    assert [r["sum"].item() for r in kept] == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    assert [r["twice"][0].item() for r in kept] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_the_ring_is_written_after_an_eager_segment(twins):
    (m_e, o_e), (m_g, o_g) = twins
    data = batches(6)
    torch.manual_seed(7)  # the model has dropout
    eager = [sgd_step(m_e, o_e)(x, y) for x, y in data]
    config = graphstep.Config(backend="recording", optimizer_mode="eager")
    step = graphstep.capture(sgd_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    torch.manual_seed(7)
    graphed = [step(x, y) for x, y in data]
    assert ring_of(step) is not None and step.stats.replays > 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))


def test_large_non_contiguous_or_graph_outputs_get_no_ring(monkeypatch):
    monkeypatch.setattr(output_ring, "MAX_BYTES", 8)
    step = graphstep.capture(lambda x: x * 3, config=RECORDING)
    kept = [step(torch.full((4,), float(i))) for i in range(4)]  # 16 bytes: copied per call
    assert ring_of(step) is None and [t[0].item() for t in kept] == [0.0, 3.0, 6.0, 9.0]
    monkeypatch.undo()
    step = graphstep.capture(lambda x: (x * 3).t(), config=RECORDING)
    kept = [step(torch.full((2, 3), float(i))) for i in range(4)]
    assert ring_of(step) is None and [t[0, 0].item() for t in kept] == [0.0, 3.0, 6.0, 9.0]
    step = graphstep.capture(lambda x: x * 3, config=graphstep.Config(backend="recording", outputs="graph"))
    for _ in range(5):
        step(torch.ones(2))
    assert ring_of(step) is None


def test_outputs_unlike_the_warm_ups_record_nothing():
    meta = TensorMeta.of(torch.zeros(3))
    prepared = output_ring.prepare([meta], "cpu")
    assert prepared is not None
    assert output_ring.record(prepared, [torch.zeros(4)], written=False) is None  # another shape
    assert output_ring.record(prepared, [torch.zeros(3, dtype=torch.float64)], written=False) is None
    assert not prepared.flag.item(), "nothing was recorded, so nothing flipped the flag"
    assert output_ring.prepare([TensorMeta.of(torch.zeros(3, dtype=torch.complex64))], "cpu") is None
    assert output_ring.prepare([TensorMeta.of(torch.zeros(3, requires_grad=True))], "cpu") is None
    assert output_ring.prepare([meta], "meta") is None  # not the graph's device
