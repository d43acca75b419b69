"""Writes by library code follow the user's rule: where code lives decides nothing.

A module imported from a folder named site-packages (where pip puts packages, and what the user-code
check calls library code) that advances a Python counter in the step is refused at capture, naming
its line and the user's line that led there; a library write of the value already there, or to an
object the step made, is not a change; the packages graphstep trusts are named in one list with a
reason each.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import graphstep
from cpu_common import (
    TinyNet,
    batches,
    each_tracer,  # noqa: F401  (each test under each tracer this Python has)
)
from graphstep.effects import trusted
from graphstep.errors import PythonWriteError
from graphstep.guards.user_code import is_user_file
from test_effects_writes import RECORDING, equal_over_steps, line_of, refused, train, twins

LIBRARY = '''
"""A package as pip would install it: a module wrapper that keeps Python bookkeeping."""
import torch


class Scaled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.mode = "train"
        self.position = 0
        self.last_shapes = []

    def forward(self, x):
        self.mode = "train"  # the same value again: no change
        self.position = 0  # scratch state, left where the last call left it: no net change
        for _ in x.shape:
            self.position += 1
        self.last_shapes = [tuple(x.shape)]  # a fresh object every call: the library's bookkeeping
        made = {}  # an object the call makes: its writes are fine
        made["shape"] = tuple(x.shape)
        if self.counting:
            self.calls += 1  # library write: a counter
        return self.inner(x) * (1.0 + 0.01 * min(self.calls, 10))

    counting = True
'''


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    root = tmp_path_factory.mktemp("env") / "lib" / "python3" / "site-packages"
    root.mkdir(parents=True)
    (root / "scaledlib.py").write_text(textwrap.dedent(LIBRARY))
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("scaledlib")
        assert not is_user_file(module.__file__), "the test's package must count as library code"
        yield module
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("scaledlib", None)


def wrapped(library, counting: bool):
    class Wrapped(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.scaled = library.Scaled(self.fc2)
            self.scaled.counting = counting

        def forward(self, x):
            return self.scaled(self.drop(torch.relu(self.fc1(x))))  # the user's line

    return Wrapped


def test_a_library_counter_is_refused_with_its_line_and_the_users(library):
    model_cls = wrapped(library, counting=True)
    text = refused(model_cls, train, lambda m: m.scaled.calls)
    assert f"{library.__file__}:" in text and "self.calls += 1" in text, text
    assert "library code, reached from" in text and line_of(model_cls.forward, "the user's line") in text, (
        text
    )
    assert "2 -> 3" in text, text


def test_with_graph_breaks_a_library_module_that_counts_runs_eagerly_and_counts_every_call(library):
    model_cls = wrapped(library, counting=True)
    (model, _, eager), (twin, _, captured) = twins(
        model_cls, train, config=graphstep.Config(backend="recording", warmup_steps=2)
    )
    for i, (x, y) in enumerate(batches(6)):
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(want, captured(x, y))
    assert model.scaled.calls == twin.scaled.calls == 6
    assert captured.stats.graph_breaks == 1 and captured.stats.captures == 1


def test_library_writes_leaving_the_same_value_scratch_state_or_new_objects_are_not_changes(library):
    _model, twin = equal_over_steps(wrapped(library, counting=False), train)
    assert twin.scaled.mode == "train" and twin.scaled.calls == 0


def test_the_trusted_list_names_functions_never_a_package():
    assert trusted.reason("torch.nn.modules.module", "Module._call_impl")
    assert trusted.reason("torch.nn.modules.module", "Module._call_impl.<locals>.inner"), "nested code"
    assert trusted.reason("torch.nn.modules.module", "Module.train") is None, "not named: judged"
    assert trusted.reason("torch.optim.lr_scheduler", "LRScheduler.step") is None, "an epoch counter"
    assert trusted.reason("logging", "Logger.isEnabledFor"), "the standard library"
    assert trusted.reason("graphstep.demo.gpt", "GPT.forward") is None
    for module, name in (
        ("timm.optim.lamb", "Lamb.step"),
        ("schedulefree.adamw_schedulefree", "AdamWScheduleFree.step"),
        ("torchmetrics.metric", "Metric.update"),
        ("accelerate.accelerator", "Accelerator._do_sync"),
        ("transformers.trainer", "Trainer.training_step"),
    ):
        assert trusted.reason(module, name) is None, (module, name)
    assert all(len(e.why) > 40 and e.names and "::" in e.test for e in trusted.TRUSTED), "each says why"


def test_a_scheduler_stepped_inside_the_step_is_refused():
    """torch's own LR scheduler advances `last_epoch` in Python: inside the step a replay would never
    advance it again, so the capture refuses it like the user's own counter."""

    def with_schedule(model, opt):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        inner = train(model, opt)

        def step(x, y):
            loss = inner(x, y)
            sched.step()
            return loss

        step.sched = sched
        return step

    (_, _, _eager), (_, _, captured) = twins(TinyNet, with_schedule)
    data = batches(3)
    for x, y in data[:2]:
        captured(x, y)
    with pytest.raises(PythonWriteError, match="last_epoch"):
        captured(*data[2])


CLOSURE_LIBRARY = '''
"""A package whose helper counts its calls in a closure variable."""
import torch


def make_scaler():
    calls = 0

    def scale(x):
        nonlocal calls
        calls += 1  # library write: a closure counter
        return x * (1.0 + 0.01 * min(calls, 10))

    return scale, lambda: calls
'''


def test_a_library_closure_counter_is_refused(tmp_path):
    root = tmp_path / "site-packages"
    root.mkdir()
    (root / "closurelib.py").write_text(textwrap.dedent(CLOSURE_LIBRARY))
    sys.path.insert(0, str(root))
    try:
        closurelib = importlib.import_module("closurelib")

        class Scaled(TinyNet):
            def __init__(self) -> None:
                super().__init__()
                self.scale, self.calls = closurelib.make_scaler()

            def forward(self, x):
                return self.scale(super().forward(x))

        torch.manual_seed(0)
        model = Scaled()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        captured = graphstep.capture(train(model, opt), model=model, optimizer=opt, config=RECORDING)
        data = batches(3)
        for x, y in data[:2]:
            captured(x, y)
        with pytest.raises(PythonWriteError) as info:
            captured(*data[2])
        text = str(info.value)
        assert "closure variable 'calls': 2 -> 3" in text and "calls += 1" in text, text
        assert model.calls() == 2, "the counter was put back as the two warm-ups left it"
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("closurelib", None)
