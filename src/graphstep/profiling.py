"""Named ranges for profilers: where a captured step's time goes, in torch.profiler traces and Nsight.

`ranged(name)` opens one range under two tools at once:

- `torch.profiler` (and the legacy `torch.autograd.profiler.profile`): a `record_function` range,
  shown as a row of its own in the trace (TensorBoard, chrome://tracing, Perfetto);
- Nsight Systems (`nsys profile`): an NVTX range, pushed whenever CUDA is available.

graphstep's lifecycle opens these around each phase of a call, so a trace shows which calls warmed
up, which captured and which replayed:

| range | around |
|---|---|
| `graphstep.warmup` | one eager warm-up call of the step |
| `graphstep.capture` | recording the graph (and the replay that performs the capturing call's step) |
| `graphstep.replay` | loading the inputs and launching the graph |
| `graphstep.eager_segment` | a part of the step run eagerly between graph replays |

Cost: `record_function` costs about 6 µs per range on a CPU even when no profiler runs (torch 2.13,
measured on the CI machine), so it is entered only while a profiler is active
(`torch._C._autograd._profiler_enabled()`, 0.04 µs). With neither a profiler nor CUDA a range
costs about 0.4 µs. An NVTX push and pop per replay cost several µs on the H100 host that measured
them, with no Nsight tool attached: leaving them out is part of the drop of graphstep's own time per
replayed call from 41 to 19 µs (benchmarks/results/h100_2026-11-25_host-cost*.json, with the other
changes of that day). So NVTX ranges are pushed, with CUDA, around the phases
that run rarely (warm-up, capture, eager segments) always, and around replays only when a tool is
attached: `NVTX_INJECTION64_PATH` is set, the usual way an NVTX tool attaches to a process. Newer
NVTX versions can also find a tool through the CUDA driver, which this check does not see:
`GRAPHSTEP_NVTX=1` pushes replay ranges in any case, `GRAPHSTEP_NVTX=0` leaves NVTX out altogether.
"""

from __future__ import annotations

import os
from types import TracebackType

import torch

__all__ = ["CAPTURE", "EAGER_SEGMENT", "REPLAY", "WARMUP", "listening_to_replays", "ranged"]

WARMUP = "graphstep.warmup"
CAPTURE = "graphstep.capture"
REPLAY = "graphstep.replay"
EAGER_SEGMENT = "graphstep.eager_segment"

try:  # a C call; present in every torch graphstep supports (2.6+)
    _profiler_enabled = torch._C._autograd._profiler_enabled
except AttributeError:  # pragma: no cover - a torch without it: ask the Python flag instead

    def _profiler_enabled() -> bool:
        return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


_nvtx_available: bool | None = None  # decided on the first range: asking CUDA at import is a side effect
_nvtx_on_replays: bool | None = None


def _use_nvtx() -> bool:
    global _nvtx_available
    if _nvtx_available is None:
        wanted = os.environ.get("GRAPHSTEP_NVTX", "") != "0"
        _nvtx_available = wanted and torch.cuda.is_available()
    return _nvtx_available


def listening_to_replays() -> bool:
    """Whether a replay's range would reach anyone: a profiler runs, or NVTX goes to a tool. The
    replay skips the range object altogether when not (the hot path)."""
    return _profiler_enabled() or _use_nvtx_on_replays()


def _use_nvtx_on_replays() -> bool:
    """NVTX around every replay: only while a tool reads it (see the module's docstring)."""
    global _nvtx_on_replays
    if _nvtx_on_replays is None:
        setting = os.environ.get("GRAPHSTEP_NVTX", "")
        wanted = setting == "1" or (setting != "0" and bool(os.environ.get("NVTX_INJECTION64_PATH")))
        _nvtx_on_replays = wanted and _use_nvtx()
    return _nvtx_on_replays


class ranged:
    """`with ranged("graphstep.replay"): ...`: a named range in torch.profiler traces and Nsight.

    Cheap when no profiler runs (see the module's docstring). Ranges nest; each `with` needs its
    own `ranged(...)` object.
    """

    __slots__ = ("_nvtx", "_record", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._record: torch.profiler.record_function | None = None
        self._nvtx = False

    def __enter__(self) -> ranged:
        if _use_nvtx_on_replays() if self.name == REPLAY else _use_nvtx():
            torch.cuda.nvtx.range_push(self.name)
            self._nvtx = True
        if _profiler_enabled():
            self._record = torch.profiler.record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        record, self._record = self._record, None
        if record is not None:
            record.__exit__(exc_type, exc, tb)
        if self._nvtx:
            self._nvtx = False
            torch.cuda.nvtx.range_pop()
