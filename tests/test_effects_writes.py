"""Writes to Python state that outlives the call are refused at capture, with the line, and undone.

Each kind of write (an attribute in forward, a global, a closure variable, a list append, an item of a
config dict, a module's attribute, a SimpleNamespace field) is refused at capture; the model, optimizer
and the Python state are as an eager run of the calls that succeeded left them; and the same step
rewritten the way the error says (a buffer and `add_`, the value returned) is bitwise equal to eager
over 30 steps, the Python state included. Writes to objects the step makes, writes libraries make, and
writes in eager segments are not refused; `print` and `logging` get one warning.
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import os
import subprocess
import sys
import types
import weakref

import pytest
import torch

import graphstep
from cpu_common import (
    TinyNet,
    batches,
    each_tracer,  # noqa: F401  (each test under each tracer this Python has)
    same_params,
)
from graphstep.errors import CaptureError, PythonWriteError

STEPS = 30
RECORDING = graphstep.Config(backend="recording", warmup_steps=2, graph_breaks="off")  # refusals, not breaks

CALLS = 0
CALLS_T = torch.zeros((), dtype=torch.long)
SETTINGS = types.ModuleType("settings")  # a module whose attribute the step writes
SETTINGS.STEP = 0


def line_of(fn, marker: str) -> str:
    """`file:line` of the line of `fn`'s source that contains `marker`."""
    lines, first = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{inspect.getsourcefile(fn)}:{first + offset}"


class Counting(TinyNet):
    """Counts its forwards in a Python int and ramps its output with it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B, 1)
        self.seen += 1  # write: seen
        return super().forward(x) * (1.0 + 0.01 * min(self.seen, 10))


class CountingBuffer(TinyNet):
    """`Counting` as the error says: the counter is a buffer updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B, 1)
        self.seen.add_(1)
        return super().forward(x) * (1.0 + 0.01 * self.seen.clamp(max=10))


def make(model_cls=TinyNet):
    torch.manual_seed(0)
    model = model_cls()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, opt, scale=None):
    def step(x, y):
        out = model(x)
        loss = torch.nn.functional.mse_loss(out * scale() if scale else out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def twins(model_cls, make_step, config=RECORDING):
    """(eager model, opt, step), (graphed model, opt, captured step), identical at the start."""
    model, opt = make(model_cls)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    captured = graphstep.capture(make_step(twin, twin_opt), model=twin, optimizer=twin_opt, config=config)
    return (model, opt, make_step(model, opt)), (twin, twin_opt, captured)


def refused(model_cls, make_step, state):
    """Warm up twice, then the capture must refuse; returns the error's text. `state(model)`: the
    Python state the step writes, which must be as after two eager steps."""
    (model, opt, eager), (twin, twin_opt, captured) = twins(model_cls, make_step)
    data = batches(3)
    torch.manual_seed(7)  # dropout draws from the CPU generator: both runs start from one seed
    for x, y in data[:2]:
        eager(x, y)
    torch.manual_seed(7)
    for x, y in data[:2]:
        captured(x, y)
    before = state(twin)
    with pytest.raises(PythonWriteError) as info:
        captured(*data[2])
    assert isinstance(info.value, CaptureError)
    assert state(twin) == before == state(model), "the Python state written was put back"
    assert same_params(model, twin), "the failed capture left the parameters as two eager steps did"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], twin_opt.state[q]["momentum_buffer"])
    text = str(info.value)
    assert "replay" in text and "Nothing was lost" in text and "add_" in text, text
    return text


def equal_over_steps(model_cls, make_step, *, outside=None):
    """30 steps eager and captured: bitwise equal losses and parameters. `outside(loss)`: what the
    caller does with each returned loss (both runs)."""
    (model, _, eager), (twin, _, captured) = twins(model_cls, make_step)
    losses = {}
    for name, m, step in (("eager", model, eager), ("graphed", twin, captured)):
        torch.manual_seed(7)  # dropout draws from the CPU generator: both runs start from one seed
        losses[name] = [step(x, y) for x, y in batches(STEPS)]
        for loss in losses[name] if outside is not None else ():
            outside(m, loss)
    assert all(torch.equal(a, b) for a, b in zip(losses["eager"], losses["graphed"]))
    assert same_params(model, twin)
    assert captured.stats.captures == 1 and captured.stats.replays == STEPS - 3  # 2 warm-ups, 1 capture
    return model, twin


# -- each kind of write ------------------------------------------------------------------------------


