"""`graphstep.Config`: every knob of a captured step, frozen and keyword-only."""

from __future__ import annotations

import dataclasses
from typing import Literal

OutputMode = Literal["clone", "graph"]
Fallback = Literal["raise", "eager"]
Backend = Literal["auto", "cuda", "eager", "recording"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    warmup_steps: int = 3
    """Eager calls per input signature before capture. They are real training steps, run on the
    capture stream inside the step's memory pool. Three covers lazily created state: AdamW creates
    its moments on step 1, DDP rebuilds its buckets after step 1."""

    max_graphs: int = 8
    """Most input signatures (shapes, dtypes, Python values) captured at once. Each holds one graph;
    all share one memory pool. Past this, `on_too_many_graphs` decides."""

    on_too_many_graphs: Fallback = "raise"
    """"raise": a `TooManyGraphsError` listing the signatures seen. "eager": run the new signature
    eagerly, with a warning once per signature."""

    outputs: OutputMode = "clone"
    """"clone": tensors returned are fresh copies the caller owns. "graph": tensors returned are the
    graph's own output buffers, overwritten by the next call of this step: copy them to keep them.
    "graph" saves one copy per output per step."""

    backend: Backend = "auto"
    """"auto": CUDA graphs when the step's tensors are on a CUDA device, eager otherwise (one log
    notice). "eager": never capture. "recording": a CPU stand-in for a CUDA graph that records the
    step's operations at capture and replays exactly those operations on the same memory, for tests."""

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ValueError(
                f"Config.warmup_steps must be an int >= 1, got {self.warmup_steps!r}: capture needs at least "
                "one eager step first so lazily created state (optimizer moments, grads) exists."
            )
        if not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise ValueError(f"Config.max_graphs must be an int >= 1, got {self.max_graphs!r}.")
        _check_choice("on_too_many_graphs", self.on_too_many_graphs, Fallback)
        _check_choice("outputs", self.outputs, OutputMode)
        _check_choice("backend", self.backend, Backend)


def _check_choice(name: str, value: object, choices: object) -> None:
    allowed = choices.__args__  # type: ignore[attr-defined]
    if value not in allowed:
        raise ValueError(f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
