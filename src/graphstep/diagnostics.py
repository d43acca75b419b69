"""What a captured step tells its user: statistics, log notices, and where in their code a failure is."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import signature as sig

log = logging.getLogger("graphstep")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_DEMO_DIR = os.path.join(_PACKAGE_DIR, "demo")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_WARNINGS_FILE = os.path.abspath(warnings.__file__)


@dataclasses.dataclass
class StepStats:
    """Counts and host-side times of one captured step. Times are seconds of wall clock."""

    warmup_calls: int = 0
    """Eager calls made to warm up (per signature, `Config.warmup_steps` each)."""
    captures: int = 0
    """Graphs captured: first captures, variants and re-captures."""
    variants: int = 0
    """Captures of another graph for new guarded values (train/eval, frozen layers, a module
    attribute, a global), the signature's other graphs kept."""
    variant_switches: int = 0
    """Replays that picked an already captured variant because guarded values changed back."""
    replays: int = 0
    """Calls served by replaying a graph (the capturing call's own replay included)."""
    eager_calls: int = 0
    """Calls run eagerly after warm-up: the eager backend, a fallback the config allowed, or a wait
    out of variant churn (`churn_calls`)."""
    graph_breaks: int = 0
    """Pieces of the step that run eagerly, forward and backward, between its graphs because no graph
    could record them (`Config.graph_breaks`; see `backends/graph_breaks.py`)."""
    churn_calls: int = 0
    """Calls run eagerly instead of capturing another graph, because a value the step reads changed
    on every call (see `guards/churn.py`); counted in `eager_calls` too."""
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
    return user_frame_of(traceback.extract_tb(tb))