def test_an_attribute_counter_in_forward_is_refused_and_a_buffer_is_equal_to_eager():
    text = refused(Counting, train, lambda m: m.seen)
    assert line_of(Counting.forward, "write: seen") in text, text
    assert "attribute 'seen' of a Counting module: 2 -> 3" in text, text
    eager, graphed = equal_over_steps(CountingBuffer, train)
    assert torch.equal(eager.seen, graphed.seen) and int(graphed.seen) == STEPS
    counted, _ = make(Counting)
    for x, _ in batches(STEPS):
        counted(x)
    assert counted.seen == int(graphed.seen)  # the buffer counts what the Python int counted eagerly


def test_a_global_counter_is_refused_and_a_global_tensor_counter_is_equal_to_eager():
    global CALLS

    def counting(model, opt):
        step = train(model, opt)

        def counted(x, y):
            global CALLS
            CALLS += 1  # write: global
            return step(x, y)

        return counted

    CALLS = 0
    text = refused(TinyNet, counting, lambda m: CALLS)
    assert line_of(counting, "write: global") in text and "global 'CALLS'" in text, text
    assert CALLS == 4  # two warm-ups, each run eagerly and by the captured step

    def counting_t(model, opt):
        step = train(model, opt)

        def counted(x, y):
            CALLS_T.add_(1)
            return step(x, y)

        return counted

    CALLS_T.zero_()
    equal_over_steps(TinyNet, counting_t)
    assert int(CALLS_T) == 2 * STEPS  # each of the twins counted every step


def test_a_closure_counter_is_refused():
    def counting(model, opt):
        step, calls = train(model, opt), 0

        def counted(x, y):
            nonlocal calls
            calls += 1  # write: cell
            return step(x, y)

        counted.calls = lambda: calls
        return counted

    made = []

    def tracked(model, opt):
        made.append(counting(model, opt))
        return made[-1]

    text = refused(TinyNet, tracked, lambda m: [f.calls() for f in made])
    assert line_of(counting, "write: cell") in text and "closure variable 'calls'" in text, text


def test_a_history_appended_in_the_step_is_refused_and_returning_the_value_is_equal_to_eager():
    def appending(model, opt):
        step = train(model, opt)

        def remembered(x, y):
            loss = step(x, y)
            model.history.append(loss.detach())  # write: append
            return loss

        return remembered

    text = refused(Counting, appending, lambda m: len(m.history))
    assert (
        line_of(appending, "write: append") in text and "`model.history.append(...)` changes a list" in text
    ), text
    eager, graphed = equal_over_steps(
        Counting, appending_outside, outside=lambda m, loss: m.history.append(loss)
    )
    assert len(graphed.history) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(eager.history, graphed.history))


def appending_outside(model, opt):
    """The step of the test above as the error says: the value returned, appended by the caller."""
    model.seen = 0  # Counting's forward writes it: keep it out of the step by freezing the ramp
    model.forward = types.MethodType(TinyNet.forward, model)
    return train(model, opt)


def test_an_item_of_a_config_dict_set_in_the_step_is_refused_and_a_tensor_in_it_is_equal_to_eager():
    def annealing(model, opt, cfg):
        def step(x, y):
            cfg["beta"] = min(1.0, cfg["beta"] + 0.1)  # write: setitem
            return train(model, opt, scale=lambda: cfg["beta"])(x, y)

        return step

    configs = []

    def with_config(model, opt):
        configs.append({"beta": 0.0})
        return annealing(model, opt, configs[-1])

    text = refused(TinyNet, with_config, lambda m: [c["beta"] for c in configs])
    assert line_of(annealing, "write: setitem") in text and "cfg['beta']" in text, text

    def annealing_t(model, opt):
        cfg = {"beta": torch.zeros(())}
        configs.append(cfg)

        def step(x, y):
            cfg["beta"].add_(0.1).clamp_(max=1.0)
            return train(model, opt, scale=lambda: cfg["beta"])(x, y)

        return step

    configs.clear()
    equal_over_steps(TinyNet, annealing_t)
    assert torch.equal(configs[0]["beta"], configs[1]["beta"]) and float(configs[1]["beta"]) == 1.0


def test_a_module_attribute_and_a_namespace_field_written_in_the_step_are_refused():
    def stepping(model, opt):
        step = train(model, opt)
        cfg = types.SimpleNamespace(loss=types.SimpleNamespace(weight=1.0))

        def counted(x, y):
            SETTINGS.STEP += 1  # write: module
            cfg.loss.weight = cfg.loss.weight * 0.5  # write: namespace
            return step(x, y) * cfg.loss.weight

        return counted

    SETTINGS.STEP = 0
    text = refused(TinyNet, stepping, lambda m: SETTINGS.STEP)
    assert line_of(stepping, "write: module") in text and "of module settings" in text, text
    assert line_of(stepping, "write: namespace") in text and "`cfg.loss.weight`" in text, text


