"""Guards over what a step's Python reads: requires_grad, module attributes, and the globals and
closure cells of helper functions the step calls. Each test runs 30 steps on the recording backend
(which bakes Python numbers in, as a CUDA graph does) next to an eager twin, compares them with
torch.equal after every step, and would fail without its guard."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphstep
import helpers_reads
from cpu_common import (
    TinyNet,
    batches,
    each_tracer,  # noqa: F401  (each test under each tracer this Python has)
    same_params,
)
from graphstep.guards.change import Change
from graphstep.guards.optimizer import hyperparameters
from graphstep.guards.reads import Reads, ReadWatch
from graphstep.guards.state_guard import StateGuard
from graphstep.state import TrainingState

# ReadNet counts its forwards in a Python attribute, which a capture refuses unless allowed: allowed
# here, where what matters is that a write by the step itself is never a reason to re-capture.
RECORDING = graphstep.Config(
    backend="recording", warmup_steps=2, max_recaptures=100, allow_python_writes=True
)
LOSS, SET_WEIGHT = helpers_reads.make_weighted_loss(1.0)


class ReadNet(TinyNet):
    """TinyNet with a Python float its forward reads, and a counter its forward writes."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8)
        self.calls += 1  # written by the step itself: never a reason to re-capture
        return super().forward(x) / self.temperature


def make_step(model, opt):
    def step(x, y):
        # A helper in another module, with its own globals and closure; and a module's attribute.
        loss = LOSS(model(x), y) * helpers_reads.LOSS_WEIGHT
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.fixture(autouse=True)
def restore_helpers():
    yield
    helpers_reads.TEMPERATURE = 1.0
    helpers_reads.LOSS_WEIGHT = 1.0
    helpers_reads.CONFIG = helpers_reads.LossConfig()
    helpers_reads.reset_containers()
    SET_WEIGHT(1.0)


class Twins:
    """An eager run and a graphstep run of the same step, changed the same way."""

    def __init__(self, config=RECORDING):
        torch.manual_seed(0)
        self.model = ReadNet()
        self.twin = copy.deepcopy(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.twin_opt = torch.optim.SGD(self.twin.parameters(), lr=0.05, momentum=0.9)
        self.eager = make_step(self.model, self.opt)
        self.step = graphstep.capture(
            make_step(self.twin, self.twin_opt), model=self.twin, optimizer=self.twin_opt, config=config
        )

    def both(self, change):
        change(self.model, self.opt)
        change(self.twin, self.twin_opt)

    def call(self, x, y, seed):
        torch.manual_seed(seed)
        expected = self.eager(x, y)
        torch.manual_seed(seed)
        got = self.step(x, y)
        assert torch.equal(expected, got), f"step {seed}: loss {got.item()} != eager {expected.item()}"
        assert same_params(self.model, self.twin), f"step {seed}: parameters differ from eager"


def run(twins: Twins, changes: dict, steps: int = 30):
    """`changes`: {step index: function(twins)} applied before that step."""
    for i, (x, y) in enumerate(batches(steps)):
        if i in changes:
            changes[i](twins)
        twins.call(x, y, seed=i)


def freeze(flag):
    def change(twins):
        twins.both(lambda m, o: m.fc1.requires_grad_(flag))

    return change


def test_freezing_and_unfreezing_a_layer_captures_a_variant_and_names_the_parameter(caplog):
    twins = Twins()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {10: freeze(False), 20: freeze(True)})
    assert "model.fc1.weight: requires_grad True -> False" in caplog.text
    stats = twins.step.stats  # unfreezing goes back to the first graph
    assert (stats.captures, stats.variants, stats.variant_switches) == (2, 1, 1)


