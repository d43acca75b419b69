"""Guards over the contents of what a step reads: lists, tuples, dicts, sets, deques,
SimpleNamespace, dataclasses and plain objects, nested, reached from globals, closure cells, module
and object attributes, default arguments and the step's own arguments, changed *in place* between
calls. Each test runs 30 steps on the recording backend (which bakes Python numbers in, as a CUDA
graph does) next to an eager twin, compares them with torch.equal after every step, and would fail
without the content guard (the replay would keep the number of the capture)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

import graphstep
import helpers_contents as hc
from cpu_common import TinyNet, batches, same_params
from graphstep.guards import contents, fastcheck

RECORDING = graphstep.Config(backend="recording", warmup_steps=2, max_recaptures=100)
STEPS = 30


@pytest.fixture(autouse=True)
def reset_containers():
    hc.reset()
    yield
    hc.reset()


def side_by_side(
    factor, changes, *, model_cls=TinyNet, arguments=(), batch_sizes=(4,), steps=STEPS, config=RECORDING
):
    """Train an eager twin and a captured one whose loss is scaled by `factor(*arguments)`; apply
    `changes[i](eager_model, twin)` before call i. Every call equal to eager."""
    torch.manual_seed(0)
    model = model_cls()
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, twin)]

    def make_step(m, opt):
        def step(x, y, *args):
            loss = torch.nn.functional.mse_loss(m(x), y) * factor(*args)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    eager = make_step(model, opts[0])
    step = graphstep.capture(make_step(twin, opts[1]), model=twin, optimizer=opts[1], config=config)
    for i in range(steps):
        x, y = batches(1, batch_size=batch_sizes[i % len(batch_sizes)], seed=i)[0]
        if i in changes:
            changes[i](model, twin)
        torch.manual_seed(i)
        want = eager(x, y, *arguments)
        torch.manual_seed(i)
        got = step(x, y, *arguments)
        assert torch.equal(want, got), f"call {i}: graphstep {got.item()!r} != eager {want.item()!r}"
    assert same_params(model, twin), "parameters differ from eager"
    return step


def at(fn):
    """A change made once to shared state (both twins read the same containers)."""
    return lambda model, twin: fn()


def setitem(container, key, value):
    return at(lambda: container.__setitem__(key, value))


CLOSURE_FACTOR, CLOSURE_TABLE = hc.make_closure_factor()

# name: (factor, {call: change}, the message of the first change)
KINDS = {
    "list item": (
        hc.list_factor,
        {10: setitem(hc.LOSS_WEIGHTS, 0, 0.25), 20: setitem(hc.LOSS_WEIGHTS, 0, 1.0)},
        "global 'LOSS_WEIGHTS' in helpers_contents.py, at [0]: 1.0 -> 0.25",
    ),
    "list appended": (
        hc.list_factor,
        {10: at(lambda: hc.LOSS_WEIGHTS.append(3.0)), 20: at(hc.LOSS_WEIGHTS.pop)},
        "global 'LOSS_WEIGHTS' in helpers_contents.py: 2 entries -> 3",
    ),
    "dict value": (
        hc.dict_factor,
        {10: setitem(hc.CFG, "smoothing", 0.2), 20: setitem(hc.CFG, "smoothing", 0.1)},
        "global 'CFG' in helpers_contents.py, at ['smoothing']: 0.1 -> 0.2",
    ),
    "nested dict and list": (
        hc.nested_dict_factor,
        {
            10: at(lambda: hc.CFG["loss"].__setitem__("weight", 0.5)),
            20: at(lambda: hc.CFG["loss"]["terms"].append("l1")),
        },
        "global 'CFG' in helpers_contents.py, at ['loss']['weight']: 1.0 -> 0.5",
    ),
    "SimpleNamespace": (
        hc.namespace_factor,
        {
            10: at(lambda: setattr(hc.NS.loss, "weight", 0.5)),
            20: at(lambda: setattr(hc.NS.loss, "weight", 1.0)),
        },
        "global 'NS' in helpers_contents.py, at .loss.weight: 1.0 -> 0.5",
    ),
    "set": (
        hc.set_factor,
        {10: at(lambda: hc.ENABLED.add("l1")), 20: at(lambda: hc.ENABLED.discard("l1"))},
        "global 'ENABLED' in helpers_contents.py",
    ),
    "deque": (
        hc.deque_factor,
        {10: at(lambda: hc.WINDOW.append(4.0)), 20: at(lambda: hc.WINDOW.append(0.5))},
        "global 'WINDOW' in helpers_contents.py: 2 entries -> 3",
    ),
    "list inside a tuple": (
        hc.tuple_factor,
        {10: setitem(hc.PAIR[1], 0, 0.75)},
        "global 'PAIR' in helpers_contents.py, at [1][0]: 0.5 -> 0.75",
    ),
    "plain object": (
        hc.object_factor,
        {10: at(lambda: setattr(hc.SETTINGS, "weight", 0.5))},
        "global 'SETTINGS' in helpers_contents.py, at .weight: 1.0 -> 0.5",
    ),
    "dataclass holding a list of a dataclass and a dict": (
        hc.dataclass_factor,
        {
            10: at(lambda: setattr(hc.SCHEDULE.stages[0], "weight", 0.5)),
            20: at(lambda: hc.SCHEDULE.stages[1]["w"].__setitem__(1, 1.5)),
        },
        "global 'SCHEDULE' in helpers_contents.py, at .stages[0].weight: 1.0 -> 0.5",
    ),
    "closure cell": (
        CLOSURE_FACTOR,
        {10: setitem(CLOSURE_TABLE, "w", 0.5), 20: setitem(CLOSURE_TABLE, "w", 1.0)},
        "closure variable 'table' of make_closure_factor.<locals>.factor, at ['w']: 1.0 -> 0.5",
    ),
    "default argument": (
        hc.default_factor,
        # 1.0 -> 1.5, or back where a run before this one changed it (both guard paths run here)
        {
            10: at(
                lambda: hc.default_factor.__defaults__[0].__setitem__(
                    1, 2.5 - hc.default_factor.__defaults__[0][1]
                )
            )
        },
        "default of 'weights' in default_factor (helpers_contents.py:",
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_container_changed_in_place_picks_a_graph_for_its_new_contents(kind, caplog):
    factor, changes, message = KINDS[kind]
    with caplog.at_level(logging.INFO, logger="graphstep"):
        step = side_by_side(factor, changes)
    assert message in caplog.text, caplog.text
    assert step.stats.captures == len(changes) + 1 - step.stats.variant_switches, step.stats
    assert step.stats.variants >= 1


class WeightedNet(TinyNet):
    """A module whose forward reads a list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_weights = [1.0]

    def forward(self, x):
        return super().forward(x) * self.loss_weights[0]


