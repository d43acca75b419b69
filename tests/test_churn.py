"""Variant churn on the CPU recording backend: a value the step reads that changes on every call (a
teacher's EMA momentum read through a global step counter) runs those calls eagerly instead of
capturing a graph per call, every call bitwise equal to an eager twin, and captures again once the
value holds still; values that cycle keep their graphs."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import graphstep
from cpu_common import TinyNet, batches, same_params
from graphstep.guards.churn import VariantChurn

MOMENTUM = [0.9 + 0.0025 * i for i in range(40)]  # a teacher's EMA momentum schedule, one per step
it = 0  # the training loop's step counter, which the step reads
CHURNING = {"scale": 1.0, "step": 0}
SAID = "a value the step reads changed"


def teacher_step(student, teacher, opt):
    """A DINO/BYOL-style step: the student learns to match the teacher, and the teacher follows the
    student by an EMA whose momentum is read as a Python float through the global counter `it`."""

    def step(x, y):  # x: (B, 8), y: (B, 1)
        loss = F.mse_loss(student(x), y) + F.mse_loss(student(x), teacher(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        m = MOMENTUM[it]
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.mul_(m).add_(ps, alpha=1 - m)
        return loss

    return step


def run_teacher(counter, calls, **config):
    """Call a captured teacher step and its eager twin `calls` times with `it = counter(i)` before
    call i, comparing with torch.equal after each call. Returns the captured step and its stats
    before each call."""
    global it
    torch.manual_seed(0)
    student = TinyNet().eval()  # no dropout: nothing drawn at random
    twins = [(student, copy.deepcopy(student).requires_grad_(False))]
    twins.append(copy.deepcopy(twins[0]))
    opts = [torch.optim.SGD(s.parameters(), lr=0.05, momentum=0.9) for s, _ in twins]
    eager = teacher_step(*twins[0], opts[0])
    options = {"backend": "recording", "warmup_steps": 2, **config}
    step = graphstep.capture(
        teacher_step(*twins[1], opts[1]),
        model=list(twins[1]),
        optimizer=opts[1],
        config=graphstep.Config(**options),
    )
    history = []
    for i, (x, y) in enumerate(batches(calls)):
        it = counter(i)
        history.append(step.stats)
        want, got = eager(x, y), step(x, y)
        assert torch.equal(want, got), f"call {i}: {got} != eager {want}"
    (s0, t0), (s1, t1) = twins
    assert same_params(s0, s1) and same_params(t0, t1)
    return step, history


def test_a_momentum_that_changes_every_call_from_the_start_runs_eagerly_then_is_captured_once_it_holds(
    caplog,
):
    """The counter advances from the first call: the capturing call sees it changed since the last
    warm-up and runs eagerly, and so does every call until it holds still; then one capture, and
    replays."""
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step, history = run_teacher(lambda i: min(i, 15), 30)
    s = step.stats
    assert s.captures == 1 and s.variants == 0, s
    assert s.churn_calls >= 11 and s.eager_calls == s.churn_calls, s
    assert s.replays >= 11 and s.replays - history[20].replays == 10, s  # every call after the capture
    said = [r.message for r in caplog.records if SAID in r.message]
    assert len(said) == 1 and "global 'it' in test_churn.py" in said[0], said
    assert "0-d tensor" in said[0] and "fill_" in said[0], said[0]
    step.close()


def test_a_momentum_that_starts_changing_after_the_capture_stops_capturing_and_captures_again():
    """Held still for the warm-ups, the capture and some replays; then changing on 12 calls in a row;
    then still again. The captures are bounded: CALLS variants, then eager calls, then one capture
    when the value holds still, and replays after it."""

    def counter(i):
        return 0 if i < 8 else min(i - 7, 12)  # changes on calls 8 to 19

    step, history = run_teacher(counter, 32)
    s = step.stats
    assert s.captures <= 1 + VariantChurn.CALLS + 1, s
    assert s.churn_calls >= 12 - VariantChurn.CALLS - 1, s
    assert history[8].replays == 5, history[8]  # calls 3-7 replayed the first graph
    # CALLS variants on calls 8 and 9, then no capture until the value held still
    assert history[20].captures - history[8].captures == VariantChurn.CALLS, history[20]
    assert s.captures - history[21].captures == 0 and s.replays - history[21].replays == 11, s
    step.close()


def test_a_value_that_changes_every_call_runs_eagerly_and_is_named_once(caplog):
    """The loop keeps a counter in a dict the step reads: every call would capture a graph that is
    never replayed. Results stay right; one warning names the entry, and no graph is captured."""
    captured = captured_scaled(lambda loss: loss * CHURNING["scale"])
    data = batches(12)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(data):
            CHURNING["step"] = i
            captured(x, y)
    said = [r.message for r in caplog.records if SAID in r.message]
    assert len(said) == 1, said
    assert "global 'CHURNING'" in said[0] and "['step']" in said[0] and "['scale']" not in said[0], said[0]
    s = captured.stats
    assert s.captures == 0 and s.churn_calls == len(data) - 3 and s.warmup_calls == 3, s
    captured.close()


def test_a_momentum_cycling_through_more_values_than_a_run_keeps_its_graphs():
    """Five values in turn: more than CALLS + 1 in a row without a replay, so a wait begins; but a
    wait replays the variants it has and captures values that come back, so every call replays in
    the end."""
    step, history = run_teacher(lambda i: i % 5, 40)
    s = step.stats
    assert s.captures == 5 and s.replays - history[25].replays == 15, s
    assert s.churn_calls < 10, s
    step.close()


def test_flipping_between_two_values_reuses_variants_and_is_not_named(caplog):
    flags = {"scale": 1.0}
    captured = captured_scaled(lambda loss: loss * flags["scale"])
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(batches(16)):
            flags["scale"] = 1.0 if i % 2 else 0.5
            captured(x, y)
    assert not [r for r in caplog.records if SAID in r.message]
    assert captured.stats.variant_switches > 0
    captured.close()


def test_past_max_graphs_a_cycle_that_does_not_fit_keeps_two_graphs_and_steps_eagerly_otherwise():
    """With room for two graphs, five values in turn would drop a graph and capture one on every
    call. Once the signature waited, a variant that would drop another is captured only for a value
    seen to hold still: the two graphs it has replay, the other values run eagerly."""
    step, history = run_teacher(lambda i: i % 5, 30, max_graphs=2)
    s = step.stats
    assert s.graphs_alive == 2 and s.captures == 2, s
    assert s.replays - history[15].replays == 6 and s.churn_calls - history[15].churn_calls == 9, s


def test_a_capturing_call_s_own_replay_is_no_reuse():
    """On CUDA the call that captures replays once to take its step: that replay must not end a run
    of variants captured call after call; a replay of a graph in between does."""
    churn = VariantChurn("step")
    guard = SimpleNamespace(reads=None, modules=None)  # the probe is not asked here
    change = ("global 'CFG' in train.py, at ['step']: 1 -> 2",)
    replays = 0
    for _ in range(VariantChurn.CALLS):
        assert not churn.waits_for_variant(replays, change, guard)
        churn.captured(replays, replays + 1, change)  # each capture's own replay
        replays += 1
    assert churn.waits_for_variant(replays, change, guard) and churn.waiting
    churn = VariantChurn("step")
    for _ in range(VariantChurn.CALLS):
        assert not churn.waits_for_variant(replays, change, guard)
        churn.captured(replays, replays + 1, change)
        replays += 2  # a replay of some graph between the captures
    assert not churn.waits_for_variant(replays, change, guard)


def captured_scaled(scaled):
    """A recording-backend step whose loss goes through `scaled` (which reads the value under test)."""
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = scaled(torch.nn.functional.mse_loss(model(x), y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return graphstep.capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="recording"))
