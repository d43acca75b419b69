"""`RecordingBackend`: a CPU stand-in for a CUDA graph, for tests of everything around capture.

A CUDA graph remembers kernels with their arguments: memory addresses and Python numbers
baked in at capture. This backend gives CPU tests the same semantics. At capture it runs
the step under a dispatch mode that records every ATen operation with its arguments, holding
each tensor through a detached alias (so its *storage* is what is remembered, as a graph
remembers an address). A replay re-runs exactly those operations on exactly that memory,
writing fresh results into the recorded output buffers. Hence the pitfalls of real graphs
show up on a CPU: a parameter whose `.data` was replaced is not updated, a float
learning rate changed by hand is ignored, and a result read with `.item()` or `.tolist()` cannot be
captured.

Capture raises for operations that would synchronise a CUDA stream with the host, as a real
capture does, and undoes the writes the step made before it failed. A tensor whose memory the step
changes (`t.data = other`: DeepSpeed's ZeRO moves each gradient into its bucket so) is recorded on its
memory at each operation, as a graph records addresses, not tensors.

The CPU generator is this stand-in's device generator: a replay's random operations draw from it as
eager's do. A step that saves and restores its state (`torch.get_rng_state()` /
`torch.set_rng_state()`: activation checkpointing's recompute draws the forward's dropout masks again
that way) has those two recorded as operations of the recording too, in their place among the others:
a replay saves the generator's state of that replay into the saved tensor, and restores from the
tensor it restored from. Relative to the replay's own generator, as a CUDA graph's philox offsets are.

A collective or point-to-point operation (`c10d.send`, `c10d.recv_`, `c10d.allreduce_`) returns a work
handle, and the data is only there once the step waits on it (`work.wait()`, which torch.distributed's
Python calls: no operation the recorder sees). Each `wait()` the step makes on such a handle is recorded
as well, in its place: a replay waits on the replayed operation's handle where the step waited, as a
CUDA graph makes its stream wait on NCCL's where the capture did (`_WorkWaits`). Without those waits a
replayed receive would be read before its data arrived.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch

from ..diagnostics import host_sync_of
from ..state import map_op_tensors
from .base import CaptureBody, HostBackend, PartsRecording
from .compiled import MODES_KEEP_COMPILED, no_compiling
from .segments import Splitter
from .undo import UndoLog


class _Recorder(UndoLog):
    """Records operations part by part; between parts (an eager segment runs) it only keeps the
    undo log."""

    stands_in_for_a_capture = True  # what `optim.live` asks a dispatch mode

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch >= 2.9: a torch.compile'd frame runs its compiled code under the recorder, which records
        the operations that code runs (backend "eager" or "aot_eager"; inductor's CPU kernels are not
        operations), as a graph records the kernels; older torch runs such a frame uncompiled."""
        return True

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[list[tuple[Any, tuple, dict, Any]]] = [[]]
        self.paused = False
        self._aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.works: dict[int, tuple[Any, _WorkSlot]] = {}
        """id of a work handle an operation returned -> (the handle, kept alive; its slot in the replay)."""

    def end_part(self) -> None:
        self.paused = True

    def begin_part(self) -> None:
        self.parts.append([])
        self.paused = False

    def alias(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        known = self._aliases.get(id(x))
        if known is None or not _same_memory(known[1], x):
            # Keep `x` itself too, so its id is not reused by another tensor while recording. A tensor
            # whose memory changed since (`x.data = other`, as DeepSpeed's ZeRO moves gradients into its
            # buckets) gets a new alias: a graph records the memory an operation used, not the tensor.
            known = self._aliases[id(x)] = (x, x.detach())
        return known[1]

    def host_op(self, op: Any) -> None:
        """Record `op()` (no arguments, no result) to run at its place in the replay."""
        if not self.paused:
            self.parts[-1].append((op, (), {}, _HOST_OP))

    def python_read(self, what: str) -> None:
        """`what` (`Tensor.tolist()`, `Tensor.numpy()`) read a tensor's memory outside ATen: refused as
        a host sync, as a CUDA capture refuses its copy to the host (in an eager segment it may read)."""
        if not self.paused:
            raise RuntimeError(
                f"operation not permitted when stream is capturing: {what} copies a tensor's values to the "
                "host (simulated by graphstep's recording backend)"
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            self.before(func, args, kwargs)
            return func(*args, **kwargs)
        sync = host_sync_of(func, args)
        if sync is not None:
            raise RuntimeError(
                f"operation not permitted when stream is capturing: {sync} needs a tensor's value on "
                "the host (simulated by graphstep's recording backend)"
            )
        self.before(func, args, kwargs)
        out = func(*args, **kwargs)
        alias = self.alias
        work = _work_of(func, out)
        if work is not None:  # the replay's handle goes into a slot that the recorded wait reads
            slot = _WorkSlot()
            self.works[id(work)] = (work, slot)
            func = _ReturnsWork(func, slot)
        self.parts[-1].append(
            (func, map_op_tensors(alias, args), map_op_tensors(alias, kwargs), map_op_tensors(alias, out))
        )
        return out

    def waited(self, work: Any) -> None:
        """The step waited on `work`: a replay waits on that operation's handle here."""
        known = self.works.get(id(work))
        if known is not None and known[0] is work:
            self.host_op(known[1].wait)


def _same_memory(alias: torch.Tensor, x: torch.Tensor) -> bool:
    """`x` still has the memory (and view of it) its alias was made with."""
    try:
        return (
            alias.data_ptr() == x.data_ptr()
            and alias.shape == x.shape
            and alias.stride() == x.stride()
            and alias.dtype == x.dtype
        )
    except (RuntimeError, NotImplementedError):  # no plain memory (sparse, a wrapper subclass): as made
        return True


def _replay_ops(ops: list) -> None:
    # Recorded operations sit below autograd and autocast: run them as they are.
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for func, op_args, op_kwargs, recorded in ops:
            result = func(*op_args, **op_kwargs)
            if recorded is _HOST_OP:
                continue
            returns = func._schema.returns
            if not returns:
                continue
            if len(returns) == 1:
                recorded, result = (recorded,), (result,)
            for ret, buffers, values in zip(returns, recorded, result):
                if ret.alias_info is not None:
                    continue  # a view or an input written in place: nothing new to copy
                if isinstance(buffers, torch.Tensor):
                    buffers, values = (buffers,), (values,)
                elif not isinstance(buffers, (list, tuple)):
                    continue
                for buffer, value in zip(buffers, values):
                    if buffer.layout == torch.sparse_coo:
                        _refill_sparse(buffer, value)
                    else:
                        buffer.copy_(value)


class RecordingBackend(HostBackend):
    """Capture records the step's ATen operations; a replay re-runs them on the same memory."""

    name = "recording"
    static_buffers = True
    capture_executes = True

    def capture(
        self,
        body: CaptureBody,
        args: tuple,
        kwargs: dict,
        generators: list = (),
        *,
        split_in_backward: bool = False,
    ) -> PartsRecording:
        recorder = _Recorder()
        try:
            # Libraries that take another path while a CUDA stream captures (transformers skips
            # its host-side checks) take it here too, as they would under a real capture. A compiled
            # frame that would compile raises, as on CUDA (under the recorder, dynamo would otherwise
            # quietly run it uncompiled).
            with (
                no_compiling() if MODES_KEEP_COMPILED else contextlib.nullcontext(),
                recorder,
                python_host_reads(recorder.python_read),
                _pretend_capturing(),
                _recording_rng_state(recorder),
                _WorkWaits(recorder),
            ):
                outputs = body(
                    Splitter(recorder.end_part, recorder.begin_part, executes=True), *args, **kwargs
                )
        except BaseException:
            recorder.roll_back()
            raise
        recording = PartsRecording([functools.partial(_replay_ops, ops) for ops in recorder.parts], _nothing)
        # The outputs share storage with the recorded buffers that replays overwrite.
        recording.outputs = outputs
        recording.undo = recorder.roll_back  # until the capture is accepted (lifecycle.py)
        return recording


def _nothing() -> None:
    pass


def _refill_sparse(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """A sparse result written into the recorded one's own index and value memory, as a graph's kernels
    write (`copy_` would give the recorded alias new memory, which the tensor it aliases, a sparse
    gradient an eager segment reads, would never see)."""
    if buffer._nnz() != value._nnz():
        raise RuntimeError(
            f"a sparse result holds {value._nnz()} entries in this replay and held {buffer._nnz()} at "
            "capture: a graph holds fixed sizes (simulated by graphstep's recording backend)"
        )
    buffer._indices().copy_(value._indices())
    buffer._values().copy_(value._values())


_HOST_OP = object()
"""In a part's list: the entry is a host operation (`_Recorder.host_op`), not an ATen one."""


# -- work handles of collectives and point-to-point operations --------------------------------------


class _WorkSlot:
    """The handle a replayed operation returned, for the wait recorded after it."""

    __slots__ = ("work",)

    def __init__(self) -> None:
        self.work: Any = None

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            _unboxed(work).wait()


class _ReturnsWork:
    """A recorded operation that returns a work handle: a replay keeps it in the slot."""

    __slots__ = ("func", "slot")

    def __init__(self, func: Any, slot: _WorkSlot):
        self.func, self.slot = func, slot

    @property
    def _schema(self) -> Any:
        return self.func._schema

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.func(*args, **kwargs)
        self.slot.work = _script_work(out)
        return out


def _script_work(out: Any) -> Any:
    """The work handle among an operation's results (a ScriptObject of torch's c10d Work), or None."""
    for value in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(value, torch.ScriptObject):
            return value
    return None


def _unboxed(script_work: Any) -> Any:
    import torch.distributed as dist

    return dist.Work.unbox(script_work)


def _work_of(func: Any, out: Any) -> Any:
    """The Python handle (`dist.Work`) of the work `func` returned, when it is a c10d operation."""
    if getattr(func, "namespace", None) != "c10d":
        return None
    script = _script_work(out)
    return None if script is None else _unboxed(script)  # the same object the step's Python gets


class _WorkWaits:
    """While recording: each `dist.Work.wait()` the step calls is recorded in its place."""

    def __init__(self, recorder: _Recorder):
        self.recorder = recorder
        self.original: Any = None

    def __enter__(self) -> None:
        if not torch.distributed.is_available():
            return
        import torch.distributed as dist

        original = self.original = dist.Work.wait
        recorder = self.recorder

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(work, *args, **kwargs)
            recorder.waited(work)
            return result

        dist.Work.wait = wait

    def __exit__(self, *exc: object) -> None:
        if self.original is not None:
            import torch.distributed as dist

            dist.Work.wait = self.original


@contextlib.contextmanager
def _recording_rng_state(recorder: _Recorder) -> Iterator[None]:
    """`torch.get_rng_state` / `torch.set_rng_state` (the CPU generator's) recorded while capturing.

    torch's checkpointing and `torch.random.fork_rng` call them through the `torch` module, which is
    where they are replaced (the generator's own methods belong to a C type)."""
    from torch import random as torch_random

    get, set_ = torch.get_rng_state, torch.set_rng_state

    def get_rng_state() -> torch.Tensor:
        state = get()
        recorder.host_op(functools.partial(_save_state, state))
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        set_(new_state)
        if isinstance(new_state, torch.Tensor):
            # the tensor as it will be at that point of the replay: saved there by the replay, or
            # written by its operations, or the caller's own (read then, as a graph reads memory)
            recorder.host_op(functools.partial(set_, new_state))

    modules = (torch, torch_random)
    saved = [(m, m.get_rng_state, m.set_rng_state) for m in modules]
    for m in modules:
        m.get_rng_state, m.set_rng_state = get_rng_state, set_rng_state
    try:
        yield
    finally:
        for m, g, s in saved:
            m.get_rng_state, m.set_rng_state = g, s


def _save_state(state: torch.Tensor) -> None:
    state.copy_(torch.default_generator.get_state())


@contextlib.contextmanager
def _pretend_capturing() -> Iterator[None]:
    original = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


_PYTHON_READS = ("tolist", "numpy")
"""`Tensor` methods that read a CPU tensor's memory in C++, with no ATen call a dispatch mode could see
(`np.asarray(t)` and `t.__array__()` go through `numpy`); on a GPU each copies to the host."""
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DEMO_DIR = os.path.join(_PACKAGE_DIR, "demo")


@contextlib.contextmanager
def python_host_reads(on_read: Callable[[str], None]) -> Iterator[None]:
    """`on_read("Tensor.tolist()")` before each `tolist()` / `numpy()` on this thread while inside.

    The recording backend sees host reads as ATen operations (`.item()`, `bool(t)`, `int(t)`,
    `operator.index(t)` are `_local_scalar_dense`), but these two read memory directly: unwatched, the
    value read at capture (a split size, a loop count) would be baked into every replay. graphstep's
    own reads (error messages, host random state) are its business, not the step's: a direct call from
    graphstep's code (its demo aside) is not reported."""
    owner = threading.get_ident()
    saved = {name: torch.Tensor.__dict__.get(name) for name in _PYTHON_READS}

    def watched(name: str) -> Callable[..., Any]:
        read = getattr(torch.Tensor, name)  # the C method, or an enclosing watch's wrapper

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner and not _graphstep_caller(_outside_torch(sys._getframe(1))):
                on_read(f"Tensor.{name}()")
            return read(self, *args, **kwargs)

        return method

    for name in _PYTHON_READS:
        setattr(torch.Tensor, name, watched(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def _graphstep_caller(frame: FrameType | None) -> bool:
    path = frame.f_code.co_filename if frame is not None else ""
    return path.startswith(_PACKAGE_DIR) and not path.startswith(_DEMO_DIR)


def _outside_torch(frame: FrameType | None) -> FrameType | None:
    """The first frame from `frame` up that is not torch's: who asked torch for the read (graphstep's
    vote exchanges its texts through `torch.distributed.all_gather_object`, which calls `numpy()`)."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return frame
