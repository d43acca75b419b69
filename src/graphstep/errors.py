"""Errors graphstep raises. Every message says what went wrong, where, and what to do."""

from __future__ import annotations


class GraphStepError(RuntimeError):
    """Base class of every error graphstep raises on purpose."""


class CaptureError(GraphStepError):
    """The step could not be captured into a CUDA graph. State was left as before the call."""


class WarmUpAgain(CaptureError):
    """Internal: the capture reached an eager segment the last warm-up did not note (a graph break was
    just made, say). This call runs as one more warm-up instead; the next one captures."""

    def __init__(self, message: str, *, after_break: bool = False):
        super().__init__(message)
        self.after_break = after_break


class OutOfMemoryAtCapture(WarmUpAgain):
    """Internal: the GPU ran out of memory while a graph was being captured. Nothing of the capture is
    kept; that call runs as one more warm-up (an eager step) and the next call captures again. When that
    capture runs out of memory too, a `CaptureError` says so."""


class CompileAtCaptureError(WarmUpAgain):
    """A `torch.compile`d part of the step would compile during the capture: dynamo's guards on it
    failed, or it never ran in a warm-up. A graph cannot record a compilation; nothing ran. The first
    time, that call runs as one more warm-up instead (which compiles it); raised when that did not help."""


class HostSyncError(CaptureError):
    """The step synchronises with the host (`.item()`, `.cpu()`, `print(tensor)`, ...)."""


class PythonWriteError(CaptureError):
    """The step's code writes Python state that outlives the call (an attribute, a global, a list it
    appends to): a replay runs no Python, so it would never write it again. The writes were undone."""


class UnwatchedReadError(CaptureError):
    """With `Config(strict_reads=True)`: the step's code reads an object whose contents no guard can
    watch (a library object that is no config, an object of a C type): a change to it between calls
    would not reach the graph. The capture was rolled back."""


class HostRandomError(CaptureError):
    """The step drew random numbers on the host while it was captured (Python's `random`, NumPy,
    a CPU `torch.Generator`): every replay would repeat that one draw."""


class TooManyGraphsError(GraphStepError):
    """More distinct input signatures than `Config.max_graphs` allows."""


class UnsupportedOutputError(CaptureError):
    """The step returns a value that a replay cannot reproduce (a Python number, a string, ...)."""


class UnsupportedInputError(GraphStepError):
    """An argument cannot be part of a graph's key (for example an unhashable Python object), or
    cannot be loaded into a graph's input buffers (a meta tensor, a tensor on another device)."""


class ChangingArgumentError(TooManyGraphsError):
    """A Python number argument takes a new value on every call (an iteration index): each value
    would need its own graph."""


class StaleGraphError(GraphStepError):
    """State a graph depends on changed and re-capturing is not allowed (or past its limit)."""


class VerificationError(GraphStepError):
    """`Config.verify_every` found a replay that differs from eager execution."""


class ClosedError(GraphStepError):
    """The captured step was closed; create a new one."""


class UnsupportedOptimizerError(GraphStepError):
    """The optimizer cannot run inside a CUDA graph (it needs a closure or reads values on the host)."""


class RankFailedError(GraphStepError):
    """Another rank of a distributed step failed, exited or stopped answering; ranks step
    together, so this one stops too instead of waiting for collectives that never come."""


class CollectiveMismatchError(GraphStepError):
    """The ranks of a distributed step issued different collectives (another operation, group,
    dtype or shape, or one rank one more): replaying them would hang or mix data."""