def test_unfreezing_a_layer_that_never_trained_warms_up_before_capturing():
    """Its optimizer state does not exist yet: the next step creates it, and a capture of that
    step would replay the creation (momentum = grad) forever."""
    twins = Twins(graphstep.Config(backend="recording", warmup_steps=1, allow_python_writes=True))
    run(twins, {0: freeze(False), 2: freeze(True)})
    assert twins.step.stats.captures == 2
    assert twins.step.stats.warmup_calls == 2
    # The same before a signature's first capture: its warm-up ran with the layer frozen.
    twins = Twins(graphstep.Config(backend="recording", warmup_steps=1, allow_python_writes=True))
    freeze(False)(twins)
    twins.call(*batches(1, batch_size=2)[0], seed=0)  # warms up this signature
    twins.call(*batches(1, batch_size=4)[0], seed=1)  # and another
    freeze(True)(twins)
    for i in range(2, 6):
        twins.call(*batches(1, batch_size=2, seed=i)[0], seed=i)
    assert twins.step.stats.warmup_calls == 3


def test_dropout_p_changed_recaptures_and_names_it(caplog):
    twins = Twins()

    def set_p(p):
        return lambda t: t.both(lambda m, o: setattr(m.drop, "p", p))

    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {8: set_p(0.0), 16: set_p(0.5), 24: set_p(0.5)})
    assert "model.drop.p: 0.1 -> 0.0" in caplog.text
    assert "model.drop.p: 0.0 -> 0.5" in caplog.text
    assert twins.step.stats.captures == 3  # writing the same value again is no change


def test_a_submodule_without_parameters_replaced_recaptures(caplog):
    twins = Twins()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {10: lambda t: t.both(lambda m, o: setattr(m, "drop", torch.nn.Dropout(0.6)))})
    assert "a submodule was replaced" in caplog.text
    assert twins.step.stats.captures == 2


def test_model_float_attribute_read_in_forward_recaptures(caplog):
    twins = Twins()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {12: lambda t: t.both(lambda m, o: setattr(m, "temperature", 0.5))})
    assert "model.temperature: 1.0 -> 0.5" in caplog.text
    assert twins.step.stats.captures == 2
    # The counter the forward writes is the step's own business, not a change between calls.
    assert "calls" not in caplog.text


def test_helper_module_global_recaptures_and_names_its_file(caplog):
    twins = Twins()

    def set_temperature(value):
        def change(_):
            helpers_reads.TEMPERATURE = value

        return change

    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {7: set_temperature(0.5), 19: set_temperature(2)})
    assert "global 'TEMPERATURE' in helpers_reads.py: 1.0 -> 0.5" in caplog.text
    assert "global 'TEMPERATURE' in helpers_reads.py: 0.5 -> 2" in caplog.text  # int now: another type
    assert twins.step.stats.captures == 3


def test_attribute_of_a_user_module_recaptures(caplog):
    twins = Twins()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {9: lambda _: setattr(helpers_reads, "LOSS_WEIGHT", 0.5)})
    assert "global 'LOSS_WEIGHT' in helpers_reads.py: 1.0 -> 0.5" in caplog.text
    assert twins.step.stats.captures == 2


def test_helper_closure_cell_recaptures(caplog):
    twins = Twins()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {11: lambda _: SET_WEIGHT(3.0)})
    assert "closure variable 'weight' of make_weighted_loss.<locals>.loss: 1.0 -> 3.0" in caplog.text
    assert twins.step.stats.captures == 2


def test_dataclass_config_field_recaptures(caplog):
    twins = Twins()

    def change(_):
        helpers_reads.CONFIG.scale = 0.25
        helpers_reads.CONFIG.squared = False

    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {13: change, 21: lambda _: setattr(helpers_reads, "CONFIG", helpers_reads.LossConfig())})
    assert "global 'CONFIG' in helpers_reads.py, at .scale: 1.0 -> 0.25" in caplog.text
    # A new object equal to the first: the first graph again, no capture.
    assert twins.step.stats.captures == 2 and twins.step.stats.variant_switches == 1