def test_a_list_held_by_a_module_attribute(caplog):
    def change(weight):
        def apply(model, twin):
            model.loss_weights[0] = twin.loss_weights[0] = weight

        return apply

    with caplog.at_level(logging.INFO, logger="graphstep"):
        step = side_by_side(lambda: 1.0, {10: change(0.5), 20: change(1.0)}, model_cls=WeightedNet)
    assert "model.loss_weights, at [0]: 1.0 -> 0.5" in caplog.text, caplog.text
    assert (step.stats.captures, step.stats.variant_switches) == (2, 1)


def test_an_argument_object_changed_in_place():
    """A user object passed to the step keys the graph by identity; its contents are guarded."""
    cfg = hc.ArgConfig()
    step = side_by_side(lambda c: c.scale, {10: at(lambda: setattr(cfg, "scale", 0.5))}, arguments=(cfg,))
    assert step.stats.captures == 2


def test_an_equal_copy_bound_in_place_of_a_container_captures_nothing(monkeypatch):
    step = side_by_side(
        hc.dict_factor, {10: at(lambda: monkeypatch.setattr(hc, "CFG", copy.deepcopy(hc.CFG)))}
    )
    assert step.stats.captures == 1


def test_an_attribute_the_step_never_reads_may_change_every_call():
    """Objects of user classes are guarded on the attributes user code loads: a counter the loop
    keeps on the same object is not a reason to capture."""

    def count(model, twin):
        hc.SETTINGS.calls_seen += 1

    step = side_by_side(hc.object_factor, dict.fromkeys(range(STEPS), count))
    assert step.stats.captures == 1


def test_what_the_step_writes_is_left_out_and_never_ping_pongs():
    """The step appends to a list it reads: refused at capture by default (effects/writes.py); a user
    who allows such writes gets replays that do not append, and two signatures' captures would undo
    each other's snapshot if the list were guarded."""
    allowing = dataclasses.replace(RECORDING, allow_python_writes=True)
    step = side_by_side(hc.writing_factor, {}, batch_sizes=(2, 4), config=allowing)
    assert step.stats.captures == 2
    guard = next(iter(step._lives.values())).current.guard
    assert "global 'HISTORY' in helpers_contents.py" in guard.reads.written
    assert "global 'LOSS_WEIGHTS' in helpers_contents.py" in [r.label for r in guard.reads.contents.roots]


def test_what_cannot_be_guarded_is_named_once_at_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        side_by_side(hc.unguarded_factor, {}, steps=4)
        side_by_side(hc.unguarded_factor, {}, steps=4)  # another capture: not named again
    warnings = [r.getMessage() for r in caplog.records if "no guard watches" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "global 'BIG' in helpers_contents.py (list): more than 1000 entries" in warnings[0]
    assert "global 'RAW' in helpers_contents.py (bytearray): graphstep cannot see into it" in warnings[0]
    # Code generated by exec (a dataclass's __init__ reading its sentinels) is nobody's read.
    assert "_HAS_DEFAULT_FACTORY" not in warnings[0], warnings[0]


def test_a_replay_after_no_change_compares_no_dict_entry():
    """Where the helper watches dicts (Python 3.12+), a check after no change skips every dict;
    elsewhere every container gets one identity pass. Both see every kind of change."""
    guard = contents.Contents()
    data = {"a": [1.0, {"b": 2.0}], "c": 3}
    assert guard.add("CFG", data)
    helper = fastcheck.helper()
    watched = helper is not None and helper.watches_dicts
    assert bool(guard.watched_dicts) == watched and bool(guard.dicts) != watched
    assert len(guard.seqs) == 1  # the list: no watcher for lists
    assert guard.holds()
    for change, undo in [
        (lambda: data.__setitem__("c", 4), lambda: data.__setitem__("c", 3)),
        (lambda: data["a"][1].__setitem__("b", 2.5), lambda: data["a"][1].__setitem__("b", 2.0)),
        (lambda: data["a"].append(0), data["a"].pop),
        (lambda: data.__setitem__("d", 0), lambda: data.pop("d")),
    ]:
        change()
        assert not guard.holds() and guard.changes()
        undo()
        assert guard.holds() and not guard.changes()
    data["c"] = int("3")  # equal, another object where ints are not cached: adopted
    assert guard.holds() and guard.holds()