def test_writes_to_objects_the_step_makes_are_fine():
    def building(model, opt):
        step = train(model, opt)

        def built(x, y):
            parts, metrics, note = [], {}, types.SimpleNamespace(scale=1.0)
            parts.append(x)
            metrics["loss"] = step(torch.cat(parts), y)
            metrics.update(double=metrics["loss"] * 2)
            note.scale = 0.5
            return metrics["double"] * note.scale

        return built

    equal_over_steps(TinyNet, building)


@pytest.mark.parametrize("by_generation", [True, False])
def test_the_census_knows_what_existed(by_generation, monkeypatch):
    """What decides whether a write is refused: the census taken as a capture begins, read from the
    collector's generations or (where they cannot tell) from a set of every object's id."""
    from graphstep.effects import values

    if not by_generation:  # as where the younger generations are not empty after the collection
        monkeypatch.setattr(values, "_YOUNG_AFTER_COLLECTING", 0)

    class Thing:
        pass

    old, tensor, numbers = Thing(), torch.ones(3), {"lr": 0.1}  # a dict of numbers: not tracked
    holder, gone, asked = Thing(), Thing(), [Thing()]  # (in a list: no frame's locals hold it)
    holder.numbers = numbers
    dropped_tensor = weakref.ref(tensor)
    census = values.Census()
    try:
        assert census._by_generation == by_generation
        new, new_numbers = Thing(), {"lr": 0.2}
        assert census.existed(old) and census.existed(holder) and not census.existed(new)
        assert census.existed(numbers) and not census.existed(numbers, thorough=False)
        assert not census.existed(new_numbers)
        assert not census.existed(tensor), "tensors are left out"
        assert census.existed(asked[0])
        asked.clear()
        del tensor, gone
        assert dropped_tensor() is None, "a tensor dropped while the step runs frees its memory"
        # These may take the address of `gone`, never that of the one `asked` held.
        made = [Thing() for _ in range(2000)]
        assert not any(census.existed(m) for m in made)
        gc.collect()  # moves what the step made into the oldest generation
        later = Thing()
        assert not any(census.existed(m) for m in made) and not census.existed(later)
        assert census.existed(old) and census.existed(holder)
    finally:
        census.drop()
    assert census.existed(new), "a dropped census refuses nothing"
    assert not any(cb.__self__ is census for cb in gc.callbacks if hasattr(cb, "__self__"))


FINALIZED: dict[str, int] = {}


def _finalized(name: str) -> None:
    FINALIZED[name] = FINALIZED.get(name, 0) + 1  # a write to a global dict, by a finalizer


def test_a_finalizer_of_an_object_made_before_the_capture_may_run_during_it():
    """An object that existed before the capture may die while it runs (the census does not hold it),
    and its `weakref.finalize` runs there: code the interpreter runs on its own, not the step's (as
    graphstep's own module guards, whose finalizer took them off a registry), so its writes are not
    refused. The object here is garbage in a reference cycle that the step's `gc.collect()` frees."""

    class Cyclic:
        pass

    model, opt = make()
    fit = train(model, opt)

    def step(x, y):
        gc.collect()
        return fit(x, y)

    captured = graphstep.capture(step, model=model, optimizer=opt, config=RECORDING)
    FINALIZED.clear()
    for i, (x, y) in enumerate(batches(4)):
        if i == RECORDING.warmup_steps:  # the capture: garbage the census's young collection leaves
            cyclic = Cyclic()
            cyclic.me = cyclic
            weakref.finalize(cyclic, _finalized, "cyclic")
            gc.collect()  # into the oldest generation, still alive
            del cyclic
        captured(x, y)
    assert captured.stats.captures == 1 and FINALIZED == {"cyclic": 1}


def test_writes_libraries_make_in_every_forward_are_not_the_users():
    # spectral_norm's forward pre-hook assigns `module.weight` on every call: torch's bookkeeping.
    def normed() -> torch.nn.Module:
        model = TinyNet()
        torch.nn.utils.spectral_norm(model.fc1)
        return model

    equal_over_steps(normed, train)


