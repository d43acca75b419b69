"""Automatic graph breaks: when a capture fails at an operation no CUDA graph can record, the innermost
module (or known library function) around the failing line becomes an eager segment on the autograd
path (`autograd_segments.py`), and the step is warmed up and captured again.

A capture stops at a host sync (`nonzero` in an MoE's token dispatch, `F.ctc_loss` copying its lengths,
a matcher that calls scipy on the host) or at a copy between host and device. The traceback says where:
walking it from the innermost frame out, the first frame that is an `nn.Module`'s `forward`, or a
function graphstep knows to be self-contained (`KNOWN_FUNCTIONS`), is the break. Its forward runs
eagerly between graphs from then on, its backward eagerly between the backward graphs; everything
around it stays captured. A failure in the step function itself, outside any module, cannot be broken
out: the error says what to mark. `Config(graph_breaks="off")` refuses instead, as before.

A module is marked in place (its instance `forward` wrapped, taken off when the step closes); a known
function is replaced in the module that defines it and in the caller's globals (put back at close).
Outside a graphstep warm-up or capture the wrapper calls the original directly.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import signature as sig
from ..diagnostics import is_host_sync, where
from ..errors import GraphStepError, WarmUpAgain
from . import autograd_segments, segments

log = logging.getLogger("graphstep")

KNOWN_FUNCTIONS: dict[str, str] = {
    "torch.nn.functional.ctc_loss": "copies the sequence lengths to the host",
    "load_balancing_loss_func": "transformers' MoE auxiliary loss (counts tokens per expert)",
    "_grouped_mm": "transformers' grouped expert matmul: torch's fallback (not bf16, or no sm90/sm100 kernel) "
    "reads the expert offsets on the host",
}
"""Self-contained functions (qualified name, or a bare name for any module defining it) that become a
break where they fail, rather than the module around them (the whole model, for Mixtral's loss; the
whole experts module, with its routing, sort and gather, for one grouped matmul)."""

_NOT_RECORDABLE = ("stream is capturing", "StreamCapture", "during CUDA graph capture")


@dataclasses.dataclass(eq=False)
class Break:
    """One graph break: what runs eagerly, where the capture stopped, and how it was made."""

    name: str
    segments: list[str]
    """The names of the segments it made (every module of the class)."""
    line: str
    why: str
    undo: Callable[[], None]


class GraphBreaks:
    """The graph breaks of one captured step."""

    def __init__(self, step_name: str, mode: str, roots: Callable[[], list[tuple[str, Any]]], step_code: Any):
        self.step_name = step_name
        self.mode = mode
        self.roots = roots
        self.step_code = step_code
        self.made: list[Break] = []
        self.unlogged: list[Break] = []
        self.moved = False
        """A break moved out to its enclosing module since the last capture (`move_out`)."""
        self.refused: str | None = None
        """Why the last `target_for` found a module around the line but no break can be made there."""

    def after_failed_capture(self, error: BaseException) -> bool:
        """The capture failed with `error`: make a break around its failing line and say so (True),
        or leave the error as it is (False: breaks off, not an operation a graph cannot record, or
        no module or known function around the line)."""
        if (
            isinstance(error, WarmUpAgain) and self.moved
        ):  # the capture after a break moved out: as after a break
            error.after_break, self.moved = True, False
        target = self.target_for(error)
        if target is None:
            if self.refused:
                log.warning("graphstep: %s: no graph break: %s", self.step_name, self.refused)
            return False
        self.make(*target)
        return True

    def target_for(self, error: BaseException) -> tuple[str, Any, str, str, str] | None:
        """The break a capture stopped by `error` calls for: (kind, the module or the frame of the known
        function, its name, where the capture stopped, why), or None (see `after_failed_capture`)."""
        if self.mode != "auto" or isinstance(error, WarmUpAgain):  # (a compile at capture, say)
            return None
        written = [m for m in getattr(error, "modules", ()) if not autograd_segments.is_marked(m)]
        if written:  # a library's writes inside a module's forward: run it eagerly, it repeats them
            target = ("module", written[0], self.path_of(written[0]))
        elif not_recordable(error):
            target = self.target_of(error.__traceback__)
        else:
            return None
        self.refused = None
        if target is None:
            return None
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if target[0] == "module" and self.refused_by_fsdp(target[1], target[2], why):
            return None
        line = where(error.__traceback__) if not written else "the Python state it writes on every call"
        return (*target, line, why)

    def refused_by_fsdp(self, module: torch.nn.Module, name: str, why: str) -> bool:
        """A module with parameters inside an FSDP2 unit cannot run as a segment (sets `refused`): FSDP2's
        hooks, captured in the graphs around it, swap the module's parameters between their gathered and
        sharded forms in Python, which a replay does not run, so between graphs the segment would find
        the sharded ones (and the gathered memory freed). A module without parameters can."""
        if next(module.parameters(), None) is None:
            return False
        units = [p for p, m in self.modules() if hasattr(m, "reshard") and hasattr(m, "_get_fsdp_state")]
        unit = max((p for p in units if name == p or name.startswith(p + ".")), key=len, default=None)
        if unit is None:
            return False
        self.refused = (
            f"the capture stopped inside {name} ({why}), which holds parameters that FSDP2 (fully_shard, "
            f"unit {unit}) gathers and frees around it: as an eager segment between graphs it would not find "
            "them gathered. Move the part no graph can record into a module without parameters (a dispatch that "
            "takes the expert outputs, say), keep it on the device, or run this step without graphstep."
        )
        return True

    def make_named(self, kind: str, name: str, line: str, why: str) -> bool:
        """Make the break another rank's capture called for (`target_for` there): the module at path
        `name`, or the known function `name`. False when it is made already; a `GraphStepError` when this
        rank's model has no such module (the ranks' models differ)."""
        if any(name in made.segments for made in self.made):
            return False
        if kind == "function":
            self.make("function", None, name, line, why)
            return True
        module = dict(self.modules()).get(name)
        if module is None:
            raise GraphStepError(
                f"{self.step_name}: another rank's capture stopped inside {name} and every rank must break "
                "there, but this rank's model has no module of that name. Build the same model on every "
                'rank, or set Config(graph_breaks="off").'
            )
        self.make("module", module, name, line, why)
        return True

    def make(self, kind: str, obj: Any, name: str, line: str, why: str) -> None:
        """Make the break: the module `obj` (and every module of its class) or the known function `name`
        (`obj`: the frame it failed in, or None) runs eagerly from now on."""
        names = [name]
        if kind == "module":
            # Every module of that class runs the same code: it would stop the next capture too.
            modules = [obj] + [m for _, m in self.modules() if type(m) is type(obj) and m is not obj]
            for module in modules:
                if not autograd_segments.is_marked(module):
                    autograd_segments.mark(module, self.path_of(module), self.move_out)
            names = [self.path_of(m) for m in modules]
            if len(modules) > 1:
                name += f" (and the {len(modules) - 1} other {type(obj).__qualname__} modules of the step)"
            undo = lambda marked=modules: [autograd_segments.unmark(m) for m in marked]  # noqa: E731
        else:
            undo = _replace_function(obj, name, [type(m).__module__ for _, m in self.modules()])
        made = Break(name, names, line, why, undo)
        self.made.append(made)
        self.unlogged.append(made)
        log.warning(
            "graphstep: %s: graph break: %s runs eagerly (forward and backward) between graphs from now on; "
            "the capture stopped inside it at %s (%s). One more warm-up, then a capture.",
            self.step_name,
            name,
            made.line,
            why,
        )

    def move_out(self, module: torch.nn.Module, spec: Any) -> bool:
        """A break's module returned (`spec`: its results in a warm-up) what no graph can take from a
        segment (a torchvision `ImageList`): the break moves out to the module that encloses it, which
        returns what its caller gets. False when the results are tensors, or for a module at the top
        of the step (nothing encloses it: the refusal stands)."""
        values = [sig.value_of(leaf) for _, leaf in sig.paths(spec, "result") if not sig.is_tensor_leaf(leaf)]
        returned = next((type(v).__qualname__ for v in values if v is not None), None)
        made = next((b for b in self.made if self.path_of(module) in b.segments), None)
        if returned is None:
            return False
        path = self.path_of(module)
        parent = dict(self.modules()).get(path.rpartition(".")[0]) if "." in path else None
        if made is None or parent is None:
            return False
        made.undo()
        modules = [parent] + [m for _, m in self.modules() if type(m) is type(parent) and m is not parent]
        for m in modules:
            if not autograd_segments.is_marked(m):
                autograd_segments.mark(m, self.path_of(m), self.move_out)
        before, made.name, self.moved = made.name, self.path_of(parent), True
        made.segments = [self.path_of(m) for m in modules]
        made.undo = lambda marked=modules: [autograd_segments.unmark(m) for m in marked]
        log.warning(
            "graphstep: %s: graph break moved out: %s returns a %s, which no graph can take from an eager "
            "segment (only tensors); the module around it, %s, runs eagerly (forward and backward) from the "
            "next call on.",
            self.step_name,
            before,
            returned,
            made.name,
        )
        return True

    def target_of(self, tb: types.TracebackType | None) -> tuple[str, Any, str] | None:
        """The innermost module forward or known function on the traceback, inside the step."""
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        return self.target_in(frames)

    def predicted(self, frames: list[types.FrameType]) -> str | None:
        """For `explain`: the break a capture stopped in `frames` (outermost first) would make."""
        target = self.target_in(frames)
        return None if target is None or self.mode != "auto" else target[2]

    def target_in(self, frames: list[types.FrameType]) -> tuple[str, Any, str] | None:
        for frame in reversed(frames):
            if frame.f_code is self.step_code:
                return None  # reached the step function: nothing around the line to break out
            name = _known_function(frame)
            if name is not None:
                return "function", frame, name
            module = frame.f_locals.get("self")
            if frame.f_code.co_name == "forward" and isinstance(module, torch.nn.Module):
                if autograd_segments.is_marked(module):
                    return None  # already a segment: the failure is elsewhere in it
                return "module", module, self.path_of(module)
        return None

    def modules(self) -> Iterable[tuple[str, torch.nn.Module]]:
        for root_name, root in self.roots():
            for name, sub in root.named_modules():
                yield (f"{root_name}.{name}" if name else root_name), sub

    def path_of(self, module: torch.nn.Module) -> str:
        return next((path for path, sub in self.modules() if sub is module), type(module).__qualname__)

    def logged_after_capture(self, parts: Iterable) -> None:
        """After the first replay of a capture with new breaks (`parts`: its segments, timed as they
        ran): one line each with what it costs the host per call."""
        if not self.unlogged:
            return
        for made in self.unlogged:
            timed = [p for p in parts if getattr(p, "name", None) in made.segments]
            if not timed:  # inside a later break (a matcher inside the loss around it)
                continue
            host = sum(p.host_s for p in timed)
            log.warning(
                "graphstep: %s: captured with a graph break at %s: it costs %.2f ms of host time per call "
                "(forward and backward, as the first replay measured), plus a wait for the GPU wherever it "
                "reads a value on the host. To avoid it, keep that code on the device; "
                'Config(graph_breaks="off") refuses instead.',
                self.step_name,
                made.name,
                host * 1e3,
            )
        self.unlogged = []

    def close(self) -> None:
        for made in reversed(self.made):
            made.undo()
        self.made = []


def not_recordable(error: BaseException) -> bool:
    """`error` stopped a capture at an operation a CUDA graph cannot record (not a bug in the step)."""
    if isinstance(error, segments.ResultsOnHost):
        return True
    text = f"{type(error).__name__}: {error}"
    return is_host_sync(error) or any(needle in text for needle in _NOT_RECORDABLE)


def _known_function(frame: types.FrameType) -> str | None:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "")
    qualified = f"{module}.{code.co_name}"
    if qualified in KNOWN_FUNCTIONS or (
        code.co_name in KNOWN_FUNCTIONS and module.startswith("transformers")
    ):
        return qualified
    return None


def _replace_function(frame: types.FrameType | None, name: str, callers: Iterable[str]) -> Callable[[], None]:
    """Route the known function `name` through a segment where it is looked up: in its module, and in the
    globals of the function that called it (`frame`'s caller; without a frame, another rank's break: of
    the modules named in `callers`, those that hold it). Returns what puts the originals back."""
    module_name, _, attr = name.rpartition(".")
    home = sys.modules[module_name]
    original = getattr(home, attr)

    def segment(*args: Any, **kwargs: Any) -> Any:
        return autograd_segments.run(original, args, kwargs, name)

    places = [home.__dict__]
    caller = frame.f_back if frame is not None else None
    if frame is None:
        found = (vars(sys.modules[m]) for m in dict.fromkeys(callers) if m in sys.modules)
        places += [g for g in found if g.get(attr) is original and g is not home.__dict__]
    elif (
        caller is not None
        and caller.f_globals.get(attr) is original
        and caller.f_globals is not home.__dict__
    ):
        places.append(caller.f_globals)
    for place in places:
        place[attr] = segment

    def undo() -> None:
        for place in places:
            if place.get(attr) is segment:
                place[attr] = original

    return undo
