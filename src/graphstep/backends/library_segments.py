"""Library calls that read one value on the host, run as eager segments of a captured step.

A few calls of the standard training stack synchronise with the host only to decide something,
and otherwise work on tensors alone. A CUDA graph cannot hold the decision, but the call is
self-contained: it can run eagerly between two graph replays (an eager segment, see
`segments.py`) and give exactly what eager gives. While a step warms up or is captured
(`calls_as_segments`), graphstep routes just the synchronising part of each through a segment:

| call | what reads the host | in the graphs | in the segment |
|---|---|---|---|
| `GradScaler.step(opt)`, `opt` not fused | `found_inf` (skip the step?) | `unscale_`, `update` | the inf check and `opt.step()` |
| `clip_grad_norm_(error_if_nonfinite=True)` | is the norm finite? | the norm, the clipping | the check (raises as eager) |
| `AveragedModel.update_parameters(model)` | `n_averaged` (copy or average?) | - | the whole update (SWA, EMA) |

A fused optimizer (`fused=True` Adam, AdamW, SGD) unscales and skips on the device: GradScaler
needs no segment then, and the step stays in one graph. Everything else the training stack does
on the host either never syncs (`unscale_`, `update`, `clip_grad_value_`), runs eagerly already
(an optimizer whose step reads the host: `optim/`), or shapes the rest of the step (argument
validation of `torch.distributions`, boolean-mask indexing) and is refused at capture with what to
write instead (`diagnostics.host_sync_hint`).

Each segment costs, per step, one wait for the GPU (the host reads the value) and the host time of
the eager part; the log line at capture says which call became a segment and what it cost in the
last warm-up. Patches are installed only while a step warms up or captures: outside graphstep, and
in another thread meanwhile, the calls run as torch wrote them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..diagnostics import expected_host_reads, log
from . import segments

_local = threading.local()
_lock = threading.Lock()
_installed = 0


@dataclasses.dataclass
class _Call:
    """One kind of library call that became a segment in a step: what the log line says."""

    why: str
    instead: str
    calls: int = 0
    host_s: float = 0.0
    """Host time of the eager parts, the waits for the GPU excluded (measured in warm-up only)."""


@dataclasses.dataclass
class _Phase:
    step_name: str
    capturing: bool
    calls: dict[str, _Call] = dataclasses.field(default_factory=dict)


_host_s: dict[tuple[str, str], float] = {}
"""(step name, call name) -> host seconds of one call's eager part in the last warm-up."""


@contextlib.contextmanager
def calls_as_segments(
    step_name: str, *, capturing: bool, log_at_capture: bool = True
) -> Iterator[dict[str, str]]:
    """While a step warms up (`capturing=False`) or is captured: route the synchronising library
    calls it makes through eager segments. At the end of a successful capture, one log line per
    kind of call that became a segment (`log_at_capture`: the backend makes real graphs). Yields a
    dict it fills: each call that became a segment -> what the log line says of it (for
    `graphstep.explain`)."""
    phase = _Phase(step_name, capturing)
    previous = getattr(_local, "phase", None)
    _install()
    _local.phase = phase
    described: dict[str, str] = {}
    try:
        yield described
    finally:
        _local.phase = previous
        _uninstall()
    for name, call in phase.calls.items():
        described[name] = f"{call.why}. {call.instead}"
        if not capturing:
            _host_s[step_name, name] = call.host_s / call.calls
        elif log_at_capture:
            _log(step_name, name, call)


def _log(step_name: str, name: str, call: _Call) -> None:
    n = call.calls
    log.warning(
        "graphstep: %s: %s runs as an eager segment between graph replays (%d call%s per step): %s. "
        "Per step that costs %d wait%s for the GPU and %.2f ms of host time (measured in the last "
        "warm-up). %s",
        step_name,
        name,
        n,
        "" if n == 1 else "s",
        call.why,
        n,
        "" if n == 1 else "s",
        1e3 * _host_s.get((step_name, name), 0.0) * n,
        call.instead,
    )


def _expected(fn: Callable[[], None]) -> Callable[[], None]:
    def segment() -> None:
        with expected_host_reads():
            fn()

    return segment


def _as_segment(name: str, why: str, instead: str, fn: Callable[[], None], reads: torch.Tensor) -> None:
    """Run `fn()` (it returns nothing the step uses) as an eager segment of the step being warmed
    up or captured, or simply call it outside graphstep. `reads`: the tensor it reads on the host."""
    phase: _Phase | None = getattr(_local, "phase", None)
    if phase is None:
        fn()
        return
    call = phase.calls.setdefault(name, _Call(why, instead))
    fn = _expected(fn)
    call.calls += 1
    if phase.capturing:
        segments.run(fn, (), {}, name, returns_none=True)
        return
    # Warm-up runs eagerly and `fn` waits for the GPU anyway: wait first, so that what is timed
    # is the host's own work (an optimizer's launches), what the segment adds to a replay.
    if reads.is_cuda:
        torch.cuda.synchronize(reads.device)
    start = time.perf_counter()
    segments.run(fn, (), {}, name, returns_none=True)
    call.host_s += time.perf_counter() - start