def test_an_eager_segment_may_write_python_state():
    seen = []

    @graphstep.eager_segment
    def note(loss):
        seen.append(loss.clone())  # runs on every replay too
        return None

    def noting(model, opt):
        step = train(model, opt)

        def noted(x, y):
            loss = step(x, y)
            note(loss.detach())
            return loss

        return noted

    equal_over_steps(TinyNet, noting)
    assert len(seen) == 2 * STEPS


def test_allowed_writes_happen_at_capture_only():
    config = graphstep.Config(backend="recording", warmup_steps=2, allow_python_writes=True)
    (model, _, eager), (twin, _, captured) = twins(Counting, train, config)
    for x, y in batches(6):
        eager(x, y)
    for x, y in batches(6):
        captured(x, y)
    assert model.seen == 6 and twin.seen == 3  # two warm-ups and the capture
    with pytest.raises(ValueError, match="allow_python_writes"):
        graphstep.Config(allow_python_writes="yes")


def test_print_and_logging_in_the_step_warn_once_at_capture(caplog):
    user_log = logging.getLogger("user_training")

    def chatty(model, opt):
        step = train(model, opt)

        def said(x, y):
            print("stepping")  # print here
            user_log.info("step")  # logging here
            return step(x, y)

        return said

    with caplog.at_level(logging.WARNING, logger="graphstep"):
        equal_over_steps(TinyNet, chatty)
    warnings = [r for r in caplog.records if "prints or logs" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    text = warnings[0].getMessage()
    assert line_of(chatty, "print here") in text and line_of(chatty, "logging here") in text, text


def test_tracers_installed_before_are_chained_and_put_back():
    traced, profiled = set(), set()

    def tracer(frame, event, arg):
        traced.add(frame.f_code.co_name)
        return None

    def profiler(frame, event, arg):
        profiled.add(frame.f_code.co_name)

    model, opt = make(Counting)
    captured = graphstep.capture(train(model, opt), model=model, optimizer=opt, config=RECORDING)
    x, y = batches(1)[0]
    captured(x, y)
    captured(x, y)
    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        with pytest.raises(PythonWriteError):
            captured(x, y)
        assert sys.gettrace() is tracer and sys.getprofile() is profiler
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    assert "forward" in traced and "forward" in profiled, "the watchers before graphstep's saw the step"
    assert model.seen == 2


FIRST_TRACE = """
import types
from graphstep.effects.writes import WriteWatch
from graphstep.errors import PythonWriteError

PROGRESS = types.SimpleNamespace(steps=0)

def step():
    PROGRESS.steps += 1

try:
    with WriteWatch("step"):
        step()
except PythonWriteError:
    assert PROGRESS.steps == 0
    print("refused")
"""


def test_the_first_watch_of_a_process_sees_the_steps_writes(tmp_path):
    # Python 3.12 delivers opcode events to a process's first tracer only if asked for before it.
    script = tmp_path / "first_trace.py"
    script.write_text(FIRST_TRACE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "refused", done.stdout + done.stderr


def write_watch_on() -> bool:
    """Whether graphstep's write watch traces this thread now, with either tracer."""
    monitoring = getattr(sys, "monitoring", None)
    named = monitoring is not None and any(
        monitoring.get_tool(tool) == "graphstep write watch" for tool in range(6)
    )
    return sys.gettrace() is not None or named


class _Entry:
    """What a registry makes the first time it is asked (torch's operator registry does: an entry whose
    `__init__` sets its attributes), held where the write watch does not look (set with `setattr`)."""

    def __init__(self) -> None:
        self.rules = {}


def test_allowed_writes_keep_what_a_failed_capture_made_and_something_still_holds():
    """With writes allowed, a capture that a graph break stops is taken back: the writes to objects that
    existed before it, and only those. An object the capture made and something still holds keeps its
    attributes (without a census every write looked old: a torch operator entry made during such a
    capture lost `torch_dispatch_rules`, and the next capture failed)."""

    from break_models import MoENet

    torch.manual_seed(0)
    model = MoENet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    registry = type("Registry", (), {})()

    def step(x, y):
        if write_watch_on() and not hasattr(registry, "entry"):  # first made while watched
            setattr(registry, "entry", _Entry())  # noqa: B010 (a write the watch does not see, as a registry in C)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    config = graphstep.Config(
        backend="recording", warmup_steps=2, optimizer_mode="graph", allow_python_writes=True
    )
    captured = graphstep.capture(step, model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        captured(torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 1, generator=g))
    assert captured.stats.graph_breaks == 1 and captured.stats.captures == 1, captured.stats
    assert registry.entry.rules == {}
