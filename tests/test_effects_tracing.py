"""The write watch's two tracers (src/graphstep/guards/tracing.py) show a client the same frames,
instruction offsets and ends: `sys.settrace`, and on Python >= 3.12 `sys.monitoring` with events on the
traced code objects only.

tracing.py imports only the standard library and is loaded here by its path, so this file also runs
on an interpreter without torch (the one where `sys.monitoring` exists when the venv's does not):
`python3.12 -m pytest --noconftest -p no:cacheprovider tests/test_effects_tracing.py`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "src" / "graphstep" / "guards" / "tracing.py"
_spec = importlib.util.spec_from_file_location("graphstep_tracing_under_test", _PATH)
tracing = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tracing  # (dataclasses and enum look their module up by name)
_spec.loader.exec_module(tracing)

TRACERS = {"settrace": tracing.Settrace, "monitoring": getattr(tracing, "Monitoring", None)}


class Recorder:
    """A client that traces code named `w_*`, treats `log_it` as a logging call, and notes everything."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def frame_kind(self, frame):
        name = frame.f_code.co_name
        if name.startswith("w_"):
            return tracing.Kind.TRACE
        return tracing.Kind.LOGGING if name == "log_it" else tracing.Kind.SKIP

    def logging_call(self, frame):
        self.events.append(("log", frame.f_back.f_code.co_name))

    def opcode(self, frame, offset):
        assert offset == frame.f_lasti
        self.events.append(("op", frame.f_code.co_name, offset))

    def finish(self, frame):
        self.events.append(("end", frame.f_code.co_name))


class Box:
    pass


def log_it(message):
    return message


def helper(box):  # not traced: SKIP
    box.helper = 1
    return w_leaf(box)


def w_leaf(box):
    box.leaf = 2
    return box.leaf


def w_generator(box):
    box.n = 0
    for i in range(3):
        box.n += i
        yield i


def w_raises(box):
    box.before = 1
    raise KeyError("x")


def w_catches(box):
    try:
        w_raises(box)
    except KeyError:
        box.caught = True
    try:
        box.missing_attribute.x = 1
    except AttributeError:
        box.second = True


def w_recursive(box, depth, tracer):
    if depth == 0:
        tracer.start()  # this frame started before the watch: it is not traced, the frames it calls are
        w_recursive(box, depth + 1, tracer)
        box.outer = "after"  # (its code is traced now: this frame still is not)
        return
    if depth < 3:
        box.depth = depth
        w_recursive(box, depth + 1, tracer)


def w_thrown():
    try:
        yield 1
    except ValueError:
        yield 2


class w_Guarded:
    """Python that torch's and libraries' code is full of: properties, `__setattr__`, context
    managers made from generators, comprehensions, `yield from`, generators closed early."""

    def __init__(self):
        self.items = {}

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)

    @property
    def w_size(self):
        self.seen = True
        return len(self.items)

    @contextlib.contextmanager
    def w_managed(self):
        self.inside = True
        try:
            yield self
        finally:
            self.inside = False


def w_delegating(box):
    box.delegated = yield from w_generator(box)


def w_python_patterns(box):
    guarded = w_Guarded()
    with guarded.w_managed() as inside:
        inside.items["a"] = 1
        box.size = inside.w_size
    box.squares = [i * i for i in range(3)]
    box.pairs = {i: [j for j in range(i)] for i in range(3)}
    box.delegated_items = list(w_delegating(box))
    early = w_generator(box)
    next(early)
    early.close()
    abandoned = w_generator(box)
    next(abandoned)
    del abandoned  # closed by the collector while suspended
    try:
        w_catches(box)
        w_raises(box)
    except KeyError:
        box.outer_caught = True


def w_workload(box, started):
    log_it("hello")
    helper(box)
    items = list(w_generator(box))
    box.items = items
    w_catches(box)
    next(started)  # resumed during the watch, created before: traced from here on
    thrown = w_thrown()
    next(thrown)
    thrown.throw(ValueError())
    w_python_patterns(box)
    other = threading.Thread(target=w_leaf, args=(Box(),))  # another thread: not traced
    other.start()
    other.join()
    return box


