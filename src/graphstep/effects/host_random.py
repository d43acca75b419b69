"""Random numbers drawn on the host inside a captured step: seen at capture and refused.

A CUDA graph replays kernels. A number drawn on the host while the step is captured (Python's
`random`, NumPy, a CPU `torch.Generator`, torch's default one included: `torch.rand([])` without a
device) becomes a constant of the graph, or picks a Python branch that every replay then takes;
the generator stops advancing. CUDA generators are fine: a graph advances them on every replay.
`HostRandomWatch` watches the capturing call:

- Python's `random` (any `random.Random`): its C methods, seen by a profile function
  (`sys.setprofile`, chained to the one installed before and restored after), with the caller;
- NumPy's global generator: its module functions (`np.random.beta`, ...) are wrapped for the
  capture, since a profiler does not see Cython methods;
- torch generators: around each call of a torch function whose name says it draws (`rand`,
  `normal_`, `bernoulli`, `dropout`, ...) the profile function compares the states of the CPU
  generators in reach: the default one, those in the caller's locals and its `self`'s attributes,
  those the step was handed or holds in its closure and globals;
- on the recording backend, where CPU tensors stand for device tensors and torch's default CPU
  generator for the device's, a dispatch mode sees a coin drawn on the device and read on the host
  (`if torch.rand([]) < p:`), which a GPU would refuse as a host sync;
- finally every generator above is compared with its state before the call, which catches draws
  the finer watches miss (a NumPy `Generator` object, another thread), without a line.

The error names the generator, the user's line, and the fix for the pattern seen. Every
generator the watch saw is put back as it was when the capture fails, like the rest of the state.
Warm-up calls are eager and may draw freely; so may eager segments, which run on every replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from ..backends.segments import Splitter
from ..diagnostics import host_sync_ops, log
from ..errors import HostRandomError
from ..guards.compiling import unseen
from ..guards.reads import is_user_file
from ..state import op_tensors
from . import draw_advice
from .draw_advice import Draw

_PYTHON = "Python's `random`"
_NUMPY = "NumPy's global generator (`np.random`)"
_TORCH_CPU = "torch's default CPU generator"
_COIN = "torch's default generator (a draw on the device, read on the host)"

_DRAWING_WORDS = (
    "rand", "normal", "bernoulli", "multinomial", "dropout", "uniform", "exponential",
    "geometric", "cauchy", "poisson", "gamma", "dirichlet", "binomial", "rrelu",
)  # fmt: skip
_PYTHON_DRAWS = frozenset({"random", "getrandbits", "randbytes"})
_NUMPY_NOT_DRAWS = frozenset({"seed", "get_state", "set_state", "get_bit_generator", "set_bit_generator"})


@functools.lru_cache(maxsize=2048)
def _draws(name: str) -> bool:
    """A torch function of this name may draw from a generator (checked, not assumed)."""
    return any(word in name for word in _DRAWING_WORDS)


class HostRandomWatch:
    """`with HostRandomWatch(name, "cuda") as watch: step(...)`; then `watch.draws`.

    `graph_device`: where the graph's kernels run ("cuda"; "cpu" for the recording backend), whose
    default generator the graph advances. `reach`: (label, object) pairs the step holds (its
    arguments, closure, globals); the generators among them are watched too. `refuse`: raise a
    `HostRandomError` when the call ends with draws (a capture), or only note them (explain).
    `restore`: put every watched generator back afterwards even without an error (a dry run).
    `executes`: the capture performs the step (recording): its own draws stand; otherwise (CUDA)
    the replay that follows makes them, so draws to redo are taken back first.
    """

    def __init__(
        self,
        name: str,
        graph_device: str,
        reach: Iterable[tuple[str, Any]] = (),
        *,
        refuse: bool = True,
        restore: bool = False,
        executes: bool = True,
    ):
        self.name = name
        self.graph_device = graph_device
        self.refuse = refuse
        self.restore = restore
        self.executes = executes
        self._redo: list[_Tracked] = []
        """One entry per draw whose value the step ignores, to redo after each replay."""
        self.draws: list[Draw] = []
        self._reach = list(reach)
        self._tracked: dict[int, _Tracked] = {}
        self._pending: list[tuple[Any, types.FrameType, list[tuple[_Tracked, Any]]]] = []
        self._paused = 0
        self._thread = threading.get_ident()
        self._previous: Any = None
        self._chain: Callable | None = None
        self._profiling = False
        self._patched: list[tuple[dict, str, Any]] = []
        self._coins: _CoinWatch | None = None

    # -- entering and leaving -------------------------------------------------------------------

    def __enter__(self) -> HostRandomWatch:
        self._track(random._inst, _PYTHON)  # the generator behind random.random()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            self._track(numpy.random.mtrand._rand, _NUMPY)
        self._track(torch.default_generator, _TORCH_CPU)
        for where, obj in self._reach:
            self._track(obj, _kind(obj, where))
        self._previous = sys.getprofile()
        if self._previous is None or callable(self._previous):  # a C profiler (cProfile) is left alone
            # (A profile function, on Python 3.12 too: sys.monitoring's CALL events reach Python for
            # every call, Python functions' included, at no less cost; benchmarks/tracer_cost.py.)
            self._chain = self._previous
            sys.setprofile(unseen(self._profile))  # called inside compiled models too: not to be compiled
            self._profiling = True
        if numpy is not None:
            self._wrap_numpy(numpy)
        if self.graph_device == "cpu":
            self._coins = _CoinWatch(self)
            self._coins.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._coins is not None:
            self._coins.__exit__(exc_type, exc, tb)
        for namespace, name, original in reversed(self._patched):
            namespace[name] = original
        self._patched.clear()
        self._pending.clear()
        if self._profiling:
            sys.setprofile(self._previous)
            self._profiling = False
        self._compare_all()
        failed = exc_type is not None or (self.refuse and self.draws)
        if failed or self.restore:
            for tracked in self._tracked.values():
                tracked.put_back()
        elif self._redo and not self.executes:
            for tracked in {id(t): t for t in self._redo}.values():
                tracked.put_back()
        if exc_type is None and self.refuse and self.draws:
            raise self.error()

    def pausing(self, splitter: Splitter) -> Splitter:
        """`splitter` with the watch paused while an eager segment runs: a segment runs on every
        replay, so it may draw."""

        def end_part() -> None:
            self._compare_all()
            self._paused += 1
            splitter.end_part()

        def begin_part() -> None:
            splitter.begin_part()
            self._paused -= 1
            for tracked in self._tracked.values():
                tracked.mark = tracked.fingerprint()

        return dataclasses.replace(splitter, end_part=end_part, begin_part=begin_part)

    def error(self) -> HostRandomError:
        return HostRandomError(draw_advice.refusal_message(self.name, self.draws))

    # -- what is watched ------------------------------------------------------------------------

    def _track(self, obj: Any, label: str) -> _Tracked | None:
        """Watch `obj` if it is a host generator, keeping its state as it is now (before any draw
        this call makes from it)."""
        tracked = self._tracked.get(id(obj))
        if tracked is not None:
            return tracked
        if isinstance(obj, torch.Generator) and self._graph_safe(obj):
            return None
        tracked = _Tracked.of(obj, label)
        if tracked is not None:
            self._tracked[id(obj)] = tracked
        return tracked

    def _graph_safe(self, generator: torch.Generator) -> bool:
        if self.graph_device == "cuda":  # advanced on replay, or refused by the capture itself
            return generator.device.type == "cuda"
        return generator is torch.default_generator  # the recording backend's "device" generator

    def _note(self, generator: str, frame: types.FrameType | None, pattern: str | None = None) -> None:
        self._add(draw_advice.draw_at(generator, frame, pattern))

    def _add(self, draw: Draw) -> None:
        if all((d.generator, d.site) != (draw.generator, draw.site) for d in self.draws):
            self.draws.append(draw)

    def _compare_all(self) -> None:
        for tracked in self._tracked.values():
            now = tracked.fingerprint()
            if now != tracked.mark:
                tracked.mark = now
                if all(d.generator != tracked.label for d in self.draws):
                    self.draws.append(Draw(tracked.label, None))

    # -- the profile function -------------------------------------------------------------------

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self._chain is not None:
            self._chain(frame, event, arg)
        if self._paused or event[0] != "c":  # c_call, c_return, c_exception
            return
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, random.Random):
                if arg.__name__ in _PYTHON_DRAWS and self._users_generator(owner, frame):
                    tracked = self._track(owner, _kind(owner, "where Python drew"))
                    self._note(tracked.label, frame)
            elif _draws(arg.__name__) and _is_torch(arg, owner):
                self._pending.append((arg, frame, self._torch_marks(frame)))
        # Equal, not the same: from Python 3.12 a method's c_call and c_return each get a bound
        # method of their own (a builtin method compares its function and `__self__`).
        elif self._pending and self._pending[-1][0] == arg:
            _, caller, marks = self._pending.pop()
            for tracked, before in marks:
                now = tracked.fingerprint()
                if now != before:
                    tracked.mark = now
                    if self._ignored(caller, tracked, before, now):
                        self._redo.append(tracked)
                    else:
                        self._note(tracked.label, caller)

    def _ignored(self, caller: types.FrameType, tracked: _Tracked, before: bytes, now: bytes) -> bool:
        """A draw whose value decides nothing (transformers' LayerDrop at 0) and that one
        `torch.rand([])` reproduces: redone after each replay instead of refused. Not on the
        recording backend, whose replay draws from CPU generators itself."""
        if self.graph_device != "cuda" or not draw_advice.layerdrop_off(caller):
            return False
        generator = tracked.obj
        state = generator.get_state()
        generator.set_state(torch.frombuffer(bytearray(before), dtype=torch.uint8))
        torch.rand([], generator=generator)
        reproduced = _frozen(generator.get_state()) == now
        generator.set_state(state)
        if reproduced and not self._redo:
            log.info(
                "graphstep: %s: %s draws torch.rand([]) on the CPU per layer although LayerDrop is off "
                "(older transformers); the value decides nothing, so each replay draws it again and "
                "the generator advances as in eager.",
                self.name,
                draw_advice.layerdrop_off(caller),
            )
        return reproduced

    def redone_draws(self) -> list[Callable[[], None]]:
        """What a replay must do after the graph: the draws whose values the step ignores."""
        return [functools.partial(_draw_one, t.obj) for t in self._redo]

    def _users_generator(self, owner: random.Random, frame: types.FrameType) -> bool:
        """A draw from the global `random`, from an instance the step holds, or from one the
        user's code calls; not a library's private instance (`tempfile`'s names)."""
        if isinstance(owner, random.SystemRandom):  # the OS's entropy: no state to freeze
            return False
        if owner is random._inst or id(owner) in self._tracked:
            return True
        while frame is not None and frame.f_code.co_filename == random.__file__:
            frame = frame.f_back
        return frame is not None and is_user_file(frame.f_code.co_filename)

    def _torch_marks(self, frame: types.FrameType) -> list[tuple[_Tracked, Any]]:
        """The host torch generators a torch call from `frame` may draw from, with their states."""
        found = list(frame.f_locals.items())
        owner = frame.f_locals.get("self")
        if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
            found += [(f"self.{k}", v) for k, v in vars(owner).items()]
        for name, value in found:
            if isinstance(value, torch.Generator):
                self._track(value, _kind(value, f"{name!r} where torch drew"))
        return [(t, t.fingerprint()) for t in self._tracked.values() if isinstance(t.obj, torch.Generator)]

    def _wrap_numpy(self, numpy: Any) -> None:
        namespace = vars(numpy.random)
        global_generator = numpy.random.mtrand._rand
        for name, fn in list(namespace.items()):
            if getattr(fn, "__self__", None) is global_generator and name not in _NUMPY_NOT_DRAWS:
                self._patched.append((namespace, name, fn))
                namespace[name] = self._noting(fn)

    def _noting(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def draw(*args: Any, **kwargs: Any) -> Any:
            if not self._paused and threading.get_ident() == self._thread:
                self._note(_NUMPY, sys._getframe(1))
            return fn(*args, **kwargs)

        return draw


@dataclasses.dataclass(eq=False)
class _Tracked:
    """A host generator: how to read and set its state, its state before the call, and the
    state last compared."""

    label: str
    obj: Any
    read: Callable[[], Any]
    write: Callable[[Any], None]
    before: Any = None
    mark: Any = None

    @classmethod
    def of(cls, obj: Any, label: str) -> _Tracked | None:
        numpy = sys.modules.get("numpy")
        if isinstance(obj, torch.Generator):
            tracked = cls(label, obj, obj.get_state, obj.set_state)
        elif isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
            tracked = cls(label, obj, obj.getstate, obj.setstate)
        elif numpy is not None and isinstance(obj, numpy.random.RandomState):
            tracked = cls(label, obj, obj.get_state, obj.set_state)
        elif numpy is not None and isinstance(obj, numpy.random.Generator):
            bits = obj.bit_generator
            tracked = cls(label, obj, lambda: bits.state, lambda s: setattr(bits, "state", s))
        else:
            return None
        tracked.before = tracked.read()
        tracked.mark = _frozen(tracked.before)
        return tracked

    def fingerprint(self) -> Any:
        return _frozen(self.read())

    def put_back(self) -> None:
        self.write(self.before)


def _frozen(state: Any) -> Any:
    """A generator's state as something `==` compares (arrays and tensors as bytes)."""
    if isinstance(state, torch.Tensor):
        with _disable_current_modes():  # not a step's operation: no recording backend sees it
            return state.numpy().tobytes()
    if isinstance(state, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(state.items()))
    if isinstance(state, (tuple, list)):
        return tuple(_frozen(v) for v in state)
    if hasattr(state, "tobytes"):  # a NumPy array
        return state.tobytes()
    return state


def _draw_one(generator: torch.Generator) -> None:
    torch.rand([], generator=generator)


def _kind(obj: Any, where: str) -> str:
    """A generator's label in messages: what it is, and where the step holds it."""
    if isinstance(obj, torch.Generator):
        return f"a {obj.device.type.upper()} torch.Generator ({where})"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} ({where})"


def _is_torch(fn: Any, owner: Any) -> bool:
    if isinstance(owner, torch.Tensor):
        return True
    module = getattr(fn, "__module__", None) or getattr(owner, "__name__", None) or ""
    return isinstance(module, str) and module.startswith("torch")


class _CoinWatch(TorchDispatchMode):
    """The recording backend's view of a device draw read on the host: a value of at most one
    element drawn by a random operation (or computed from such), reaching `.item()`, `if t:` and
    the like. Larger draws (dropout masks) are not coins: a loss read after dropout is a host sync."""

    def __init__(self, watch: HostRandomWatch):
        super().__init__()
        self.watch = watch
        self.coins: dict[int, tuple[torch.Tensor, Draw]] = {}
        """Tensors of at most one element drawn at random, or computed from such, by id."""
        self.syncs = host_sync_ops()

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # torch >= 2.9: compiled frames stay compiled under it
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watch = self.watch
        if watch._paused:
            return func(*args, **kwargs)
        coins = self.coins
        coin = None
        if coins:  # most steps draw no coin: no look at the inputs
            coin = next((coins[id(t)] for t in op_tensors((args, kwargs)) if id(t) in coins), None)
        if coin is not None and func in self.syncs:
            watch._add(coin[1])
            if watch.refuse:
                raise watch.error()
        out = func(*args, **kwargs)
        if coin is not None or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            small = [t for t in op_tensors(out) if t.numel() <= 1]
            if small:  # where it was drawn, taken now: the frame moves on
                draw = coin[1] if coin is not None else draw_advice.draw_at(_COIN, sys._getframe(1), "branch")
                self.coins.update((id(t), (t, draw)) for t in small)
        return out


def reach_of(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Objects the step is handed or holds (arguments, closure cells, globals its code names),
    labelled; the watch keeps the generators among them."""
    found = [("passed in as an argument", v) for v in tree_flatten((args, kwargs))[0]]
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):
                found.append((f"closure variable {name!r}", cell.cell_contents))
        namespace = getattr(fn, "__globals__", {})
        found += [(f"global {name!r}", namespace[name]) for name in code.co_names if name in namespace]
    return found


@contextlib.contextmanager
def refusing(
    name: str, backend: Any, fn: Callable, splitter: Splitter, args: tuple, kwargs: dict, captured: dict
) -> Iterator[Splitter]:
    """Around the capturing call: refuse host draws. Yields the splitter to capture with (the
    watch pauses in eager segments); on success `captured["host_draws"]` holds what each replay
    must redraw. The eager backend runs the step's Python on every call: no watch."""
    if not backend.static_buffers:
        yield splitter
        return
    device = "cuda" if backend.cuda_devices else "cpu"
    with HostRandomWatch(name, device, reach_of(fn, args, kwargs), executes=splitter.executes) as watch:
        yield watch.pausing(splitter)
    captured["host_draws"] = watch.redone_draws()
