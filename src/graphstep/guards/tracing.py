"""How the watches follow the step's frames: the write watch instruction by instruction (`Settrace`,
`Monitoring`: two tracers, one behaviour), the read watch frame by frame (`Starts`).

`effects/writes.py`'s `WriteWatch` is the client of a tracer: for each frame that starts (or resumes) while the watch runs, on
the thread that entered it, it says what the frame is (`Kind`); a frame to trace then gets
`client.opcode(frame, offset)` before each of its instructions and `client.finish(frame)` when it
returns, yields or unwinds; a call into `logging` gets `client.logging_call(frame)`. Frames already
running when the watch began are not traced, nor frames of other threads.

- `Settrace` (every Python): `sys.settrace`, chained to the tracer installed before. On Python 3.12
  `sys.settrace` is built on PEP 669 (`sys.monitoring`) with its events on for *every* code object:
  every line and, once any frame asked for opcode events, every instruction of every frame (torch's
  included) goes through the legacy tracer's C callback, and each code object run is instrumented.
- `Monitoring` (Python >= 3.12): `sys.monitoring` directly, with only PY_START / PY_RESUME / PY_THROW
  (and PY_UNWIND and RAISE, which cannot be local) on globally; a code object the client does not
  trace returns DISABLE and costs nothing more; a code object it traces gets INSTRUCTION, PY_RETURN,
  PY_YIELD and STOP_ITERATION as local events (`set_local_events`), removed when the watch ends. These
  are the events 3.12's `sys.settrace` itself is made of (Python/legacy_tracing.c: "call" from
  PY_START/PY_RESUME/PY_THROW, "return" from PY_RETURN/PY_YIELD/PY_UNWIND, "exception" from
  RAISE/STOP_ITERATION, "opcode" from INSTRUCTION with the instruction's offset), so the client sees
  the same frames, offsets and ends (tests/test_effects_tracing.py runs
  both on one workload and compares them, where the interpreter has both).

`GRAPHSTEP_TRACER=settrace|monitoring` picks one (for the read watch: `sys.setprofile` or `Starts`);
unset: `sys.monitoring` where it is available, the legacy hooks where its tool ids are all taken.
This module imports only the standard library (its test runs on an interpreter without torch).
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, Protocol


class Kind(enum.Enum):
    SKIP = 0
    """Not traced."""
    TRACE = 1
    """Traced: its instructions and its end."""
    LOGGING = 2
    """A `logging` call: the client looks at who called it; not traced."""


class Client(Protocol):
    def frame_kind(self, frame: types.FrameType) -> Kind:
        """Asked once per code object per watch (the answer must depend on the code alone)."""
        ...

    def logging_call(self, frame: types.FrameType) -> None: ...

    def opcode(self, frame: types.FrameType, offset: int) -> None: ...

    def finish(self, frame: types.FrameType) -> None: ...


def available() -> tuple[str, ...]:
    """The tracers this interpreter offers."""
    return ("settrace", "monitoring") if hasattr(sys, "monitoring") else ("settrace",)


def chosen() -> str:
    """`GRAPHSTEP_TRACER` if set (an unknown name, or one this Python lacks, is an error); otherwise
    `monitoring` where available."""
    name = os.environ.get("GRAPHSTEP_TRACER", "").strip().lower()
    if not name:
        return available()[-1]
    if name not in available():
        raise ValueError(
            f"GRAPHSTEP_TRACER={name!r}: this Python ({sys.version.split()[0]}) offers {' or '.join(available())}; "
            "unset it for the default"
        )
    return name


def tracer(client: Client, wrap: Callable[[Callable], Callable] = lambda f: f) -> Settrace | Monitoring:
    """The chosen tracer for `client`, not started. `wrap`: applied to every hook (graphstep keeps
    them out of what torch.compile compiles)."""
    return Monitoring(client, wrap) if chosen() == "monitoring" else Settrace(client, wrap)


def start(client: Client, wrap: Callable[[Callable], Callable] = lambda f: f) -> Settrace | Monitoring | None:
    """The chosen tracer, started; `Settrace` when `sys.monitoring` has no tool id free; None when
    that cannot start either (a C-level tracer is active, which it cannot chain)."""
    chosen_one = tracer(client, wrap)
    if chosen_one.start():
        return chosen_one
    if isinstance(chosen_one, Monitoring):
        fallback = Settrace(client, wrap)
        if fallback.start():
            return fallback
    return None


# -- sys.settrace ------------------------------------------------------------------------------------


class _Local:
    """The local trace function of one traced frame: the client's, then the one installed before."""

    __slots__ = ("client", "hidden", "inner", "inner_opcodes")

    def __init__(self, client: Client, inner: Callable | None, inner_opcodes: bool, wrap: Callable):
        self.client, self.inner, self.inner_opcodes = client, inner, inner_opcodes
        self.hidden = wrap(self)

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Callable:
        if self.inner is not None and (event != "opcode" or self.inner_opcodes):
            self.inner = self.inner(frame, event, arg)
        if event == "opcode":
            self.client.opcode(frame, frame.f_lasti)
        elif event in ("return", "exception"):
            self.client.finish(frame)
        return self.hidden