def user_frame_of(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    found = None
    for frame in frames:
        path = os.path.abspath(frame.filename)
        library = (
            path.startswith(_TORCH_DIR)
            or path == _WARNINGS_FILE
            or (path.startswith(_PACKAGE_DIR) and not path.startswith(_DEMO_DIR))
        )
        if not library:
            found = frame
    return found


def where(tb: TracebackType | None) -> str:
    frame = user_frame(tb)
    return "an unknown line" if frame is None else _describe(frame)


def _describe(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"


# Substrings of CUDA and PyTorch capture errors, and what they usually mean.
_HOST_SYNC = (
    "the step synchronises with the host: `.item()`, `.cpu()`, `.tolist()`, `print(tensor)`, `if tensor:`, "
    "`nonzero`, boolean-mask indexing or `torch.cuda.synchronize()`. Keep values on the device "
    "(`torch.where` instead of branching on a tensor), and return tensors from the step to log them outside"
)
_LIKELY_CAUSES = (
    (
        ("out of memory",),
        "the GPU ran out of memory during the capture: free memory (a smaller batch, tensors of earlier "
        "steps dropped, `torch.cuda.empty_cache()`), then call the step again",
    ),
    (
        ("legacy stream depend on a capturing",),
        "autograd runs part of the backward on the default CUDA stream, which no graph can capture: "
        "a module kept state made on it. DistributedDataParallel and a DeepSpeed engine keep their gradient "
        "hooks on the stream they were built on: construct DDP (or call deepspeed.initialize) inside "
        "`with torch.cuda.stream(graphstep.capture_stream()):` (graphstep.integrations.deepspeed.initialize "
        "does that)",
    ),
    (
        ("not permitted when stream is capturing", "StreamCaptureUnsupported", "StreamCaptureImplicit"),
        _HOST_SYNC,
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
    return likely_cause(exc) is _HOST_SYNC


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)


def capture_error(step_name: str, exc: BaseException, modules: Iterable[tuple[str, Any]] = ()) -> Exception:
    """The `CaptureError` (or `HostSyncError`) for a capture that raised `exc`. `modules`: the step's
    root modules, named (`TrainingState.named_modules_roots()`), to name a module in a hint."""
    from .errors import CaptureError, HostSyncError

    sync = is_host_sync(exc)
    kind = HostSyncError if sync else CaptureError
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    hint = None
    if sync:
        hint = batchnorm_hint(exc, modules) or host_sync_hint(
            traceback.extract_tb(exc.__traceback__), first_line
        )
    return kind(
        f"capturing {step_name} failed at {where(exc.__traceback__)}.\n"
        + f"Likely cause: {likely_cause(exc)}.\n"
        + (f"At this line: {hint}.\n" if hint else "")
        + f"Original error: {type(exc).__name__}: {first_line}\n"
        "Nothing was lost: the model, optimizer and inputs are as they were before this call, and the "
        "step can be called again."
    )


def eager_fallback_message(step_name: str, max_graphs: int, signature: object) -> str:
    return (
        f"graphstep: {step_name} already holds max_graphs={max_graphs} graphs; running this call "
        f"eagerly (slow) for {signature.describe()}. Pad or bucket the inputs to fewer shapes, or raise "
        "Config.max_graphs."
    )


def stale_message(step_name: str, max_recaptures: int, what: str) -> str:
    return (
        f"{step_name}: state its graph depends on changed again, past "
        f"Config.max_recaptures={max_recaptures}:\n{what}\n"
        "Replaying would silently differ from eager. Keep parameters and optimizer state in place "
        "(copy_ into them instead of replacing), keep hyperparameters as tensors (graphstep's optimizer "
        "support turns lr into one), or raise max_recaptures."
    )


def too_many_graphs_message(step_name: str, max_graphs: int, seen: list, new: object) -> str:
    """`seen` and `new`: input signatures (anything with `describe()`)."""
    listed = "\n".join(f"  - {s.describe()}" for s in seen)
    return (
        f"{step_name} was called with a new input signature, and it already holds "
        f"Config.max_graphs={max_graphs} graphs, one per signature:\n{listed}\n"
        f"new: {new.describe()}\n"
        "Each distinct shape, dtype, stride or Python value needs its own graph. Pad or bucket "
        "inputs to a few fixed shapes, pass changing numbers as tensors, raise max_graphs, or set "
        'Config(on_too_many_graphs="eager") to run new signatures eagerly with a warning.'
        + _changing_shapes_hint(seen, new)
    )


def _changing_shapes_hint(seen: list, new: Any) -> str:
    """Tensors whose shapes alone set the signatures apart: if only eager code uses them, they need not."""
    spec, metas = getattr(new, "spec", None), getattr(new, "tensors", ())
    same = [s for s in seen if s.spec == spec and len(s.tensors) == len(metas)] if spec is not None else []
    if not same:
        return ""
    paths = sig.tensor_paths(spec)
    changing = [p for i, p in enumerate(paths) if any(s.tensors[i] != metas[i] for s in same)]
    if not changing:
        return ""
    shown = ", ".join(changing[:4]) + (f" and {len(changing) - 4} more" if len(changing) > 4 else "")
    return (
        f"\nThe shapes of {shown} change from call to call. If only eager code uses them (a detector's "
        "targets, which go to its loss and box matching), make the module that takes them an eager segment "
        "(`graphstep.eager_segment(module)`): an argument used only inside eager segments is not part of the "
        "key, and goes to the segment as it is."
    )


def changing_argument_message(step_name: str, path: str, values: list) -> str:
    shown = ", ".join(repr(v) for v in values)
    kind = type(values[-1]).__name__
    return (
        f"{step_name}: argument {path} is a Python {kind} with a new value on each of the last "
        f"{len(values)} calls ({shown}). A Python number is baked into a graph, so every value needs "
        "its own warm-up and graph, and a value seen once is never replayed. Pass it as a 0-d tensor on "
        "the step's device instead, e.g. `step_t = torch.zeros((), dtype=torch.long, device=...)`, "
        "`step_t.fill_(i)` before each call (or `torch.tensor(i, device=...)`): a replay then reads the "
        "current value. Nothing ran for this call."
    )


def host_sync_ops() -> set:
    """ATen operations whose result a CUDA stream cannot produce without the host waiting."""
    aten = torch.ops.aten
    return {
        aten._local_scalar_dense.default,  # .item(), float(t), print(t), if t: ...
        aten.nonzero.default,  # data-dependent shape: nonzero, boolean-mask indexing
        aten.masked_select.default,
        aten.is_nonzero.default,
        aten.equal.default,
    }


_SYNC_OPS = host_sync_ops()
_INDEXING = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


def host_sync_of(func: object, args: tuple) -> str | None:
    """How an ATen call needs a value on the host on a GPU, or None. Indexing by a boolean mask
    calls `nonzero` inside the CPU kernel, where a dispatch mode cannot see it: named here."""
    if func in _SYNC_OPS:
        return str(func)
    indices = args[1] if func in _INDEXING and len(args) > 1 else ()
    if isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    ):
        return f"{func} by a boolean mask (a nonzero: its size depends on the data)"
    return None


_expected = threading.local()


@contextlib.contextmanager
def expected_host_reads() -> Iterator[None]:
    """Around a library call graphstep runs as an eager segment: its host reads are not the step's
    host syncs (`HostSyncWatch` leaves them out)."""
    depth = getattr(_expected, "depth", 0)
    _expected.depth = depth + 1
    try:
        yield
    finally:
        _expected.depth = depth


class HostSyncWatch:
    """Notes where a step synchronises with the host while it runs eagerly.

    On CUDA this uses `torch.cuda.set_sync_debug_mode("warn")` (restored afterwards), which
    flags `.item()`, `.cpu()`, `.tolist()`, `print(tensor)`, `nonzero` and boolean-mask
    indexing. The step still completes, as a real step: the capture that would follow is
    refused instead, before anything of it runs. `sites` holds the user's lines.
    """

    def __init__(self, cuda: bool, locate: Callable[[list[FrameType]], str | None] | None = None):
        self.cuda = cuda
        self.sites: list[str] = []
        self.locate = locate
        """Names the graph break a sync in these frames (outermost first) would make, or None."""
        self.breaks: list[str] = []

    def __enter__(self) -> HostSyncWatch:
        if not self.cuda:  # the recording backend: watch ATen operations instead
            self._spy = _SyncSpy(self)
            self._spy.__enter__()
        else:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            self._show = warnings.showwarning
            warnings.showwarning = self._on_warning
        return self

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            self.note()
        else:
            self._show(message, category, filename, lineno, file, line)

    def note(self) -> None:
        """Record the user's frame of the current stack as a host-sync site."""
        if getattr(_expected, "depth", 0):
            return
        frame = user_frame_of(traceback.extract_stack()[:-1])
        site = "an unknown line" if frame is None else _describe(frame)
        if site not in self.sites:
            self.sites.append(site)
        if self.locate is not None:
            frames = []
            f = sys._getframe(1)
            while f is not None:
                frames.append(f)
                f = f.f_back
            found = self.locate(frames[::-1])
            if found is not None and found not in self.breaks:
                self.breaks.append(found)

    def __exit__(self, *exc: object) -> None:
        if not self.cuda:
            self._spy.__exit__(*exc)
        else:
            warnings.showwarning = self._show
            self._warnings.__exit__(*exc)
            torch.cuda.set_sync_debug_mode(self._mode)


class _SyncSpy(TorchDispatchMode):
    """The recording backend's stand-in for CUDA's sync debug mode."""

    def __init__(self, watch: HostSyncWatch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if host_sync_of(func, args) is not None:
            self.watch.note()
        return func(*args, **(kwargs or {}))


# -- what a host sync is, and what to write instead --------------------------------------------------

_DISTRIBUTIONS_DIR = os.path.join(_TORCH_DIR, "distributions") + os.sep

# Library frames (file name, function or None for any) and the pattern they mean. The innermost
# match wins: a distribution built inside a user's helper is still a distribution.
DEEPSPEED_HINT = (
    "a DeepSpeed engine's step reads its overflow flag and gradient norm on the host and advances Python "
    "counters: capture it with graphstep.integrations.deepspeed.capture_engine_step(engine, step), which "
    "runs engine.step() as an eager segment and keys the graph on the accumulation position"
)
_LIBRARY_HINTS = (
    ("stage_1_and_2.py", None, DEEPSPEED_HINT),
    ("bf16_optimizer.py", None, DEEPSPEED_HINT),
    ("utils.py", ("is_invalid_grad_norm", "get_global_norm_of_tensors", "clip_grad_norm_"), DEEPSPEED_HINT),
    (
        "grad_scaler.py",
        ("get_scale", "_get_growth_tracker", "state_dict"),
        "GradScaler.get_scale() (or state_dict()) reads the scale on the host: call it between steps, "
        "outside the captured step, or return `scaler._scale` (a device tensor) from the step",
    ),
    (
        "grad_scaler.py",
        None,
        "GradScaler.step reads found_inf on the host with .item(). graphstep runs it as an eager segment "
        "where it can (torch's GradScaler._maybe_opt_step); an optimizer constructed with fused=True "
        "(Adam, AdamW, SGD) unscales and skips on the device instead and keeps the step in one graph",
    ),
    (
        "clip_grad.py",
        None,
        "clip_grad_norm_(error_if_nonfinite=True) reads the norm on the host: keep the default "
        "error_if_nonfinite=False, return the norm from the step and check torch.isfinite(norm) "
        "outside it, or use fp16 with a GradScaler, which skips non-finite steps on the device",
    ),
    (
        "lr_scheduler.py",
        None,
        "call the learning-rate scheduler's step() outside the captured step, between calls",
    ),
)
_DISTRIBUTIONS = (
    "torch.distributions checks its arguments and samples on the host (`validate_args` is on by "
    "default): pass `validate_args=False` to the distributions the step builds, or call "
    "`torch.distributions.Distribution.set_default_validate_args(False)` around the captured step "
    "(keep it on in an eager debugging run, where an invalid value still raises)"
)
_BOOLEAN_MASK = (
    "boolean-mask indexing (`x[mask]`, `masked_select`, `nonzero`) makes a tensor whose size depends on "
    "the data, which no graph can hold. For a loss over some positions keep every position and weight "
    "it: `F.cross_entropy(logits, labels, ignore_index=-100)`, or "
    "`(loss * mask).sum() / mask.sum()`; to pick values, `torch.where(mask, x, 0)`"
)
_LOGGING = (
    "`.item()`, `.tolist()` or `.cpu()` copies a value to the host (for logging, usually): return the "
    "tensor from the step (`loss.detach()`) and read it outside, after the call, or every few steps"
)
_HOST_COPY = (
    "`.to(device)` / `.cuda()` of CPU memory that is not pinned waits for the host. Move the batch "
    "to the GPU before calling the step (graphstep copies it into the graph's buffers), or pin it "
    "(`DataLoader(pin_memory=True)`, `.pin_memory()`) and copy with `non_blocking=True`"
)
_BRANCH = (
    "branching on a tensor (`if tensor:`, `float(t)`, `print(t)`) reads it on the host: keep the "
    "decision on the device (`torch.where(cond, a, b)`), or return the tensor and decide outside the step"
)
# Source text of the user's line -> pattern, for a CUDA error that does not name the operation.
_LINE_PATTERNS = (
    (re.compile(r"\.(item|tolist|cpu|numpy)\(\)"), _LOGGING),
    (re.compile(r"masked_select|nonzero\(|\[[^\]]*(!=|==|<|>|~|\bmask)[^\]]*\]"), _BOOLEAN_MASK),
    (re.compile(r"\.to\(|\.cuda\(|torch\.(tensor|as_tensor|from_numpy)\("), _HOST_COPY),
    (re.compile(r"^\s*(if|elif|while|assert)\b|\b(float|int|bool|print)\("), _BRANCH),
)
# The recording backend's error names the operation.
_OP_PATTERNS = (("nonzero", _BOOLEAN_MASK), ("masked_select", _BOOLEAN_MASK))


def host_sync_hint(frames: list[traceback.FrameSummary], error: str = "") -> str | None:
    """What a host sync at capture is and what to write instead, or None when it is not one of the
    known patterns. `frames`: the failure's traceback, outermost first; `error`: its message."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_DISTRIBUTIONS_DIR) or f"{os.sep}distributions{os.sep}" in frame.filename:
            return _DISTRIBUTIONS
        name = os.path.basename(frame.filename)
        for file, functions, hint in _LIBRARY_HINTS:
            if name == file and (functions is None or frame.name in functions):
                return hint
    for needle, hint in _OP_PATTERNS:
        if needle in error:
            return hint
    user = user_frame_of(list(frames))
    line = (user.line or "") if user is not None else ""
    for pattern, hint in _LINE_PATTERNS:
        if pattern.search(line):
            return hint
    return None


def batchnorm_hint(exc: BaseException, modules: Iterable[tuple[str, Any]] = ()) -> str | None:
    """The hint for a host sync inside a BatchNorm with `momentum=None`, naming the module, or None.

    Such a BatchNorm keeps a cumulative average of its batch statistics: each training forward
    divides by `num_batches_tracked` read on the host (`1.0 / float(self.num_batches_tracked)`)."""
    batchnorm = torch.nn.modules.batchnorm._BatchNorm
    module = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, batchnorm) and candidate.momentum is None:
            module = candidate  # the innermost such frame wins
    if module is None:
        return None
    name = next(
        (
            f"{prefix}.{sub}" if sub else prefix
            for prefix, root in modules
            for sub, m in root.named_modules()
            if m is module
        ),
        None,
    )
    kind = type(module).__name__
    what = f"`{name}` ({kind}(momentum=None))" if name else f"a {kind}(momentum=None)"
    return (
        f"{what} keeps a cumulative moving average of its batch statistics, and every training forward "
        "reads num_batches_tracked on the host to weigh the new batch (`1.0 / float(self.num_batches_tracked)`). "
        f"Give it a momentum (`{kind}(..., momentum=0.1)`, BatchNorm's default: an exponential average, "
        "computed on the device); if you need the cumulative average of the statistics, recompute them after "
        "training in an eager pass over the data with momentum=None (as "
        "`torch.optim.swa_utils.update_bn` does). A BatchNorm whose statistics should stay as they are "
        "(a frozen backbone) can run in eval mode, which reads nothing on the host. "
        "`graphstep.eager_segment` cannot hold it: a segment's results carry no autograd history"
    )