def test_config_dataclass_kept_by_the_model_recaptures(caplog):
    twins = Twins()
    twins.both(lambda m, o: setattr(m, "config", helpers_reads.LossConfig()))

    def forward(self, x):  # reads its own config
        return TinyNet.forward(self, x) * self.config.scale

    twins.model.forward = forward.__get__(twins.model)
    twins.twin.forward = forward.__get__(twins.twin)
    with caplog.at_level(logging.INFO, logger="graphstep"):
        run(twins, {14: lambda t: t.both(lambda m, o: setattr(m.config, "scale", 0.5))})
    assert "model.config, at .scale: 1.0 -> 0.5" in caplog.text
    assert twins.step.stats.captures == 2


def test_explain_points_out_unguarded_reads_and_the_steps_own_writes(twins):
    (_, _), (model, opt) = twins

    def step(x, y):
        model.last_batch = x.shape[0]  # a Python write a replay does not repeat
        loss = LOSS(model(x), y) * helpers_reads.SETTINGS["scale"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    captured = graphstep.capture(step, model=model, optimizer=opt, config=RECORDING)
    report = graphstep.explain(captured, *batches(1)[0])
    text = str(report)
    assert "global 'SETTINGS' in helpers_reads.py: dict, 1 entries by content" in text, text
    # Named once, as the write a capture refuses (with the line), not again as a value left unguarded.
    assert "model.last_batch = x.shape[0]" in text and "PythonWriteError" in text, text
    assert "model.last_batch is written by the step" not in text, text
    assert "global 'TEMPERATURE' in helpers_reads.py = 1.0" in text, text  # guarded, and listed
    assert "global 'CONFIG' in helpers_reads.py: LossConfig, 2 entries by content" in text, text


def test_forward_written_attributes_do_not_ping_pong_between_signatures():
    """Each signature's capture leaves `calls` and `last` at its own value; neither graph may
    take that as a change made between calls."""

    class Writer(TinyNet):
        def forward(self, x):
            self.last = x.shape[0]
            return super().forward(x)

    torch.manual_seed(0)
    model = Writer()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = graphstep.capture(make_step(model, opt), model=model, optimizer=opt, config=RECORDING)
    for i in range(30):
        x, y = batches(1, batch_size=2 + 2 * (i % 2), seed=i)[0]
        step(x, y)
    assert step.stats.captures == 2


def test_changes_are_structured():
    torch.manual_seed(0)
    model = ReadNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = make_step(model, opt)
    state = TrainingState([model], [opt])
    step(*batches(1)[0])
    guard = StateGuard(state, step, strict=False, grads_before=[(p, None) for p in model.parameters()])
    assert guard.holds() and guard.changes() == []
    model.eval()
    opt.param_groups[0]["momentum"] = 0.5
    model.fc2.weight.data = model.fc2.weight.data.clone()
    helpers_reads.TEMPERATURE = 0.5  # not the step's own global: unseen without a ReadWatch
    assert not guard.holds()
    changes = {c.text.split(":")[0]: c for c in guard.changes()}
    assert all(isinstance(c, Change) for c in changes.values())
    assert changes["model"].variant and changes["model.drop"].variant
    assert changes["optimizer.param_groups[0]['momentum']"].optimizer is opt
    assert changes["optimizer.param_groups[0]['momentum']"].variant
    assert not changes["model.fc2.weight"].variant and changes["model.fc2.weight"].optimizer is None
    assert not any("TEMPERATURE" in text for text in changes)
    # An optimizer that runs eagerly between replays is none of the graph's business.
    model.train()
    eager = StateGuard(state, step, strict=False, grads_before=[], eager_optimizers=[opt])
    opt.param_groups[0]["momentum"] = 0.1
    opt.state.clear()
    assert eager.holds()


def test_hyperparameters_leave_out_tensors_and_tuples_of_tensors():
    group = {
        "params": [],
        "lr": torch.tensor(0.1),
        "betas": (torch.tensor(0.9), torch.tensor(0.99)),
        "eps": 1e-8,
    }
    group["weight_decay"] = 0.01
    group["foreach"] = None
    live = ("<device tensor>", "<device tensor>")  # positions read live; numbers beside them compared
    assert hyperparameters(group) == {"betas": live, "eps": 1e-8, "weight_decay": 0.01, "foreach": None}


def test_read_watch_sees_helpers_not_libraries_and_restores_the_profiler():
    torch.manual_seed(0)
    model = ReadNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = make_step(model, opt)
    calls = []

    def previous(frame, event, arg):
        calls.append(event)

    x, y = batches(1)[0]
    sys.setprofile(previous)
    try:
        with ReadWatch() as watch:
            step(x, y)
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    assert calls, "the previous profiler is chained, not silenced"
    labels = [label for label, _, _ in watch.reads.globals] + [label for label, _ in watch.reads.cells]
    assert "global 'TEMPERATURE' in helpers_reads.py" in labels
    assert "global 'CONFIG' in helpers_reads.py" in labels
    assert "closure variable 'weight' of make_weighted_loss.<locals>.loss" in labels
    assert "global 'LOSS' in test_guards_reads.py" in labels
    user_files = ("cpu_common.py", "test_guards_reads.py", "helpers_reads.py")
    assert all(label.startswith("closure") or label.endswith(user_files) for label in labels), labels
    assert all(f.split("(")[1].startswith(user_files) for f in watch.reads.functions), watch.reads.functions
    assert any(name == "calls" for _, name in watch.reads.module_writes)
    assert Reads.of_function(step).cells  # the step's own closure, without running it


MOVES = {
    "lr": lambda t: t.both(lambda m, o: o.param_groups[0].__setitem__("lr", o.param_groups[0]["lr"] * 0.7)),
    "data": lambda t: t.both(lambda m, o: setattr(m.fc1.weight, "data", m.fc1.weight.data.clone() * 0.5)),
    "eval": lambda t: t.both(lambda m, o: m.eval()),
    "train": lambda t: t.both(lambda m, o: m.train()),
    "freeze": freeze(False),
    "unfreeze": freeze(True),
    "dropout": lambda t: t.both(lambda m, o: setattr(m.drop, "p", 0.3 if m.drop.p != 0.3 else 0.1)),
    "new dropout": lambda t: t.both(lambda m, o: setattr(m, "drop", torch.nn.Dropout(0.6 - m.drop.p))),
    "temperature": lambda t: t.both(lambda m, o: setattr(m, "temperature", m.temperature * 0.9)),
    "global": lambda _: setattr(helpers_reads, "TEMPERATURE", helpers_reads.TEMPERATURE * 1.1),
    "module attribute": lambda _: setattr(helpers_reads, "LOSS_WEIGHT", 2.0 - helpers_reads.LOSS_WEIGHT),
    "cell": lambda _: SET_WEIGHT(0.5),
    "field": lambda _: setattr(helpers_reads.CONFIG, "squared", not helpers_reads.CONFIG.squared),
    # Containers changed in place: the bindings stay the same objects.
    "dict item": lambda _: helpers_reads.SETTINGS.__setitem__("scale", 1.8 - helpers_reads.SETTINGS["scale"]),
    "list item": lambda _: helpers_reads.LOSS_WEIGHTS.__setitem__(0, 1.75 - helpers_reads.LOSS_WEIGHTS[0]),
    "list length": lambda _: (
        helpers_reads.LOSS_WEIGHTS.append(0.25)
        if len(helpers_reads.LOSS_WEIGHTS) < 3
        else helpers_reads.LOSS_WEIGHTS.pop()
    ),
    "nested namespace": lambda _: setattr(
        helpers_reads.NESTED.loss, "weight", 1.5 - helpers_reads.NESTED.loss.weight
    ),
}


def test_random_changes_always_equal_eager(random_examples):
    @random_examples
    @given(
        st.lists(
            st.tuples(st.sampled_from([None, *MOVES]), st.sampled_from([2, 4])),
            min_size=4,
            max_size=14,
        )
    )
    def calls_in_a_row(calls):
        helpers_reads.TEMPERATURE = 1.0
        helpers_reads.LOSS_WEIGHT = 1.0
        helpers_reads.CONFIG = helpers_reads.LossConfig()
        helpers_reads.reset_containers()
        SET_WEIGHT(1.0)
        twins = Twins(
            graphstep.Config(
                backend="recording", warmup_steps=1, max_recaptures=100, allow_python_writes=True
            )
        )
        for i, (move, batch_size) in enumerate(calls):
            if move is not None:
                MOVES[move](twins)
            x, y = batches(1, batch_size=batch_size, seed=i)[0]
            twins.call(x, y, seed=i)

    calls_in_a_row()


def test_the_cpp_helper_sees_what_the_python_path_sees():
    """Runs where the helper is built (GRAPHSTEP_BUILD_FASTCHECK=1, or built at install)."""
    from graphstep.guards import fastcheck

    helper = fastcheck.helper()
    if helper is None:
        pytest.skip("the C++ guard helper is not built here")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    params = list(model.parameters())
    model[1].bias.requires_grad_(False)
    check = helper.TensorCheck(params, params[:3], params[3:])
    assert check.holds()
    model[0].weight.requires_grad_(False)
    assert not check.holds()
    model[0].weight.requires_grad_(True)
    model[1].bias.requires_grad_(True)
    assert not check.holds()
    model[1].bias.requires_grad_(False)
    assert check.holds()
    model[0].bias.data = model[0].bias.data.clone()
    assert not check.holds()

    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    states = helper.StateCheck([opt.state])
    assert states.holds()
    buffer = opt.state[params[0]]["momentum_buffer"]
    opt.state[params[0]]["momentum_buffer"] = buffer.clone()
    assert not states.holds()
    opt.state[params[0]]["momentum_buffer"] = buffer
    assert states.holds()
    opt.state[params[0]]["extra"] = 1
    assert not states.holds()
    del opt.state[params[0]]["extra"]
    assert states.holds()
    kept = opt.state.pop(params[0])
    assert not states.holds()
    opt.state[params[0]] = kept  # back, but now last: another order
    assert not states.holds()


def test_the_cpp_state_check_sees_every_kind_of_dict_change():
    """From Python 3.12 the helper watches the state dicts and walks them only after a change:
    every way to change a dict must count as one, and a change undone must hold again."""
    import sys

    from graphstep.guards import fastcheck

    helper = fastcheck.helper()
    if helper is None:
        pytest.skip("the C++ guard helper is not built here")
    assert helper.watches_dicts == (sys.version_info >= (3, 12))
    model = torch.nn.Linear(4, 4)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    inner = opt.state[params[0]]
    kept = dict(inner)
    check = helper.StateCheck([opt.state])
    assert check.holds() and check.holds()
    # Watched, nothing changed since the check was made: no walk. Else every holds() walks.
    assert check.walks == (0 if helper.watches_dicts else 2)
    changes = {
        "clear": inner.clear,
        "update with a new tensor": lambda: inner.update(exp_avg=kept["exp_avg"].clone()),
        "popitem": inner.popitem,
        "setdefault of a new key": lambda: inner.setdefault("extra", 0),
        "outer setdefault of a new key": lambda: opt.state.setdefault("extra", {}),
        "outer defaultdict read of a missing key": lambda: opt.state["missing"],
        "outer dict replaced for a parameter": lambda: opt.state.__setitem__(
            params[1], dict(opt.state[params[1]])
        ),
    }
    for name, change in changes.items():
        assert check.holds() and check.holds(), name  # the second from the fast path, where watched
        outer_entries = list(opt.state.items())
        walks = check.walks
        change()
        assert not check.holds(), name
        assert check.walks == walks + 1, name  # a change always makes the next holds() walk
        # Undo: the same objects in the same order again.
        inner.clear()
        inner.update(kept)
        opt.state.clear()
        opt.state.update(outer_entries)
        opt.state.pop("extra", None)
        opt.state.pop("missing", None)
        assert check.holds(), f"{name}, undone"


def test_probing_a_guard_that_fails_has_no_side_effect():
    """The lifecycle may probe the guard of every graph variant; only the one that holds may
    re-attach its grad buffers to parameters whose grads the user set to None."""
    torch.manual_seed(0)
    model = ReadNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batches(1)[0]
    LOSS(model(x), y).backward()  # grads exist before the step and outlive it: accumulation
    grads_before = [(p, p.grad) for p in model.parameters()]
    LOSS(model(x), y).backward()
    guard = StateGuard(
        TrainingState([model], [opt]), make_step(model, opt), strict=False, grads_before=grads_before
    )
    buffers = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    model.fc2.bias.requires_grad_(False)  # checked after modes, optimizers and reads
    assert not guard.holds()
    assert all(p.grad is None for p in model.parameters())
    model.fc2.bias.requires_grad_(True)
    assert guard.holds()
    assert all(p.grad is b and not b.any() for p, b in zip(model.parameters(), buffers))


def test_optimizer_values_are_compared_after_an_assignment_and_lists_always():
    from graphstep.guards.optimizer import OptimizerWatch

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    group = opt.param_groups[0]
    watch = OptimizerWatch([opt], [opt], lambda o, k: False)
    seen = watch.seen[0]
    assert watch.holds() and seen.holds()  # nothing assigned: identity alone decides
    group["lr"] = float("0.1")  # equal, another object: compared once, then adopted
    assert not seen.holds() and watch.holds() and seen.holds()
    group["lr"] = 0.2
    assert not watch.holds()
    group["lr"] = 0.1
    assert watch.holds()
    del group["momentum"]
    group["dampening_too"] = 0.9  # a key swapped for another: as many keys, other names
    assert not watch.holds()

    listed = torch.optim.SGD([p], lr=0.1)
    listed.param_groups[0]["schedule"] = [1, 2]  # can change in place: compared on every check
    watch = OptimizerWatch([listed], [listed], lambda o, k: False)
    assert watch.holds() and not watch.seen[0].holds()
    listed.param_groups[0]["schedule"].append(3)
    assert not watch.holds()


def test_a_helper_built_for_another_torch_is_refused(caplog):
    import types

    from graphstep.guards import fastcheck

    stale = types.SimpleNamespace(torch_version="1.0.0", TensorCheck=None)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        assert fastcheck._if_same_torch(stale) is None
    assert "built for torch 1.0.0" in caplog.text
    current = types.SimpleNamespace(torch_version=torch.__version__)
    assert fastcheck._if_same_torch(current) is current


def test_bindings_hold_by_identity_then_by_value_and_an_equal_value_is_adopted():
    """`ReadGuard.holds()` passes over the bindings by identity first; a simple value rebound to an
    equal object holds (and is adopted, so the next call takes the identity pass again); another
    value, or an emptied closure cell, does not."""
    from graphstep.guards.read_guard import ReadGuard

    def reader(value: float):
        def read() -> float:
            return value

        return read

    cell = reader(3.0).__closure__[0]
    namespace = {"SCALE": 0.5, "NAME": "x"}
    reads = Reads()
    reads.globals.append(("global 'SCALE'", namespace, "SCALE"))
    reads.globals.append(("global 'NAME'", namespace, "NAME"))
    reads.cells.append(("closure variable 'value'", cell))
    guard = ReadGuard(reads)
    assert guard.holds()
    namespace["SCALE"] = float("0.5")  # another float object, the same value
    assert namespace["SCALE"] is not guard._values[0]
    assert guard.holds()
    assert guard._values[0] is namespace["SCALE"]  # adopted: the identity pass holds from now on
    cell.cell_contents = float("3.0")  # the closure variable rebound to an equal value
    assert guard.holds() and guard._values[-1] is cell.cell_contents
    namespace["NAME"] = "y"
    assert not guard.holds() and guard.changes()
    namespace["NAME"] = "x"
    assert guard.holds()
    del cell.cell_contents  # an emptied cell
    assert not guard.holds()