class Settrace:
    """`sys.settrace` on the calling thread, chained to the tracer installed before (local tracers
    included) and put back after."""

    name = "settrace"

    def __init__(self, client: Client, wrap: Callable[[Callable], Callable] = lambda f: f):
        self.client, self.wrap = client, wrap
        self._previous: Any = None
        self._kinds: dict[types.CodeType, Kind] = {}

    def start(self) -> bool:
        """False (and nothing installed) when a C-level tracer is active: it cannot be chained."""
        self._previous = sys.gettrace()
        if self._previous is not None and not callable(self._previous):
            return False
        _ask_for_opcode_events()
        sys.settrace(self.wrap(self._trace))
        return True

    def stop(self) -> None:
        sys.settrace(self._previous)

    def _trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        inner = self._previous(frame, event, arg) if self._previous is not None else None
        code = frame.f_code
        kind = self._kinds.get(code)
        if kind is None:  # one question per code object, as `Monitoring` asks
            kind = self._kinds[code] = self.client.frame_kind(frame)
        if kind is Kind.LOGGING:
            self.client.logging_call(frame)
        if kind is not Kind.TRACE:
            return inner
        inner_opcodes = inner is not None and frame.f_trace_opcodes
        local = _Local(self.client, inner, inner_opcodes, self.wrap).hidden
        # f_trace first: Python 3.12 turns opcode events on only for a frame that has its tracer.
        frame.f_trace = local
        frame.f_trace_opcodes = True
        return local


def _ask_for_opcode_events() -> None:
    """Python 3.12 turns opcode events on when a tracer is installed only if some frame of the
    process asked for them before (a flag that stays set): ask once, so that the first capture of a
    process is watched too."""
    here = sys._getframe()
    asked = here.f_trace_opcodes
    here.f_trace_opcodes = True
    here.f_trace_opcodes = asked
    del here  # a frame holding itself is a cycle: its callers' locals would live until a collection


# -- sys.monitoring (Python >= 3.12) -----------------------------------------------------------------

_TOOL_IDS = (4, 3)
"""Tool ids no standard tool claims (0 debugger, 1 coverage, 2 profiler, 5 optimizer); a capture
holds both (reads, then writes)."""


def _install(name: str, hooks: tuple[tuple[int, Callable], ...], events: int) -> int | None:
    """Hold the first of graphstep's `sys.monitoring` tool ids no tool holds, as `name`, with `hooks`
    registered and `events` on everywhere; None (nothing installed) when other tools hold them all."""
    monitoring = sys.monitoring
    tool = next((t for t in _TOOL_IDS if monitoring.get_tool(t) is None), None)
    if tool is None:
        return None
    monitoring.use_tool_id(tool, name)
    for event, hook in hooks:
        monitoring.register_callback(tool, event, hook)
    # A DISABLE returned in an earlier watch stays until restart_events: start afresh, or a code object
    # judged then would not be seen now.
    monitoring.restart_events()
    monitoring.set_events(tool, events)
    return tool


def _uninstall(tool: int, hooks: tuple[tuple[int, Callable], ...]) -> None:
    """Undo `_install(..., hooks, ...)` once the caller turned `tool`'s events off (before calling any
    Python function, this one included: its start would be seen)."""
    monitoring = sys.monitoring
    for event, _ in hooks:
        monitoring.register_callback(tool, event, None)
    monitoring.free_tool_id(tool)


class _Tool:
    """A `sys.monitoring` tool id held while a watch is on: its hooks, as registered, and the thread it
    watches. (Each watch's `stop` turns the events off itself, before it calls any Python.)"""

    def __init__(self, wrap: Callable[[Callable], Callable]):
        self.wrap = wrap
        self._tool: int | None = None
        self._installed: tuple[tuple[int, Callable], ...] = ()
        """The hooks registered (wrapped), as `_install` took them."""
        self._thread = 0

    def _hooks(self) -> tuple[tuple[int, Callable], ...]:
        raise NotImplementedError

    def _install_as(self, name: str, events: int) -> bool:
        """False when no tool id is free (another tool holds them): nothing installed."""
        self._installed = tuple((event, self.wrap(hook)) for event, hook in self._hooks())
        self._thread = threading.get_ident()
        self._tool = _install(name, self._installed, events)
        return self._tool is not None


