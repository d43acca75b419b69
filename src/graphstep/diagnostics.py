"""What a captured step tells its user: statistics, log notices, and where in their code a failure is."""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback
from types import TracebackType

log = logging.getLogger("graphstep")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_DEMO_DIR = os.path.join(_PACKAGE_DIR, "demo")
_TORCH_DIR = os.path.dirname(os.path.abspath(__import__("torch").__file__))


@dataclasses.dataclass
class StepStats:
    """Counts and host-side times of one captured step. Times are seconds of wall clock."""

    warmup_calls: int = 0
    """Eager calls made to warm up (per signature, `Config.warmup_steps` each)."""
    captures: int = 0
    """Graphs captured, re-captures included."""
    replays: int = 0
    """Calls served by replaying a graph (the capturing call's own replay included)."""
    eager_calls: int = 0
    """Calls run eagerly after warm-up: the eager backend, or a fallback the config allowed."""
    warmup_s: float = 0.0
    """Time spent in warm-up calls."""
    capture_s: float = 0.0
    """Time spent capturing (until the graph is instantiated, before its first replay)."""
    replay_s: float = 0.0
    """Host time spent in replay calls: copying inputs, launching, handing out outputs. The GPU
    work is asynchronous and not included."""
    graphs_alive: int = 0
    """Graphs held now."""
    pool_bytes: int = 0
    """Bytes the step's private memory pool holds from the driver now (0 without CUDA)."""


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost traceback frame that is neither graphstep's nor torch's: the user's line."""
    found = None
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        library = path.startswith(_TORCH_DIR) or (
            path.startswith(_PACKAGE_DIR) and not path.startswith(_DEMO_DIR)
        )
        if not library:
            found = frame
    return found


def where(tb: TracebackType | None) -> str:
    frame = user_frame(tb)
    if frame is None:
        return "an unknown line"
    return f"{frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"


# Substrings of CUDA and PyTorch capture errors, and what they usually mean.
_LIKELY_CAUSES = (
    (
        ("not permitted when stream is capturing", "StreamCaptureUnsupported", "StreamCaptureImplicit"),
        "the step synchronises with the host: `.item()`, `.cpu()`, `.tolist()`, `print(tensor)`, `if tensor:`, "
        "`nonzero`, boolean-mask indexing or `torch.cuda.synchronize()`. Keep values on the device "
        "(`torch.where` instead of branching on a tensor), and return tensors from the step to log them outside",
    ),
    (
        ("capturable",),
        "the optimizer is not capturable: construct it with `capturable=True` (Adam, AdamW, ...) or pass it "
        "as `graphstep.capture(optimizer=...)`",
    ),
    (
        ("Generator", "generator"),
        "a random-number generator the step uses is not registered with the graph",
    ),
    (
        ("StreamCaptureInvalidated", "capture_end", "StreamCaptureWrongThread"),
        "an operation outside the capture stream touched it (another thread, or a stream the step did not "
        "make wait on the current one)",
    ),
)


def likely_cause(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    for needles, cause in _LIKELY_CAUSES:
        if any(n in text for n in needles):
            return cause
    return "an operation that a CUDA graph cannot record (it needs the host, or allocates outside the pool)"


def is_host_sync(exc: BaseException) -> bool:
    return likely_cause(exc) is _LIKELY_CAUSES[0][1]
