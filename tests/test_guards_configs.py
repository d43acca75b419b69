"""Guards over config objects a step reads: OmegaConf (interpolations included), ml_collections,
pydantic, attrs, argparse.Namespace, MappingProxyType and named tuples, changed in place (or rebound)
between calls; and what no guard can watch: named once at capture with the line that read it, or
refused with `Config(strict_reads=True)`. Each change test runs 24 steps on the recording backend
(which bakes Python numbers in, as a CUDA graph does) next to an eager twin, compares them with
torch.equal after every step, and would fail without the guard (the replay would keep the number of
the capture). A library's tests skip where it is not installed (`pip install graphstep[configs]`)."""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import decimal
import inspect
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

import graphstep
import helpers_configs as hc
from cpu_common import TinyNet, batches, same_params
from graphstep.errors import CaptureError, UnwatchedReadError
from graphstep.guards import contents, fastcheck
from graphstep.guards.barriers import MISSING

RECORDING = graphstep.Config(backend="recording", warmup_steps=2, max_recaptures=100)
STRICT = dataclasses.replace(RECORDING, strict_reads=True)
STEPS = 24


@pytest.fixture(autouse=True)
def fresh_configs():
    hc.reset()
    yield
    hc.reset()


def twins(factor, model_cls=TinyNet, config=RECORDING):
    """An eager step and a captured one, from one model, whose loss is scaled by `factor()`."""
    torch.manual_seed(0)
    model = model_cls()
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, twin)]

    def make_step(m, opt):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(m(x), y) * factor()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    captured = graphstep.capture(make_step(twin, opts[1]), model=twin, optimizer=opts[1], config=config)
    return (model, opts[0], make_step(model, opts[0])), (twin, opts[1], captured)


def side_by_side(factor, changes, *, model_cls=TinyNet, steps=STEPS, config=RECORDING):
    """Apply `changes[i](eager_model, twin)` before call i; every call equal to eager."""
    (model, _, eager), (twin, _, step) = twins(factor, model_cls, config)
    for i, (x, y) in enumerate(batches(steps)):
        if i in changes:
            changes[i](model, twin)
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        got = step(x, y)
        assert torch.equal(want, got), f"call {i}: graphstep {got.item()!r} != eager {want.item()!r}"
    assert same_params(model, twin), "parameters differ from eager"
    return step


def at(fn):
    """A change made once to shared state (both twins read the same config)."""
    return lambda model, twin: fn()


def assign(get, name, value):
    return at(lambda: setattr(get(), name, value))


def setitem(get, key, value):
    return at(lambda: get().__setitem__(key, value))


