"""A `torch.compile`d model inside a captured step: whatever the capture runs is compiled in the warm-ups.

A CUDA graph records kernels. A compiled model that needs to compile during the capture runs dynamo
and inductor there: inductor launches work of its own on the capturing stream (constant folding:
"operation not permitted when stream is capturing"), or its first run of new code differs from the
warm-ups'. Two checks keep compilation out of the capture:

- `CompileCount` counts the frames dynamo compiled (and the guards that failed) during each warm-up.
  The lifecycle captures only after a warm-up that compiled nothing, at most `EXTRA_WARMUPS` warm-ups
  past `Config.warmup_steps`: the code cache then holds what the next call runs.
- `no_compiling()` runs the capture under torch.compile's "fail_on_recompile" stance (torch >= 2.6):
  a frame that would compile raises before dynamo traces it, with the guards that failed, and
  becomes a `CompileAtCaptureError`, a `WarmUpAgain`: the lifecycle performs that call as one more
  warm-up (which compiles it) and captures on the next, or raises when that did not settle it.

Nothing here imports torch._dynamo (importing graphstep does: `autograd_segments.run` is wrapped in
`torch.compiler.disable`); what dynamo compiled is read from its counters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CompileAtCaptureError
from ..guards.compiling import frames_compiled

log = logging.getLogger("graphstep")

EXTRA_WARMUPS = 2
"""Warm-ups past `Config.warmup_steps` while each still compiles; then the capture tries (and
`no_compiling` names the guard if it would compile)."""

MODES_KEEP_COMPILED = "ignore_compile_internals" in vars(TorchDispatchMode)
"""torch >= 2.9: a dispatch mode that ignores compile internals (the recording backend's) leaves
compiled frames compiled, and dynamo's guards as they were outside it. Older torch runs frames
uncompiled under any dispatch mode."""

_STANCE_ERROR = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What dynamo compiled during one call."""

    frames: int = 0
    """Frames dynamo was asked to compile (first compilations and recompilations)."""
    reasons: tuple[str, ...] = ()
    """The guard failures that caused the recompilations, as dynamo words them."""

    def describe(self) -> str:
        what = f"{self.frames} frame{'s' if self.frames != 1 else ''}"
        if not self.reasons:
            return what
        return what + ", recompiled because:\n" + "\n".join(f"  - {_first_line(r)}" for r in self.reasons)


NOTHING = Compiled()


class CompileCount:
    """dynamo's frame compilations and guard failures from its creation to `since()`."""

    def __init__(self) -> None:
        utils = _dynamo_utils()
        self._frames = frames_compiled()
        self._failures = {code: len(v) for code, v in _failures(utils).items()}

    def since(self) -> Compiled:
        utils = _dynamo_utils()
        if utils is None:
            return NOTHING
        frames = frames_compiled() - self._frames
        if frames < 0:  # torch._dynamo.reset() cleared the counters: everything compiles again
            frames = max(1, frames_compiled())
        reasons = tuple(
            r for code, v in _failures(utils).items() for r in list(v)[self._failures.get(code, 0) :]
        )
        return Compiled(frames, reasons) if frames or reasons else NOTHING


def warm_up_again(name: str, last: Compiled, warmups: int, needed: int) -> bool:
    """Whether a signature ready to capture warms up once more: its last warm-up compiled, and it
    has warmed up fewer than `needed + EXTRA_WARMUPS` times."""
    if not last.frames or warmups >= needed + EXTRA_WARMUPS:
        return False
    log.info(
        "graphstep: %s: torch.compile compiled in the last warm-up (%s); one more warm-up before the "
        "capture, which must find everything compiled",
        name,
        last.describe(),
    )
    return True


def gave_way(name: str, error: CompileAtCaptureError, *, repeated: bool) -> None:
    """A capture stopped by a frame that would compile (nothing ran) gives way to one more warm-up,
    which compiles it: say so. Raise when it is the second time in a row: what dynamo guards on then
    differs between warm-ups and capture, or changes on every call."""
    if repeated:
        raise CompileAtCaptureError(
            f"capturing {name}: {error}\nIt did again, after one more warm-up: what dynamo guards on above "
            "differs between the warm-ups and the capture, or changes on every call. Keep that value fixed "
            "between calls (or pass it as a tensor), or compile that code with `torch.compile(..., "
            "dynamic=True)` if it is a size; `TORCH_LOGS=recompiles` shows every recompilation. Nothing was "
            "lost: the model, optimizer and inputs are as they were before this call."
        ) from error
    log.warning(
        "graphstep: %s: %s\nThis call runs as one more warm-up instead (it compiles that code); the next "
        "call captures.",
        name,
        error,
    )


@contextlib.contextmanager
def no_compiling() -> Iterator[None]:
    """Around a capture: a compiled frame that would compile raises `CompileAtCaptureError` first."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        yield
        return
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    stance = contextlib.nullcontext()
    if set_stance is not None:
        try:
            stance = set_stance("fail_on_recompile")
        except Exception:  # an unknown stance, or called where set_stance is refused: no check
            stance = contextlib.nullcontext()
    try:
        with stance:
            yield
    except RuntimeError as exc:
        if _STANCE_ERROR not in str(exc):
            raise
        raise CompileAtCaptureError(_message(str(exc))) from exc


def _message(text: str) -> str:
    head, _, rest = text.partition("\n")
    where = head.split(_STANCE_ERROR, 1)[-1].strip(" .")
    reasons = [line.strip().removeprefix("- ") for line in rest.splitlines()[1:] if line.strip()]
    because = (
        "dynamo's guards on it failed:\n" + "\n".join(f"  - {r}" for r in reasons)
        if reasons
        else "the warm-ups never ran this code, or ran it with other values"
    )
    where = f" ({where})" if where else ""  # torch < 2.8 names neither the frame nor the guards
    return (
        f"torch.compile would compile during the capture{where}: {because}\n"
        "A CUDA graph cannot record a compilation (inductor runs work of its own on the capturing stream), "
        "so the capture stopped before it; nothing ran."
    )


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _dynamo_utils() -> Any:
    return sys.modules.get("torch._dynamo.utils")


def _failures(utils: Any) -> dict:
    failures = getattr(utils, "guard_failures", None)
    return failures if isinstance(failures, dict) else {}