def run(tracer_class) -> list[tuple]:
    client = Recorder()
    tracer = tracer_class(client)
    started = w_generator(Box())
    next(started)  # a frame running (suspended) before the watch
    box = Box()
    assert tracer.start()
    try:
        w_workload(box, started)
    finally:
        tracer.stop()
    w_leaf(Box())  # after the watch: not traced
    tracer = tracer_class(client)
    w_recursive(Box(), 0, tracer)  # starts the watch itself
    tracer.stop()
    return client.events


def test_settrace_follows_the_frames_that_start_during_the_watch():
    events = run(tracing.Settrace)
    names = {e[1] for e in events if e[0] == "op"}
    assert names == {
        "w_workload",
        "w_leaf",
        "w_generator",
        "w_catches",
        "w_raises",
        "w_thrown",
        "w_recursive",
        "w_python_patterns",
        "w_size",
        "w_managed",
        "w_delegating",
    }
    assert ("log", "w_workload") in events
    assert events.count(("end", "w_leaf")) == 1  # from helper: not the thread's, not after the watch
    # w_generator: 4 ends (3 yields and the return) of the list's, 1 (a yield) of the one resumed in the watch
    first = events[: next(i for i, e in enumerate(events) if e[1] == "w_python_patterns")]
    assert first.count(("end", "w_generator")) == 5
    assert events.count(("end", "w_recursive")) == 3  # depths 1..3; depth 0 began the watch
    assert sys.gettrace() is None


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python >= 3.12")
def test_monitoring_shows_the_client_what_settrace_shows():
    with_settrace = run(tracing.Settrace)
    with_monitoring = run(tracing.Monitoring)
    assert with_monitoring == with_settrace
    # Nothing left behind: no tool id held, no local events on the traced code.
    assert all(sys.monitoring.get_tool(tool) is None for tool in tracing._TOOL_IDS)
    assert sys.monitoring.get_local_events(0, w_leaf.__code__) == 0


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python >= 3.12")
def test_monitoring_sees_code_disabled_in_an_earlier_watch():
    """A code object skipped in one watch (DISABLE) is judged afresh in the next."""
    first, second = Recorder(), Recorder()
    first.frame_kind = lambda frame: tracing.Kind.SKIP
    tracer = tracing.Monitoring(first)
    assert tracer.start()
    w_leaf(Box())
    tracer.stop()
    tracer = tracing.Monitoring(second)
    assert tracer.start()
    w_leaf(Box())
    tracer.stop()
    assert first.events == [] and ("end", "w_leaf") in second.events


def test_the_tracer_is_chosen_by_graphstep_tracer(monkeypatch):
    monkeypatch.setenv("GRAPHSTEP_TRACER", "settrace")
    assert tracing.chosen() == "settrace"
    assert isinstance(tracing.tracer(Recorder()), tracing.Settrace)
    monkeypatch.delenv("GRAPHSTEP_TRACER")
    assert tracing.chosen() == ("monitoring" if hasattr(sys, "monitoring") else "settrace")
    monkeypatch.setenv("GRAPHSTEP_TRACER", "ptrace")
    with pytest.raises(ValueError, match="GRAPHSTEP_TRACER='ptrace'"):
        tracing.chosen()


