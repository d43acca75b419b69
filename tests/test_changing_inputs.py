"""Arguments a graph cannot serve: a Python number that changes every call, and tensors that cannot be
loaded into a graph's input buffers. Each is named, with what to do, before anything is lost."""

from __future__ import annotations

import logging
import types

import pytest
import torch

import graphstep
from cpu_common import batches, make_twins, same_params, sgd_step
from graphstep.backends.buffers import unloadable
from graphstep.errors import ChangingArgumentError, TooManyGraphsError, UnsupportedInputError
from graphstep.guards import fastcheck
from graphstep.signature import Signature

RECORDING = graphstep.Config(backend="recording", warmup_steps=2)


def indexed(model, opt):
    """A step that takes the iteration index, as timm's `ModelEmaV3.update(model, step=i)` does."""
    step = sgd_step(model, opt)

    def train(x, y, i):
        return step(x, y) * (1.0 + 0.0 * i)

    return train


def test_a_number_argument_that_changes_every_call_is_named_before_max_graphs_is_spent():
    (m_e, o_e), (m_g, o_g) = make_twins()
    data = batches(4)
    torch.manual_seed(7)
    for i, (x, y) in enumerate(data[:3]):
        indexed(m_e, o_e)(x, y, i)
    captured = graphstep.capture(indexed(m_g, o_g), model=m_g, optimizer=o_g, config=RECORDING)
    torch.manual_seed(7)
    for i, (x, y) in enumerate(data[:3]):
        captured(x, y, i)  # each a new signature: a first warm-up each
    with pytest.raises(ChangingArgumentError) as info:
        captured(*data[3], 3)
    assert isinstance(info.value, TooManyGraphsError)
    text = str(info.value)
    assert "argument args[2] is a Python int" in text and "(0, 1, 2, 3)" in text, text
    assert "0-d tensor" in text and "fill_" in text, text
    assert same_params(m_e, m_g), "the refused call took no step"
    assert captured.stats.warmup_calls == 3 and captured.stats.captures == 0


def test_the_index_as_a_device_tensor_is_one_graph_equal_to_eager():
    (m_e, o_e), (m_g, o_g) = make_twins()
    data = batches(30)
    index = torch.zeros((), dtype=torch.long)
    torch.manual_seed(7)
    eager = []
    for i, (x, y) in enumerate(data):
        index.fill_(i)
        eager.append(indexed(m_e, o_e)(x, y, index))
    captured = graphstep.capture(indexed(m_g, o_g), model=m_g, optimizer=o_g, config=RECORDING)
    torch.manual_seed(7)
    graphed = []
    for i, (x, y) in enumerate(data):
        index.fill_(i)
        graphed.append(captured(x, y, index))
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert same_params(m_e, m_g)
    assert captured.stats.captures == 1 and captured.stats.replays == 27


def test_a_number_argument_with_a_few_values_gets_a_graph_per_value():
    _, (m_g, o_g) = make_twins()
    captured = graphstep.capture(indexed(m_g, o_g), model=m_g, optimizer=o_g, config=RECORDING)
    for i, (x, y) in enumerate(batches(20)):
        captured(x, y, i % 2)
    assert captured.stats.captures == 2


