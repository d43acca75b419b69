"""The guards' one-pass identity check (`fastcheck.identity_check`, used by `StateGuard.holds()`): each
kind of entry answers False as soon as its object is not the one seen, and a captured step's guard takes
the pass on replays after no change, the Python path after any change."""

from __future__ import annotations

import collections
import types

import pytest
import torch

import graphstep
from graphstep.guards import fastcheck
from graphstep.guards.barriers import MISSING
from graphstep.guards.state_guard import StateGuard

pytestmark = pytest.mark.skipif(
    getattr(fastcheck.helper(), "IdentityCheck", None) is None, reason="the C++ helper is not built"
)


def check(entries: list):
    return fastcheck.identity_check(entries, MISSING)


def equal_copy(x: float) -> float:
    return float(str(x))  # an equal float, another object


def test_an_item_or_attribute_holds_while_it_is_the_object_seen_and_missing_counts_as_a_value():
    lr = 0.5
    ns = {"lr": lr}
    obj = types.SimpleNamespace(w=lr)
    items = check([(fastcheck.ITEM, ns, "lr", lr), (fastcheck.ITEM, ns, "absent", MISSING)])
    attrs = check([(fastcheck.ATTR, obj, "w", lr), (fastcheck.ATTR, obj, "absent", MISSING)])
    assert items.holds() and attrs.holds()
    ns["lr"], obj.w = equal_copy(lr), equal_copy(lr)  # equal values are the Python path's to judge
    assert not items.holds() and not attrs.holds()
    ns["lr"], obj.w = lr, lr
    ns["absent"], obj.absent = 1, 1
    assert not items.holds() and not attrs.holds()
    del ns["absent"], obj.absent
    del ns["lr"], obj.w
    assert not items.holds() and not attrs.holds()


def test_a_cell_holds_while_it_holds_the_object_seen_and_an_emptied_cell_fails():
    value, other = object(), object()
    cell = types.CellType(value)
    seen = check([(fastcheck.CELL, cell, value, None)])
    assert seen.holds()
    cell.cell_contents = other
    assert not seen.holds()
    del cell.cell_contents
    assert not seen.holds()


@pytest.mark.parametrize("kind", [list, collections.deque, set])
def test_a_container_holds_while_it_has_the_same_objects_in_the_same_order(kind):
    a, b = object(), object()
    container = kind([a, b])
    expected = tuple(container)  # a set's own order
    seen = check([(fastcheck.ITEMS, container, expected, None)])
    assert seen.holds()
    if kind is set:
        container.discard(a)
    else:
        container[0] = object()
    assert not seen.holds()
    container.clear()
    container.update([a, b]) if kind is set else container.extend([a, b])
    assert seen.holds() == (tuple(container) == expected)  # the same objects again: holds in the same order
    container.add(object()) if kind is set else container.append(object())
    assert not seen.holds()


def test_a_whole_dict_holds_while_it_has_the_same_keys_in_the_same_order_holding_the_same_objects():
    a, b = object(), object()
    d = {"a": a, "b": b}
    seen = check([(fastcheck.DICT, d, tuple(d), tuple(d.values()))])
    assert seen.holds()
    d["a"] = object()
    assert not seen.holds()
    d["a"] = a
    assert seen.holds()
    d["a"] = d.pop("a")  # the same entries, another order
    assert not seen.holds()
    d.clear()
    d.update(a=a, b=b, c=None)
    assert not seen.holds()


def test_a_check_call_must_answer_as_when_the_guard_held_and_an_exception_answers_false():
    answers = {"watch": True, "changed": False}

    def broken():
        raise RuntimeError("a check that fails loudly")

    seen = check(
        [
            (fastcheck.TRUE, lambda: answers["watch"], None, None),
            (fastcheck.FALSE, lambda: answers["changed"], None, None),
        ]
    )
    assert seen.holds()
    answers["changed"] = True
    assert not seen.holds()
    answers["changed"], answers["watch"] = False, 1  # truthy is not True: only the answer the guard saw
    assert not seen.holds()
    raising = check([(fastcheck.TRUE, broken, None, None)])
    assert not raising.holds()  # and no exception: the Python path meets it again and reports it


def test_entries_of_the_wrong_form_are_refused_and_no_entries_mean_no_pass():
    assert check(None) is None
    with pytest.raises(TypeError):
        check([(fastcheck.ITEM, ["not a dict"], "k", None)])
    with pytest.raises(ValueError):
        check([(99, None, None, None)])


# ---------------------------------------------------------------- a captured step's guard

CFG = {"weight": 0.5, "layers": [1, 2]}
SCALE = 2.0


def captured_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @graphstep.capture(
        model=model, optimizer=opt, config=graphstep.Config(backend="recording", warmup_steps=1)
    )
    def step(x, y):
        loss = ((model(x) - y) ** 2).mean() * CFG["weight"] * SCALE * len(CFG["layers"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.fixture
def python_path_calls(monkeypatch):
    """How many times a guard took its Python path (`StateGuard._holds`)."""
    calls = {"n": 0}
    real = StateGuard._holds

    def counted(self):
        calls["n"] += 1
        return real(self)

    monkeypatch.setattr(StateGuard, "_holds", counted)
    monkeypatch.setitem(CFG, "weight", 0.5)
    monkeypatch.setitem(CFG, "layers", [1, 2])
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    return calls


def test_replays_after_no_change_take_the_identity_pass_and_a_change_still_picks_another_graph(
    python_path_calls,
):
    step = captured_step()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for _ in range(3):  # warm-up, capture, then the first replay builds the pass
        step(x, y)
    (life,) = step._lives.values()
    assert life.current.guard._identity is not None
    before = python_path_calls["n"]
    for _ in range(5):
        step(x, y)
    assert python_path_calls["n"] == before and step.stats.replays == 6  # no Python path, no capture

    CFG["layers"].append(3)  # a change inside a container the step reads
    step(x, y)
    assert step.stats.variants == 1 and python_path_calls["n"] > before


def test_a_loop_that_rebinds_an_equal_value_every_call_stops_rebuilding_the_pass(python_path_calls):
    global SCALE
    step = captured_step()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for _ in range(8):
        SCALE = equal_copy(SCALE)  # equal, another object: the Python path adopts it on each call
        step(x, y)
    (life,) = step._lives.values()
    guard = life.current.guard
    assert guard._identity is None and step.stats.captures == 1 and step.stats.variants == 0
    SCALE = 3.0  # still seen, on the Python path
    step(x, y)
    assert step.stats.variants == 1