class Monitoring(_Tool):
    """PEP 669 events on the code objects the client traces only (see the module's docstring)."""

    name = "monitoring"

    def __init__(self, client: Client, wrap: Callable[[Callable], Callable] = lambda f: f):
        super().__init__(wrap)
        self.client = client
        self._kinds: dict[types.CodeType, Kind] = {}
        self._frames: dict[types.FrameType, None] = {}
        """Traced frames that started or resumed during the watch, running now."""
        self._local: list[types.CodeType] = []
        """Code objects given local events (taken off at the end)."""

    def start(self) -> bool:
        events = sys.monitoring.events
        everywhere = events.PY_START | events.PY_RESUME | events.PY_THROW | events.PY_UNWIND | events.RAISE
        return self._install_as("graphstep write watch", everywhere)

    def _hooks(self) -> tuple[tuple[int, Callable], ...]:
        events = sys.monitoring.events
        return (
            (events.PY_START, self._start),
            (events.PY_RESUME, self._start),
            (events.PY_THROW, self._thrown),
            (events.INSTRUCTION, self._instruction),
            (events.PY_RETURN, self._end),
            (events.PY_YIELD, self._end),
            (events.PY_UNWIND, self._end),
            (events.RAISE, self._raised),
            (events.STOP_ITERATION, self._raised),
        )

    def stop(self) -> None:
        monitoring, tool = sys.monitoring, self._tool
        if tool is None:
            return
        monitoring.set_events(tool, 0)
        for code in self._local:
            monitoring.set_local_events(tool, code, 0)
        _uninstall(tool, self._installed)
        self._tool = None
        self._local.clear()
        self._frames.clear()

    def _start(self, code: types.CodeType, offset: int) -> Any:
        if threading.get_ident() != self._thread:
            return None  # another thread: not DISABLE, which would stop the event for this one too
        return self._began(code, _running(code))

    def _thrown(self, code: types.CodeType, offset: int, exception: BaseException) -> None:
        if threading.get_ident() == self._thread:  # (not a local event: DISABLE is not allowed)
            self._began(code, _running(code))

    def _began(self, code: types.CodeType, frame: types.FrameType) -> Any:
        kind = self._kinds.get(code)
        if kind is None:
            kind = self._kinds[code] = self.client.frame_kind(frame)
            if kind is Kind.TRACE:
                events = sys.monitoring.events
                local = events.INSTRUCTION | events.PY_RETURN | events.PY_YIELD | events.STOP_ITERATION
                sys.monitoring.set_local_events(self._tool, code, local)
                self._local.append(code)
        if kind is Kind.TRACE:
            self._frames[frame] = None
        elif kind is Kind.LOGGING:
            self.client.logging_call(frame)
        else:
            return sys.monitoring.DISABLE
        return None

    def _instruction(self, code: types.CodeType, offset: int) -> None:
        if threading.get_ident() != self._thread:
            return
        frame = _running(code)
        if frame in self._frames:
            self.client.opcode(frame, offset)

    def _end(self, code: types.CodeType, offset: int, value: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        frame = _running(code)
        if self._frames.pop(frame, 0) is None:
            self.client.finish(frame)

    def _raised(self, code: types.CodeType, offset: int, exception: BaseException) -> None:
        """An exception raised in (or passing through) a traced frame: settrace's "exception"
        event, which ends the store in progress (the frame goes on)."""
        if threading.get_ident() == self._thread:
            frame = _running(code)
            if frame in self._frames:
                self.client.finish(frame)


def _running(code: types.CodeType) -> types.FrameType:
    """The frame an event of `code` is about: the innermost of `code` above the hook (one up, unless
    `wrap` put frames of its own between)."""
    frame = sys._getframe(2)
    while frame.f_code is not code:
        frame = frame.f_back
    return frame


# -- frames that start: the read watch's only need -------------------------------------------------


class Starts(_Tool):
    """`on_start(frame)` for each Python frame that starts or resumes on this thread while on: a
    profile function's "call" event, from `sys.monitoring`'s PY_START / PY_RESUME / PY_THROW alone
    (no event per C call, nor per return, as `sys.setprofile` has on every function). `on_start`
    returns False for a code object it never needs to see again (until the next `Starts`): that
    one costs nothing more. Python >= 3.12 (`guards/reads.py` keeps `sys.setprofile` before, or
    when `GRAPHSTEP_TRACER=settrace`)."""

    def __init__(self, on_start: Callable[[types.FrameType], bool], wrap: Callable[[Callable], Callable]):
        super().__init__(wrap)
        self.on_start = on_start

    def _hooks(self) -> tuple[tuple[int, Callable], ...]:
        events = sys.monitoring.events
        return (
            (events.PY_START, self._started),
            (events.PY_RESUME, self._started),
            (events.PY_THROW, self._thrown),
        )

    def start(self) -> bool:
        events = sys.monitoring.events
        return self._install_as("graphstep read watch", events.PY_START | events.PY_RESUME | events.PY_THROW)

    def stop(self) -> None:
        if self._tool is not None:
            sys.monitoring.set_events(self._tool, 0)
            _uninstall(self._tool, self._installed)
            self._tool = None

    def _started(self, code: types.CodeType, offset: int) -> Any:
        if threading.get_ident() != self._thread:
            return None
        return None if self.on_start(_running(code)) else sys.monitoring.DISABLE

    def _thrown(self, code: types.CodeType, offset: int, exception: BaseException) -> None:
        if threading.get_ident() == self._thread:
            self.on_start(_running(code))