@pytest.mark.filterwarnings("ignore:graphstep:UserWarning")  # the eager fallback warns per signature
def test_with_eager_fallback_a_changing_number_is_named_once_and_the_calls_go_on(caplog):
    _, (m_g, o_g) = make_twins()
    config = graphstep.Config(backend="recording", warmup_steps=2, on_too_many_graphs="eager")
    captured = graphstep.capture(indexed(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for i, (x, y) in enumerate(batches(12)):
            captured(x, y, i)
    named = [r for r in caplog.records if "argument args[2] is a Python int" in r.getMessage()]
    assert len(named) == 1, caplog.text


def test_a_changing_number_is_named_even_when_max_graphs_is_small():
    _, (m_g, o_g) = make_twins()
    config = graphstep.Config(backend="recording", warmup_steps=2, max_graphs=2)
    captured = graphstep.capture(indexed(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    data = batches(3)
    captured(*data[0], 0.5)
    captured(*data[1], 1.5)
    with pytest.raises(ChangingArgumentError, match=r"args\[2\] is a Python float"):
        captured(*data[2], 2.5)


# -- inputs that cannot be loaded ---------------------------------------------------------------------


def test_a_meta_tensor_argument_is_named_at_capture():
    step = graphstep.capture(lambda x: x * 2, config=graphstep.Config(backend="recording"))
    meta = torch.empty(4, 8, device="meta")
    for _ in range(3):
        assert step(meta).device.type == "meta"  # the eager warm-ups do not fail
    with pytest.raises(UnsupportedInputError) as info:
        step(meta)
    text = str(info.value)
    assert text.startswith("argument args[0] is a meta tensor") and "to_empty" in text, text


def test_a_tensor_on_another_cuda_device_is_refused_with_the_way_out():
    elsewhere = types.SimpleNamespace(device=torch.device("cuda", 1))  # only its device is read
    why = unloadable(elsewhere, 0)
    assert "is on cuda:1, but the step's graphs run on cuda:0" in why and ".to('cuda:0')" in why
    assert unloadable(types.SimpleNamespace(device=torch.device("cuda", 0)), 0) == ""
    assert unloadable(torch.ones(2), 0) == ""  # host memory: copied through a pinned buffer
    assert unloadable(torch.ones(2), None) == ""


def test_an_input_that_cannot_be_copied_into_a_buffer_is_named():
    step = graphstep.capture(lambda x: x.sum(0), config=graphstep.Config(backend="recording", warmup_steps=1))
    expanded = torch.ones(1, 8).expand(4, 8)  # stride 0: a buffer shaped like it cannot be written
    assert torch.equal(step(expanded), torch.full((8,), 4.0))  # eager is fine
    with pytest.raises(UnsupportedInputError) as info:
        step(expanded)
    text = str(info.value)
    assert text.startswith("argument args[0] (float32[4, 8] on cpu)") and ".contiguous()" in text, text
    # Among several inputs (copied by one launch first), the one that cannot be loaded is still named.
    step = graphstep.capture(
        lambda x, e: x.sum(0) + e.sum(0), config=graphstep.Config(backend="recording", warmup_steps=1)
    )
    step(torch.ones(4, 8), expanded)
    with pytest.raises(UnsupportedInputError) as info:
        step(torch.ones(4, 8), expanded)
    assert str(info.value).startswith("argument args[1] (float32[4, 8] on cpu)"), str(info.value)


@pytest.mark.skipif(fastcheck.helper() is None, reason="the C++ helper is not built")
def test_a_call_like_the_last_skips_its_signature_and_any_other_builds_one(monkeypatch):
    built = []
    real_of = Signature.of
    monkeypatch.setattr(Signature, "of", lambda a, k: built.append(1) or real_of(a, k))
    step = graphstep.capture(lambda x, y: (x * y).sum(), config=graphstep.Config(backend="recording"))
    x, y = torch.ones(3), torch.full((3,), 2.0)
    for _ in range(6):
        assert step(x.clone(), y.clone()).item() == 6.0
    assert len(built) == 1  # the first call; the rest matched it in C++
    weight = torch.nn.Parameter(torch.ones(3))
    calls = [  # (args, kwargs, result, signatures built)
        ((torch.ones(4), torch.ones(4)), {}, 4.0, 1),  # another shape
        ((torch.ones(4), torch.ones(4)), {}, 4.0, 0),  # like the last
        ((x, x), {}, 3.0, 1),  # the same tensor twice: not remembered
        ((x, y), {}, 6.0, 1),
        ((x,), {"y": y}, 6.0, 1),  # a keyword argument: not remembered
        ((weight, y), {}, 6.0, 1),  # a tensor subclass never matches
        ((weight, y), {}, 6.0, 1),
        ((x, y), {}, 6.0, 1),
        ((x, y), {}, 6.0, 0),
    ]
    for args, kwargs, result, signatures in calls:
        before = len(built)
        assert step(*args, **kwargs).item() == result
        assert len(built) - before == signatures, (args, kwargs)
    step.reset()  # forgets the last call: the next one builds its signature and warms up again
    warmups, before = step.stats.warmup_calls, len(built)
    step(x, y)
    assert len(built) == before + 1 and step.stats.warmup_calls == warmups + 1
