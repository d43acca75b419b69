"""`graphstep.Config`: every knob of a captured step, frozen and keyword-only."""

from __future__ import annotations

import dataclasses
from typing import Literal

OutputMode = Literal["clone", "graph"]
Fallback = Literal["raise", "eager"]
Backend = Literal["auto", "cuda", "eager", "recording"]
Check = Literal["full", "strict", "off"]
OptimizerMode = Literal["auto", "graph", "eager"]
GraphBreaks = Literal["auto", "off"]
VerifyAgainst = Literal["eager", "capture"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    warmup_steps: int = 3
    """Eager calls per input signature before capture. They are real training steps, run on the
    capture stream inside the step's memory pool. Three covers lazily created state: AdamW creates
    its moments on step 1. A step with a DDP module warms up at least 11 times (DDP rebuilds its
    buckets after step 1 and records timing events during its first 10 iterations)."""

    max_graphs: int = 8
    """Most input signatures (shapes, dtypes, Python values) captured at once. Each holds one graph;
    all share one memory pool. Past this, `on_too_many_graphs` decides."""

    on_too_many_graphs: Fallback = "raise"
    """"raise": a `TooManyGraphsError` listing the signatures seen. "eager": run the new signature
    eagerly, with a warning once per signature."""

    outputs: OutputMode = "clone"
    """"clone": tensors returned are the caller's: later calls never change them (small outputs come
    out of a ring of two slots the graph writes, moved to a copy only if still held when their slot
    comes round again; see backends/output_ring.py; larger ones are copied per call). "graph": tensors
    returned are the graph's own output buffers, overwritten by the next call of this step: copy them
    to keep them."""

    backend: Backend = "auto"
    """"auto": CUDA graphs when the step's tensors are on a CUDA device, eager otherwise (one log
    notice). "eager": never capture. "recording": a CPU stand-in for a CUDA graph that records the
    step's operations at capture and replays exactly those operations on the same memory, for tests."""

    check: Check = "full"
    """Guards run before every replay (see `guards/`). "full": the storage of every parameter,
    buffer and closure tensor, grads, module modes, optimizer param groups and hyperparameters,
    the optimizer's state object, closure objects. "strict": also every optimizer state tensor's
    storage, and every tracked tensor's shape, dtype and stride. "off": no checks; a changed
    parameter or hyperparameter then silently differs from eager. Measured costs are in the README."""

    max_recaptures: int = 4
    """Re-captures allowed per signature after a guard found state replaced (a parameter's
    storage moved, an object rebound). Past this, `on_recapture_limit` decides. Variants (a graph
    per value of modes, requires_grad, module attributes, globals) do not count: `max_graphs` does."""

    optimizer_mode: OptimizerMode = "auto"
    """Where each optimizer's `step()` runs. "graph": inside the graph; a change to a hyperparameter
    it reads as a Python number re-captures. "eager": as an eager segment between graph replays,
    every call (a host round trip per call; any hyperparameter, any optimizer). "auto": in the
    graph, and an optimizer moves to an eager segment, once, the first time such a hyperparameter
    changes, or at capture if its state holds Python numbers (a custom optimizer's step counter)."""

    graph_breaks: GraphBreaks = "auto"
    """What a capture that stops at an operation no CUDA graph can record does. "auto": the innermost
    module (or known function, such as `F.ctc_loss`) around the failing line runs eagerly from then on,
    forward and backward, between the graphs of the rest of the step (a graph break: one log line,
    `stats.graph_breaks`); results stay bitwise equal to eager. "off": the capture is refused with the
    line and what to write instead. A break costs the host time of that piece on every call."""

    on_recapture_limit: Fallback = "raise"
    """"raise": a `StaleGraphError` naming what changed. "eager": run that signature eagerly from
    then on, with a warning."""

    verify_every: int = 0
    """Every N-th replay (0: never), also run the step eagerly from a snapshot of the state and
    compare: debug mode for "is this replay really what eager does?". Costs a state copy and an
    eager step each time."""

    verify_against: VerifyAgainst = "eager"
    """What `verify_every` compares a replay with. "eager": the step run eagerly. "capture": a graph
    captured afresh for the same call from the same state, which catches a stale baked value
    without being fooled by libraries that take another code path while a stream captures
    (transformers skips host-side checks and builds explicit masks then)."""

    verify_tolerance: float = 0.0
    """0: verification is bitwise (`torch.equal`). Otherwise the largest allowed
    `|replay - eager| / max(|eager|, 1e-12)` per tensor, for kernels that are not deterministic."""

    allow_python_writes: bool = False
    """False: a capture whose code (yours, not a library's) writes Python state that outlives the call
    — an attribute (`self.seen += 1`), a global, a closure variable, the contents of a list or dict
    reached from outside the step (`self.history.append(loss)`) — is refused with a `PythonWriteError`
    naming the line, and the writes are undone: a replay runs no Python, so it would never write them
    again. True: such writes happen in warm-up and at capture only, as for any Python in the step; for
    writes that change nothing the step computes (a debug note, a flag set to the same value)."""

    strict_reads: bool = False
    """False: an object the step's code reads whose contents no guard can watch — an object of a
    library class that is no config graphstep knows (OmegaConf, ml_collections, pydantic, attrs,
    argparse, any Mapping or Sequence are read by content, like dicts and dataclasses), an object of
    a C type, a NumPy array, a container of more than 1,000 entries — is named, with the line that
    read it, in one warning at capture; a change to it between calls is not seen. True: such a read
    fails the capture with an `UnwatchedReadError` (rolled back like any failed capture). Objects
    marked with `graphstep.unchanging(obj)` are accepted either way."""

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
        _check_choice("check", self.check, Check)
        _check_choice("on_recapture_limit", self.on_recapture_limit, Fallback)
        _check_choice("optimizer_mode", self.optimizer_mode, OptimizerMode)
        _check_choice("graph_breaks", self.graph_breaks, GraphBreaks)
        _check_choice("verify_against", self.verify_against, VerifyAgainst)
        for name in ("allow_python_writes", "strict_reads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("max_recaptures", "verify_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Config.{name} must be an int >= 0, got {value!r}.")
        if not (isinstance(self.verify_tolerance, (int, float)) and self.verify_tolerance >= 0):
            raise ValueError(f"Config.verify_tolerance must be a number >= 0, got {self.verify_tolerance!r}.")


def _check_choice(name: str, value: object, choices: object) -> None:
    allowed = choices.__args__  # type: ignore[attr-defined]
    if value not in allowed:
        raise ValueError(f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
