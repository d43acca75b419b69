"""`graphstep.explain(step, *args, **kwargs)`: what capture would do with this call, before it does.

Runs the step once eagerly as a dry run (its writes, grads, optimizer state and RNG are taken
back afterwards) and reports: which inputs are copied into static buffers and which Python
values become part of the graph's key, which state the guards will watch, and the hazards it
finds: host syncs and random draws on the host (with the user's line), CPU tensors next to GPU
ones, module hooks (they run only at capture), optimizers it refuses or runs eagerly, numbers in
the key that may change, objects the step's code reads whose contents no guard watches (a
container of more than 1,000 entries, an object of a library class that is no config; each with the
line that read it), and Python
state the step itself writes (a replay does not write it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from . import effects
from . import signature as sig
from .backends import library_segments
from .backends.recording import python_host_reads
from .backends.undo import UndoLog
from .capture import CapturedStep
from .diagnostics import HostSyncWatch
from .effects import draw_advice, host_random
from .guards.barriers import is_simple
from .guards.read_guard import ReadGuard
from .guards.reads import Reads, ReadWatch
from .guards.state_guard import bindings, named_state_tensors
from .optim import table
from .optim.plan import eager_only_reason
from .optim.python_state import StepObserver
from .state import Snapshot


@dataclasses.dataclass
class Explanation:
    backend: str
    signature: str
    copied: list[str]
    key_values: list[str]
    guarded: dict[str, int]
    bindings: list[str]
    hazards: list[str]
    reads: list[str] = dataclasses.field(default_factory=list)
    """Python values the step's code read, guarded by value or identity (`label = value`)."""
    optimizers: list[str] = dataclasses.field(default_factory=list)
    """Where each optimizer's step will run (in the graph or an eager segment), and why."""
    graph_breaks: list[str] = dataclasses.field(default_factory=list)
    """Pieces that run (or, by this dry run's host syncs, will run) eagerly between the graphs."""

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", f"signature: {self.signature}"]
        lines.append(
            "copied into static buffers before each replay: " + (", ".join(self.copied) or "nothing")
        )
        lines.append("Python values in the graph's key: " + (", ".join(self.key_values) or "none"))
        lines.append("guarded before each replay: " + ", ".join(f"{n} {k}" for k, n in self.guarded.items()))
        if self.bindings:
            lines.append("closure and global objects watched: " + ", ".join(self.bindings))
        if self.optimizers:
            lines.append("optimizers:")
            lines += [f"  - {o}" for o in self.optimizers]
        if self.graph_breaks:
            lines.append("graph breaks (run eagerly, forward and backward, between graphs):")
            lines += [f"  - {b}" for b in self.graph_breaks]
        if self.reads:
            lines.append("Python values the step's code reads, compared before each replay:")
            lines += [f"  - {r}" for r in self.reads]
        lines.append("hazards:" if self.hazards else "hazards: none found")
        lines += [f"  - {h}" for h in self.hazards]
        return "\n".join(lines)


def explain(step: CapturedStep, *args: Any, **kwargs: Any) -> Explanation:
    """Describe how `step` would be captured for a call with these arguments (a dry run)."""
    if not isinstance(step, CapturedStep):
        raise TypeError(f"explain() takes a graphstep.CapturedStep; got {type(step).__qualname__}.")
    signature, leaves = sig.Signature.of(args, kwargs)
    ctx = step._context_for(leaves)
    backend = ctx.backend
    state, fn = step._state, step._fn
    hazards: list[str] = []

    copied, key_values = [], []
    metas = iter(signature.tensors)
    for path, leaf in sig.argument_paths(signature.spec):
        if sig.is_tensor_leaf(leaf):
            copied.append(f"{path} ({next(metas)})")
        else:
            value = sig.value_of(leaf)
            key_values.append(f"{path}={value!r}")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                hazards.append(
                    f"{path} is a Python {type(value).__name__} in the key: each new value captures a new graph "
                    "(max_graphs applies). Pass a 0-d tensor if it changes from call to call."
                )

    devices = {t.device.type for t in leaves} | {d.type for d in state.devices()}
    if "cuda" in devices and "cpu" in devices:
        cpu = [p for p, _ in zip(copied, leaves) if "on cpu" in p]
        hazards.append(
            "CPU tensors next to GPU ones"
            + (f" ({', '.join(cpu)})" if cpu else "")
            + ": CPU work runs only at capture, and host inputs are staged through pinned buffers with a "
            "synchronisation. Move them to the GPU first."
        )

    for prefix, root in state.named_modules_roots():
        for name, m in root.named_modules():
            hooks = [
                h
                for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                if getattr(m, h, None)
            ]
            if hooks:
                hazards.append(
                    f"{prefix}{'.' + name if name else ''} has {', '.join(h.strip('_') for h in hooks)}: their Python runs "
                    "at capture only; tensor work they do is replayed, anything else (counters, logging) is not."
                )

    for opt in state.optimizers:
        # graphstep itself makes an optimizer capturable (or fused) on the first call: only a class
        # it refuses, or one whose step reads the host every time, is worth a line.
        refused = table.torch_class(opt, table.REFUSED)
        eager_only = eager_only_reason(opt, on_device="cuda" in devices)
        if refused is not None:
            hazards.append(table.REFUSED[refused])
        elif eager_only:
            hazards.append(
                f"{type(opt).__name__}.step() will run as an eager segment between graph replays (one wait "
                f"for the GPU per call): {eager_only}"
            )

    reads = Reads.of_function(fn)
    refused_attributes: set[tuple[int, str]] = set()
    observer = StepObserver(host_tensors=bool(backend.cuda_devices))
    breaks = [f"{b.name}: made when a capture stopped at {b.line}" for b in ctx.breaks.made]
    if backend.static_buffers:
        with observer.watching(state.optimizers):
            syncs, reads, effects_found, segments, refused_attributes, predicted = _dry_run(
                step, backend, args, kwargs, ctx.breaks.predicted
            )
        breaks += [f"{name}: will be made at capture (it reads the host)" for name in predicted]
        hazards += [f"host sync at {site}" for site in syncs] + effects_found
        hazards += [
            f"{name} runs as an eager segment between graph replays (one wait for the GPU per call): {why}"
            for name, why in segments.items()
        ]
    read_guard = ReadGuard(reads)
    hazards += _read_hazards(state, reads, read_guard, refused_attributes)

    named = list(named_state_tensors(state, fn))
    guarded = {
        "parameters and buffers": sum(
            1 for n, _ in named if n.startswith(tuple(p for p, _ in state.named_modules_roots()))
        ),
        "optimizer state tensors": sum(1 for n, _ in named if ".state[" in n),
        "modules (train/eval, Python attributes)": sum(
            1 for _, r in state.named_modules_roots() for _ in r.modules()
        ),
        "parameters (requires_grad)": len(state.parameters()),
        "optimizers (param groups, hyperparameters)": len(state.optimizers),
        "globals and closure variables the step's code reads": len(read_guard.objects()),
    }
    return Explanation(
        backend=backend.name,
        signature=signature.describe(),
        copied=copied,
        key_values=key_values,
        guarded=guarded,
        bindings=[label for label, _, _ in bindings(fn)],
        hazards=hazards,
        reads=[f"{label} = {value!r}" for label, value in read_guard.objects() if is_simple(value)]
        + read_guard.contents.describe(),
        optimizers=[ctx.modes.explain(opt, observer) for opt in state.optimizers]
        if backend.static_buffers
        else [],
        graph_breaks=breaks,
    )