def starts_with_setprofile() -> list[str]:
    """The frames a profile function's "call" event names during w_workload (as the read watch sees)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and threading.get_ident() == main:
            seen.append(frame.f_code.co_name)

    main = threading.get_ident()
    started = w_generator(Box())
    next(started)
    sys.setprofile(profile)
    try:
        w_workload(Box(), started)
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python >= 3.12")
def test_starts_sees_the_frames_a_profile_function_sees():
    seen: list[str] = []
    starts = tracing.Starts(lambda frame: seen.append(frame.f_code.co_name) or True, lambda f: f)
    started = w_generator(Box())
    next(started)
    assert starts.start()
    try:
        w_workload(Box(), started)
    finally:
        starts.stop()
    expected = [name for name in starts_with_setprofile() if name not in ("stop",)]
    assert [name for name in seen if name != "stop"] == expected
    assert {"w_workload", "helper", "w_leaf", "w_generator", "w_thrown", "log_it"} <= set(seen)
    assert all(sys.monitoring.get_tool(tool) is None for tool in tracing._TOOL_IDS)


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python >= 3.12")
def test_starts_asks_no_more_about_a_code_object_it_declined():
    seen: list[str] = []
    starts = tracing.Starts(lambda frame: seen.append(frame.f_code.co_name) or False, lambda f: f)
    assert starts.start()
    for _ in range(3):
        w_leaf(Box())
    starts.stop()
    assert seen.count("w_leaf") == 1


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python >= 3.12")
def test_with_every_free_tool_id_taken_the_legacy_tracer_is_used(monkeypatch):
    monkeypatch.delenv("GRAPHSTEP_TRACER", raising=False)
    taken = [tool for tool in tracing._TOOL_IDS if sys.monitoring.get_tool(tool) is None]
    for tool in taken:
        sys.monitoring.use_tool_id(tool, "another tool")
    try:
        client = Recorder()
        started = tracing.start(client)
        assert isinstance(started, tracing.Settrace)
        w_leaf(Box())
        started.stop()
        assert ("end", "w_leaf") in client.events
        assert not tracing.Starts(lambda frame: True, lambda f: f).start()
    finally:
        for tool in taken:
            sys.monitoring.free_tool_id(tool)


def test_start_gives_the_chosen_tracer_started(monkeypatch):
    monkeypatch.delenv("GRAPHSTEP_TRACER", raising=False)
    client = Recorder()
    started = tracing.start(client)
    assert started.name == tracing.chosen()
    w_leaf(Box())
    started.stop()
    assert ("end", "w_leaf") in client.events


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python >= 3.12")
def test_the_watches_of_a_capture_at_once_see_what_each_sees_alone():
    """A capture holds a tool id for the reads (`Starts`) and one for the writes (`Monitoring`),
    entered in that order, and the host random watch's profile function between them: one's DISABLE
    or restart_events must not blind another."""

    def run_all(which: tuple[str, ...]) -> dict[str, list]:
        seen: dict[str, list] = {"starts": [], "calls": [], "writes": []}
        client = Recorder()
        here = w_workload.__code__.co_filename  # (not the frames that start the other hooks)

        def started(frame):
            if frame.f_code.co_filename == here and frame.f_code.co_name != "<lambda>":  # (the wraps)
                seen["starts"].append(frame.f_code.co_name)
            return False

        def profile(frame, event, arg):
            if event.startswith("c_") and frame.f_code.co_filename == here:
                seen["calls"].append((frame.f_code.co_name, event, arg.__name__))

        starts, writes = tracing.Starts(started, lambda f: f), tracing.Monitoring(client, lambda f: f)
        hooks = {
            "starts": (starts.start, starts.stop),
            "calls": (lambda: sys.setprofile(profile) or True, lambda: sys.setprofile(None)),
            "writes": (writes.start, writes.stop),
        }
        begun = [hooks[name] for name in which]
        for start, _ in begun:
            assert start()
        try:
            w_workload(Box(), w_generator(Box()))
        finally:
            for _, stop in reversed(begun):
                stop()
        seen["writes"] = client.events
        return seen

    together = run_all(("starts", "calls", "writes"))
    for name in ("starts", "calls", "writes"):
        alone = run_all((name,))[name]
        if (
            name == "starts"
        ):  # the writes' restart_events asks again about code declined before: the same answers
            together[name], alone = list(dict.fromkeys(together[name])), list(dict.fromkeys(alone))
        if name == "calls":  # the profile function sees the C calls that start and stop the others
            together[name] = [c for c in together[name] if c[0] not in ("run_all", "<lambda>")]
            alone = [c for c in alone if c[0] not in ("run_all", "<lambda>")]
        assert alone and together[name] == alone, name
    assert all(sys.monitoring.get_tool(tool) is None for tool in tracing._TOOL_IDS)