# -- GradScaler.step ------------------------------------------------------------------------------

_GradScaler = torch.amp.grad_scaler.GradScaler
_original_maybe_opt_step = getattr(_GradScaler, "_maybe_opt_step", None)


def _maybe_opt_step(self, optimizer, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
    """GradScaler's "step unless an inf was found", the one host read of `GradScaler.step` for an
    optimizer that does not unscale itself. `unscale_` before it and `update` after it stay in
    the graphs; this part runs eagerly with the `found_inf` tensors the graph before it writes.

    GradScaler forgets them at `update()`: the segment keeps its own dict of the same tensors, so
    that every replay reads what that replay's graph wrote."""
    if getattr(_local, "phase", None) is None or not optimizer_state["found_inf_per_device"]:
        return _original_maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs)
    found = {"found_inf_per_device": dict(optimizer_state["found_inf_per_device"])}
    name = f"GradScaler.step({type(optimizer).__qualname__})"
    _as_segment(
        name,
        "it reads found_inf on the host to skip a step with inf/NaN gradients, and "
        f"{type(optimizer).__qualname__} does not skip on the device",
        "fused=True (Adam, AdamW, SGD) unscales and skips on the device and keeps the step in one graph.",
        lambda: _original_maybe_opt_step(self, optimizer, found, *args, **kwargs),
        next(iter(found["found_inf_per_device"].values())),
    )
    return None


# -- clip_grad_norm_(error_if_nonfinite=True) -----------------------------------------------------

_clip_grad = torch.nn.utils.clip_grad
_original_total_norm = getattr(_clip_grad, "_get_total_norm", None)


def _get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
    """The total norm for `clip_grad_norm_`: computed in the graph; with `error_if_nonfinite`,
    the check that reads it on the host runs as an eager segment and raises torch's own error."""
    if not error_if_nonfinite or getattr(_local, "phase", None) is None:
        return _original_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    total = _original_total_norm(tensors, norm_type, False, foreach)

    def check() -> None:
        if not bool(torch.isfinite(total)):
            # Computed again with the check on, from the same gradients: torch raises its own error.
            _original_total_norm(tensors, norm_type, True, foreach)

    _as_segment(
        "clip_grad_norm_(error_if_nonfinite=True)",
        "it reads on the host whether the gradients' total norm is finite (the norm and the clipping "
        "stay in the graphs)",
        "The default error_if_nonfinite=False keeps the step in one graph; return the norm from the step "
        "and check it outside if you need to stop.",
        check,
        total,
    )
    return total


# -- AveragedModel.update_parameters (SWA, EMA) ----------------------------------------------------

_AveragedModel = torch.optim.swa_utils.AveragedModel
_original_update_parameters = _AveragedModel.update_parameters


def _update_parameters(self, model: torch.nn.Module) -> None:
    """An SWA or EMA update: it reads its count (`n_averaged`) on the host to choose between copying
    and averaging, and otherwise writes only the averaged tensors and the count, in place."""
    _as_segment(
        "AveragedModel.update_parameters",
        "it reads n_averaged on the host (the first update copies, later ones average)",
        "An average written on the device stays in the graph: e.g. an EMA as "
        "`torch._foreach_lerp_(ema_params, params, 1 - decay)` on lists of tensors.",
        lambda: _original_update_parameters(self, model),
        self.n_averaged,
    )


# -- installing the patches ------------------------------------------------------------------------

_PATCHES = [
    (_GradScaler, "_maybe_opt_step", _original_maybe_opt_step, _maybe_opt_step),
    (_clip_grad, "_get_total_norm", _original_total_norm, _get_total_norm),
    (_AveragedModel, "update_parameters", _original_update_parameters, _update_parameters),
]
"""(owner, attribute, torch's function, graphstep's); a torch without the attribute keeps its own
(its host sync then meets a `HostSyncError` that says what to do)."""


def _install() -> None:
    global _installed
    with _lock:
        if _installed == 0:
            for owner, attr, original, patched in _PATCHES:
                if original is not None:
                    setattr(owner, attr, patched)
        _installed += 1


def _uninstall() -> None:
    global _installed
    with _lock:
        _installed -= 1
        if _installed == 0:
            for owner, attr, original, _ in _PATCHES:
                if original is not None:
                    setattr(owner, attr, original)