# name: (library, factor, {call: change}, the message of the first change)
KINDS = {
    "DictConfig, nested and in a ListConfig": (
        "omegaconf",
        hc.dictconfig_factor,
        {
            8: assign(lambda: hc.CFG.loss, "smoothing", 0.2),
            14: assign(lambda: hc.CFG.stages[1], "w", 1.5),
            20: at(lambda: hc.CFG.merge_with({"loss": {"smoothing": 0.1}, "stages": [1.0, {"w": 0.5}]})),
        },
        "global 'CFG' in helpers_configs.py, at .loss.smoothing: 0.1 -> 0.2",
    ),
    "interpolation whose source changes": (
        "omegaconf",
        hc.interpolation_factor,
        {8: assign(lambda: hc.CFG.train, "scale", 2.0), 16: assign(lambda: hc.CFG.train, "scale", 1.0)},
        "global 'LOSS' in helpers_configs.py, at .weight: 1.0 -> 2.0",
    ),
    "interpolation building a string": (
        "omegaconf",
        hc.string_interpolation_factor,
        {8: assign(lambda: hc.CFG.train, "scale", 2.0)},
        "global 'LOSS' in helpers_configs.py, at .tag: 'w=1.0' -> 'w=2.0'",
    ),
    "interpolation through a resolver (the environment)": (
        "omegaconf",
        hc.resolver_factor,
        {
            8: at(lambda: os.environ.__setitem__("GRAPHSTEP_TEST_SCALE", "0.5")),
            16: at(lambda: os.environ.pop("GRAPHSTEP_TEST_SCALE")),
        },
        "global 'LOSS' in helpers_configs.py, at .env: '1.0' -> '0.5'",
    ),
    "ListConfig": (
        "omegaconf",
        hc.listconfig_factor,
        {8: setitem(lambda: hc.OC_LIST, 0, 0.25), 16: at(lambda: hc.OC_LIST.append(3.0))},
        "global 'OC_LIST' in helpers_configs.py, at [0]: 1.0 -> 0.25",
    ),
    "ConfigDict": (
        "ml_collections",
        hc.configdict_factor,
        {8: assign(lambda: hc.CD.loss, "smoothing", 0.2), 16: assign(lambda: hc.CD.loss, "smoothing", 0.1)},
        "global 'CD' in helpers_configs.py, at .loss.smoothing: 0.1 -> 0.2",
    ),
    "ConfigDict FieldReference": (
        "ml_collections",
        hc.field_reference_factor,
        {8: assign(lambda: hc.CD, "base", 0.25)},
        "global 'CD' in helpers_configs.py, at .scale: 2.0 -> 0.5",
    ),
    "FrozenConfigDict rebound": (
        "ml_collections",
        hc.frozen_configdict_factor,
        {
            8: at(
                lambda: setattr(
                    hc, "CD_FROZEN", hc.ml_collections.FrozenConfigDict({"loss": {"smoothing": 0.2}})
                )
            )
        },
        "global 'CD_FROZEN' in helpers_configs.py, at .loss.smoothing: 0.1 -> 0.2",
    ),
    "pydantic model": (
        "pydantic",
        hc.pydantic_factor,
        {8: assign(lambda: hc.PYD, "weight", 0.5), 16: at(lambda: hc.PYD.terms.append("l1"))},
        "global 'PYD' in helpers_configs.py, at .weight: 1.0 -> 0.5",
    ),
    "attrs classes, slotted and not": (
        "attrs",
        hc.attrs_factor,
        {8: assign(lambda: hc.ATT, "weight", 0.5), 16: assign(lambda: hc.ATT_DICT, "weight", 0.5)},
        "global 'ATT' in helpers_configs.py, at .weight: 1.0 -> 0.5",
    ),
    "argparse.Namespace": (
        None,
        hc.namespace_factor,
        {8: assign(lambda: hc.NS, "smoothing", 0.2), 16: assign(lambda: hc.NS.loss, "weight", 0.5)},
        "global 'NS' in helpers_configs.py, at .smoothing: 0.1 -> 0.2",
    ),
    "MappingProxyType": (
        None,
        hc.proxy_factor,
        {
            8: setitem(lambda: hc.PROXY_BACKING, "weight", 0.5),
            16: setitem(lambda: hc.PROXY_BACKING, "weight", 1.0),
        },
        "global 'PROXY' in helpers_configs.py, at ['weight']: 1.0 -> 0.5",
    ),
    "named tuple rebound, and its list changed": (
        None,
        hc.namedtuple_factor,
        {
            8: at(lambda: setattr(hc, "WEIGHTS", hc.WEIGHTS._replace(main=0.5))),
            16: setitem(lambda: hc.WEIGHTS.aux, 0, 0.25),
        },
        "global 'WEIGHTS' in helpers_configs.py, at [0]: 1.0 -> 0.5",
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_config_changed_between_calls_picks_a_graph_for_its_new_values(kind, caplog):
    library, factor, changes, message = KINDS[kind]
    if library is not None:
        pytest.importorskip(library)
    with caplog.at_level(logging.INFO, logger="graphstep"):
        step = side_by_side(factor, changes)
    assert message in caplog.text, caplog.text
    assert "no guard watches" not in caplog.text, caplog.text
    assert step.stats.captures == len(changes) + 1 - step.stats.variant_switches, step.stats
    assert step.stats.variants >= 1


class ConfigNet(TinyNet):
    """A module that keeps a DictConfig and reads it in its forward (the user's code)."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = hc.OmegaConf.create({"head": {"scale": 1.0}})

    def forward(self, x):
        return super().forward(x) * self.cfg.head.scale


# A module of a library (its file is in site-packages): only the library's Python reads its config.
LIBRARY_NET = """
class LibraryNet(TinyNet):
    def __init__(self):
        super().__init__()
        self.cfg = OmegaConf.create({"head": {"scale": 1.0}})

    def forward(self, x):
        return super().forward(x) * self.cfg.head.scale
"""


def library_net():
    namespace = {"TinyNet": TinyNet, "OmegaConf": hc.OmegaConf}
    exec(compile(LIBRARY_NET, "/opt/venv/lib/site-packages/somelib/net.py", "exec"), namespace)
    return namespace["LibraryNet"]


@pytest.mark.parametrize("reader", ["user code", "a library's forward"])
def test_a_dictconfig_kept_by_a_module_is_guarded_by_content(reader, caplog):
    pytest.importorskip("omegaconf")
    model_cls = ConfigNet if reader == "user code" else library_net()

    def scale(value):
        def apply(model, twin):
            model.cfg.head.scale = twin.cfg.head.scale = value

        return apply

    with caplog.at_level(logging.INFO, logger="graphstep"):
        step = side_by_side(lambda: 1.0, {8: scale(0.5), 16: scale(1.0)}, model_cls=model_cls)
    assert "model.cfg, at .head.scale: 1.0 -> 0.5" in caplog.text, caplog.text
    assert (step.stats.captures, step.stats.variant_switches) == (2, 1)


def test_an_interpolation_is_checked_through_its_trees_storage_and_a_resolver_by_reading_it():
    """A replay compares the storage of LOSS's whole tree by identity (`weight` and `tag` read
    `train.scale`, outside LOSS) and resolves only `env` again (OmegaConf parses it on every read)."""
    pytest.importorskip("omegaconf")
    guard = contents.Contents()
    assert guard.add("LOSS", hc.LOSS)
    assert len(guard.calls) == 1 and guard.holds()
    hc.CFG.train.scale = 2.0
    assert not guard.holds()
    assert {text for text, _ in guard.changes()} == {
        "LOSS, at .weight: 1.0 -> 2.0",
        "LOSS, at .tag: 'w=1.0' -> 'w=2.0'",
    }
    hc.CFG.train.scale = 1.0
    hc.CFG.stages[0] = 2.0  # elsewhere in the tree: walked again, equal, adopted
    assert guard.holds() and not guard.changes()


def test_an_object_no_guard_can_watch_is_named_once_with_the_line_that_read_it(caplog):
    line = inspect.getsourcelines(hc.opaque_factor)[1] + 1
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        side_by_side(hc.opaque_factor, {}, steps=4)
        side_by_side(hc.opaque_factor, {}, steps=4)  # another capture: not named again
    warnings = [r.getMessage() for r in caplog.records if "no guard watches" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "global 'OPAQUE' in helpers_configs.py (Opaque): graphstep cannot see into it" in warnings[0]
    assert f"helpers_configs.py:{line} in opaque_factor: `return OPAQUE.scale`" in warnings[0], warnings[0]
    assert "strict_reads=True" in warnings[0]


QUIET = {
    "math": math,
    "log": logging.getLogger("x"),
    "eps": torch.finfo(torch.float32),
    "d": decimal.Decimal(1),
}


def quiet_factor() -> float:
    """Reads a module, a function, a class, a logger, a torch object and an immutable number."""
    return (
        QUIET["log"].level * 0
        + math.cos(0.0) * float(QUIET["d"])
        + QUIET["eps"].eps * 0
        + len(str(dataclasses.fields))
    )


def test_modules_functions_torch_objects_and_immutable_values_are_not_named(caplog):
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        side_by_side(quiet_factor, {}, steps=4, config=STRICT)
    assert "no guard watches" not in caplog.text, caplog.text


def test_strict_reads_refuses_the_capture_names_the_line_and_rolls_it_back():
    (model, opt, eager), (twin, twin_opt, step) = twins(hc.opaque_factor, config=STRICT)
    data = batches(3)
    for x, y in data[:2]:  # the warm-ups run
        torch.manual_seed(0)
        eager(x, y)
        torch.manual_seed(0)
        step(x, y)
    with pytest.raises(UnwatchedReadError) as info:
        torch.manual_seed(0)
        step(*data[2])
    assert isinstance(info.value, CaptureError)
    assert same_params(model, twin), "the failed capture left the parameters as the warm-ups did"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], twin_opt.state[q]["momentum_buffer"])
    assert step.stats.captures == 0
    text = str(info.value)
    line = inspect.getsourcelines(hc.opaque_factor)[1] + 1
    assert "global 'OPAQUE' in helpers_configs.py (Opaque)" in text, text
    assert f"helpers_configs.py:{line} in opaque_factor: `return OPAQUE.scale`" in text, text
    assert "graphstep.unchanging(obj)" in text and "tensor" in text and "Nothing was lost" in text, text


def test_an_object_marked_unchanging_is_accepted_by_strict_reads(caplog):
    graphstep.unchanging(hc.OPAQUE)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = side_by_side(hc.opaque_factor, {}, steps=6, config=STRICT)
    assert step.stats.captures == 1
    assert "no guard watches" not in caplog.text
    if hc.OmegaConf is not None:  # a config marked so is compared by identity: not read on any replay
        assert contents.walkable(hc.CFG, None)
        assert not contents.walkable(graphstep.unchanging(hc.CFG), None)


def test_explain_names_what_no_guard_can_watch_with_its_line():
    _, (_, _, step) = twins(hc.opaque_factor)
    report = graphstep.explain(step, *batches(1)[0])
    line = inspect.getsourcelines(hc.opaque_factor)[1] + 1
    found = [h for h in report.hazards if "OPAQUE" in h]
    assert len(found) == 1, report.hazards
    assert f"helpers_configs.py:{line} in opaque_factor" in found[0] and "strict_reads" in found[0], found


def test_strict_reads_must_be_a_bool():
    with pytest.raises(ValueError, match="strict_reads"):
        graphstep.Config(strict_reads="yes")


class Fresh(collections.abc.Mapping):
    """A mapping that builds a new list on every read."""

    def __getitem__(self, key):
        return [1.0]

    def __iter__(self):
        return iter(["a"])

    def __len__(self):
        return 1


def test_a_read_that_builds_a_new_object_each_time_holds_by_value():
    """Its identity check fails on every replay; the root is walked again, found equal, and holds
    (without checking itself again in a loop)."""
    guard = contents.Contents()
    fresh = Fresh()
    assert guard.add("FRESH", fresh)
    assert guard.holds() and guard.holds() and not guard.changes()
    identity = fastcheck.identity_check(guard.identities(), MISSING)
    assert identity is None or not identity.holds()  # the C++ pass gives way to the Python path


def test_graphstep_imports_no_config_library():
    code = "import sys, graphstep; print([m for m in ('omegaconf', 'ml_collections', 'pydantic', 'attrs') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
