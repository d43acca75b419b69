"""Guards on the CPU: every change a replay would miss leads to a re-capture or an error, never a
silent difference. The recording backend has a CUDA graph's semantics (baked-in numbers, fixed
addresses), so each test would fail without its guard."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphstep
from cpu_common import TinyNet, batches, make_training, same_params, sgd_step
from graphstep.errors import HostSyncError, StaleGraphError

RECORDING = graphstep.Config(backend="recording", warmup_steps=2)


class Twins:
    """An eager run and a graphstep run of the same step, mutated the same way."""

    def __init__(self, config=RECORDING, step_fn=sgd_step):
        self.model, self.opt = make_training()
        self.twin = copy.deepcopy(self.model)
        self.twin_opt = torch.optim.SGD(self.twin.parameters(), lr=0.05, momentum=0.9)
        self.eager = step_fn(self.model, self.opt)
        self.step = graphstep.capture(
            step_fn(self.twin, self.twin_opt), model=self.twin, optimizer=self.twin_opt, config=config
        )

    def both(self, change):
        change(self.model, self.opt)
        change(self.twin, self.twin_opt)

    def call(self, x, y, seed=0):
        torch.manual_seed(seed)
        expected = self.eager(x, y)
        torch.manual_seed(seed)
        got = self.step(x, y)
        assert torch.equal(expected, got), f"loss {got.item()} != eager {expected.item()}"
        assert same_params(self.model, self.twin), "parameters differ from eager"


def run(twins: Twins, data, change=None, at=None):
    for i, (x, y) in enumerate(data):
        if i == at:
            twins.both(change)
        twins.call(x, y, seed=i)


def reassign_data(model, opt):
    model.fc1.weight.data = model.fc1.weight.data.clone() * 0.5


def test_param_data_reassigned_is_recaptured_and_named(caplog):
    twins = Twins()
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        run(twins, batches(8), reassign_data, at=5)
    assert twins.step.stats.captures == 2
    assert "model.fc1.weight: storage moved" in caplog.text


def test_optimizer_load_state_dict_between_calls_stays_equal():
    twins = Twins()
    data = batches(9)
    run(twins, data[:5])
    saved_e, saved_g = copy.deepcopy(twins.opt.state_dict()), copy.deepcopy(twins.twin_opt.state_dict())
    run(twins, data[5:7])
    twins.opt.load_state_dict(saved_e)
    twins.twin_opt.load_state_dict(saved_g)
    run(twins, data[7:])
    # graphstep's optimizer support copies a same-layout state into the tensors the graph reads.
    assert twins.step.stats.captures == 1


def test_eval_then_train_captures_eval_once_and_reuses_the_train_graph():
    twins = Twins()
    data = batches(10)
    run(twins, data[:4])
    twins.both(lambda m, o: m.eval())
    run(twins, data[4:7])
    twins.both(lambda m, o: m.train())
    run(twins, data[7:])
    stats = twins.step.stats
    assert (stats.captures, stats.variants, stats.variant_switches) == (2, 1, 1)


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda m, o: o.param_groups[0].__setitem__("lr", 0.01), "['lr']: 0.05 -> 0.01"),
        (lambda m, o: o.param_groups[0].__setitem__("momentum", 0.5), "['momentum']: 0.9 -> 0.5"),
        (lambda m, o: o.param_groups[0].__setitem__("weight_decay", 0.1), "['weight_decay']: 0 -> 0.1"),
    ],
)
def test_python_hyperparameter_changed_by_hand_is_recaptured(change, name, caplog):
    twins = Twins()
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        run(twins, batches(8), change, at=5)
    assert name in caplog.text
    assert twins.step.stats.captures == 2


def accumulate(model, opt):
    """No zero_grad inside: grads persist across calls (accumulation across calls)."""

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def test_grads_set_to_none_between_calls_are_zeroed_in_place():
    twins = Twins(step_fn=accumulate)
    for i, (x, y) in enumerate(batches(12)):
        if i % 3 == 0 and i:
            twins.both(lambda m, o: o.zero_grad(set_to_none=True))
        twins.call(x, y, seed=i)
    # The warm-ups left grads, so the graph accumulates into them; the user's set_to_none is
    # absorbed (the buffers are zeroed and re-attached) without a re-capture.
    assert twins.step.stats.captures == 1
    assert all(p.grad is not None for p in twins.twin.parameters())


def test_grads_replaced_between_calls_is_recaptured(caplog):
    twins = Twins(step_fn=accumulate)
    data = batches(10)
    run(twins, data[:6])
    captures = twins.step.stats.captures
    twins.both(lambda m, o: setattr(m.fc2.bias, "grad", torch.ones_like(m.fc2.bias)))
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        run(twins, data[6:])
    assert "model.fc2.bias.grad: replaced by another tensor" in caplog.text
    assert twins.step.stats.captures == captures + 1


def test_closure_tensor_replaced_is_recaptured():
    holder = {"scale": torch.tensor(2.0)}
    scale = holder["scale"]

    def make(model, opt):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x) * scale, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    twins = Twins(step_fn=make)
    data = batches(8)
    run(twins, data[:5])
    scale = torch.tensor(3.0)  # rebinding the closure cell both steps read
    run(twins, data[5:])
    assert twins.step.stats.captures == 2


def test_item_inside_the_step_is_refused_at_capture(twins):
    (_, _), (model, opt) = twins
    inner = sgd_step(model, opt)

    def fn(x, y):
        loss = inner(x, y)
        if loss.item() > 1e9:  # the host sync
            raise AssertionError
        return loss

    step = graphstep.capture(fn, model=model, optimizer=opt, config=RECORDING)
    warmups = step.config.warmup_steps
    data = batches(warmups + 1)
    for x, y in data[:warmups]:  # warm-ups: a sync there is no reason to refuse
        step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(HostSyncError) as info:
        step(*data[warmups])
    assert "if loss.item() > 1e9" in str(info.value) and "test_guards.py" in str(info.value)
    assert "Nothing was lost" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.stats.captures == 0 and step.stats.warmup_calls == warmups


def test_recapture_limit_raises_or_falls_back():
    twins = Twins(graphstep.Config(backend="recording", warmup_steps=1, max_recaptures=1))
    data = batches(8)
    run(twins, data[:3])
    run(twins, data[3:5], reassign_data, at=0)  # first re-capture: allowed
    twins.both(reassign_data)
    with pytest.raises(StaleGraphError, match="max_recaptures=1"):
        twins.step(*data[5])

    fallback = Twins(
        graphstep.Config(backend="recording", warmup_steps=1, max_recaptures=0, on_recapture_limit="eager")
    )
    run(fallback, data[:3])
    with pytest.warns(UserWarning, match="eagerly from now on"):
        run(fallback, data[3:6], reassign_data, at=0)
    assert fallback.step.stats.eager_calls == 3


def test_without_checks_a_replay_silently_differs():
    """Why the guards exist: the same float-lr change with check="off" goes unseen."""
    twins = Twins(graphstep.Config(backend="recording", warmup_steps=2, check="off"))
    with pytest.raises(AssertionError, match=r"differ|!="):
        run(twins, batches(8), lambda m, o: o.param_groups[0].__setitem__("lr", 0.2), at=5)


def test_guards_name_things_found_in_closure_without_model_argument(caplog):
    model, opt = make_training()
    fn = sgd_step(model, opt)
    step = graphstep.capture(fn, config=RECORDING)  # no model= / optimizer=
    with caplog.at_level(logging.INFO, logger="graphstep"):
        for i, (x, y) in enumerate(batches(6)):
            if i == 4:
                model.eval()
            step(x, y)
    assert "closure variable 'model'.drop: switched to eval mode" in caplog.text


MUTATIONS = {
    "lr": lambda m, o: o.param_groups[0].__setitem__("lr", o.param_groups[0]["lr"] * 0.7),
    "data": reassign_data,
    "eval": lambda m, o: m.eval(),
    "train": lambda m, o: m.train(),
    "zero": lambda m, o: o.zero_grad(set_to_none=True),
    "copy": lambda m, o: m.fc2.bias.data.copy_(torch.ones(1)),  # in place: no re-capture needed
}


def test_random_call_sequences_always_equal_eager(random_examples):
    @random_examples
    @given(
        st.lists(
            st.tuples(st.sampled_from([None, *MUTATIONS]), st.sampled_from([2, 4])),
            min_size=4,
            max_size=14,
        )
    )
    def calls_in_a_row(calls):
        twins = Twins(graphstep.Config(backend="recording", warmup_steps=1, max_recaptures=100))
        for i, (mutation, batch_size) in enumerate(calls):
            if mutation is not None:
                twins.both(MUTATIONS[mutation])
            x, y = batches(1, batch_size=batch_size, seed=i)[0]
            twins.call(x, y, seed=i)

    calls_in_a_row()


def test_guard_holds_is_silent_for_unrelated_modules():
    twins = Twins()
    data = batches(6)
    run(twins, data[:4])
    TinyNet()  # registers parameters in an unrelated module: bumps the global epoch
    run(twins, data[4:])
    assert twins.step.stats.captures == 1


def test_verify_every_passes_when_replays_match_eager():
    twins = Twins(graphstep.Config(backend="recording", warmup_steps=2, verify_every=2))
    run(twins, batches(10))
    assert twins.step.stats.replays == 7


def test_verify_every_catches_a_change_no_guard_sees():
    """With guards off, verification is what catches a baked-in learning rate."""
    model, opt = make_training()
    config = graphstep.Config(backend="recording", warmup_steps=1, check="off", verify_every=1)
    step = graphstep.capture(sgd_step(model, opt), model=model, optimizer=opt, config=config)
    data = batches(5)
    for x, y in data[:3]:
        step(x, y)
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(graphstep.errors.VerificationError, match="differs from the reference run at"):
        step(*data[3])


def _first_param_state(opt):
    return opt.state[opt.param_groups[0]["params"][0]]


STATE_CHANGES = {
    # A parameter's momentum reset, as ReLoRA-style restarts do: eager starts it afresh.
    "reset": lambda m, o: o.state.__setitem__(o.param_groups[0]["params"][0], {}),
    "pop": lambda m, o: o.state.pop(o.param_groups[0]["params"][0]),
    # The same numbers in a new tensor: eager updates the new one, a stale graph the old one.
    "swapped": lambda m, o: _first_param_state(o).__setitem__(
        "momentum_buffer", _first_param_state(o)["momentum_buffer"].clone()
    ),
}


@pytest.mark.parametrize("change", sorted(STATE_CHANGES))
def test_optimizer_state_reset_or_replaced_between_calls_equals_eager(change, caplog):
    twins = Twins()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, batches(9), STATE_CHANGES[change], at=5)
    assert twins.step.stats.captures == 2
    assert "optimizer.state: a parameter's state was reset, added or replaced" in caplog.text