def _read_hazards(
    state: Any, reads: Reads, guard: ReadGuard, refused_attributes: set[tuple[int, str]]
) -> list[str]:
    """Reads no guard can watch, and values the step writes (left out of the guards); a module
    attribute whose write a capture refuses is listed once, with the refusal."""
    hazards = []
    if not reads.complete:
        hazards.append(
            "another profiler was active, so the globals read by the step's helpers could not be watched; "
            "only the step function's own are guarded"
        )
    hazards += [
        f"{what}: a change to it between calls is not seen (Config(strict_reads=True) refuses it at "
        "capture). Keep such numbers in dicts, dataclasses, config objects or globals of their own, pass "
        "them as tensors, or mark an object that never changes with graphstep.unchanging(obj)"
        for what in guard.unwatched
    ]
    names = {id(m): n for prefix, root in state.named_modules_roots() for n, m in _named(prefix, root)}
    written = [
        f"{names[i]}.{attr}"
        for i, attr in sorted(reads.module_writes, key=str)
        if i in names and (i, attr) not in refused_attributes
    ]
    written += reads.written + guard.written
    hazards += [
        f"{what} is written by the step: a replay runs no Python, so it keeps the value of the capture "
        "(and a change to it between calls is not guarded). Return such values from the step instead"
        for what in written
    ]
    return hazards


def _named(prefix: str, root: Any) -> list[tuple[str, Any]]:
    return [((f"{prefix}.{name}" if name else prefix), m) for name, m in root.named_modules()]


def _dry_run(
    step: CapturedStep, backend: Any, args: tuple, kwargs: dict, locate: Any
) -> tuple[list[str], Reads, list[str], dict[str, str], set[tuple[int, str]], list[str]]:
    """Run the step once eagerly, note its host syncs, its host random draws and Python writes (and
    prints), the library calls that would run as eager segments and what its Python reads, and take
    everything it did to Python state, tensors and
    generators back."""
    refs = Snapshot.take(step._state, backend.cuda_devices)
    undo = UndoLog()
    # What a capture would refuse, found and taken back (the eager backend refuses nothing).
    python = effects.WriteWatch(step._name, enabled=backend.static_buffers, report=True)
    draws = host_random.HostRandomWatch(
        step._name,
        "cuda" if backend.cuda_devices else "cpu",
        host_random.reach_of(step._fn, args, kwargs),
        refuse=False,
        restore=True,
    )
    try:
        arguments = sig.non_tensor_arguments(args, kwargs)
        with (
            HostSyncWatch(cuda=backend.name == "cuda", locate=locate) as watch,
            # `tolist()` / `numpy()` read a CPU tensor without an ATen call the watch could see
            python_host_reads(lambda _: watch.note()) if backend.name != "cuda" else contextlib.nullcontext(),
            library_segments.calls_as_segments("explain", capturing=False) as segments,
            ReadWatch(arguments) as reads,
            draws,
            undo,
            python,
        ):
            step._fn(*args, **kwargs)
    finally:
        undo.roll_back()
        refs.restore()
    hazards = [draw_advice.hazard(d) for d in draws.draws]
    hazards += [
        f"writes Python state that outlives the call (a capture refuses it with PythonWriteError): {w}"
        for w in python.found
    ]
    hazards += [
        f"prints or logs (on warm-ups and at capture only, not on replays): {p}" for p in python.prints
    ]
    return watch.sites, reads.reads, hazards, segments, python.found_attributes, watch.breaks
