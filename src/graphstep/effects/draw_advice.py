"""Where a random draw on the host happened, and what to write instead: the text of
`HostRandomError` and of `graphstep.explain`'s hazard for it.

The line named is the user's (the innermost frame of user code); a library that drew on the
user's behalf (transformers, torchvision) is named too. The fix depends on the pattern: a draw
that decides a Python `if` moves to the device with `torch.where`; a number used as a value
(mixup's λ) is drawn outside and passed in as a 0-d device tensor; transformers' LayerDrop is
switched off, or the step runs without graphs.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import random
import types

import torch

from ..guards.reads import is_user_file

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(random.__file__)) + os.sep


@dataclasses.dataclass(frozen=True)
class Draw:
    """One host draw seen at capture."""

    generator: str
    site: str | None
    """The user's line (`file:line in function: `code``); None where no line was seen."""
    inner: str | None = None
    """The line of a library (transformers, torchvision) that drew on the user's behalf."""
    pattern: str = "value"
    """"branch" (a Python `if` on the draw), "value" (the number is used), "layerdrop" (transformers)."""
    detail: str = ""

    def describe(self) -> str:
        where = self.site or "a line graphstep did not see (the generator's state changed during the call)"
        return f"{self.generator} at {where}" + (f", drawn inside {self.inner}" if self.inner else "")


def outside_library(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame that is neither torch's nor graphstep's nor the standard library's."""
    while frame is not None and _is_infrastructure(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _is_infrastructure(filename: str) -> bool:
    path = os.path.abspath(filename)
    if is_user_file(filename):
        return False
    return (
        path.startswith((_TORCH_DIR, _STDLIB_DIR))
        or filename.startswith("<")
        or (os.sep + "graphstep" + os.sep) in path
    )


def _line(frame: types.FrameType, offset: int = 0) -> str:
    code = frame.f_code
    return linecache.getline(code.co_filename, frame.f_lineno + offset).strip()


def _site(frame: types.FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}: `{_line(frame)}`"


def draw_at(generator: str, frame: types.FrameType | None, pattern: str | None) -> Draw:
    inner = outside_library(frame)
    user = inner
    while user is not None and not is_user_file(user.f_code.co_filename):
        user = user.f_back
    if user is None:
        user = inner
    if user is None:
        return Draw(generator, None, pattern=pattern or "value")
    detail = ""
    probe = inner
    while probe is not None and not detail:  # transformers' LayerDrop, or a module written like it
        owner = probe.f_locals.get("self")
        rate = getattr(owner, "layerdrop", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            detail = f"{type(owner).__qualname__}.layerdrop={rate}"
        probe = None if probe is user else probe.f_back
    if detail:
        pattern = "layerdrop"
    elif pattern is None:
        pattern = "branch" if _decides_a_branch(inner) or _decides_a_branch(user) else "value"
    return Draw(generator, _site(user), None if inner is user else _site(inner), pattern, detail)


def layerdrop_off(frame: types.FrameType | None) -> str:
    """`Class.layerdrop=0` when `frame` runs a module whose LayerDrop is off, else "". Older
    transformers draw `torch.rand([])` per layer in training even then: the value decides nothing
    (`p < 0` never holds), only the generator's advance matters."""
    owner = frame.f_locals.get("self") if frame is not None else None
    rate = getattr(owner, "layerdrop", None)
    if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate == 0:
        return f"{type(owner).__qualname__}.layerdrop=0"
    return ""


def _decides_a_branch(frame: types.FrameType) -> bool:
    """The drawing line is an `if` (or a conditional expression), or assigns a name that one of
    the next three lines tests: `p = torch.rand([])` then `if p < rate:`."""
    text = _line(frame)
    if text.startswith(("if ", "elif ", "while ", "assert ")) or " if " in text:
        return True
    target = text.split("=", 1)[0].strip() if "=" in text and "==" not in text.split("=", 1)[0] else ""
    if not target.isidentifier():
        return False
    for offset in (1, 2, 3):
        after = _line(frame, offset)
        if after.startswith(("if ", "elif ", "while ")) and target in after:
            return True
    return False


_FIXES = {
    "branch": (
        "draw on the device inside the step and choose with `torch.where` instead of a Python `if`, "
        "e.g. `flip = torch.rand((), device=x.device) < 0.5` then `x = torch.where(flip, x.flip(1), x)`: "
        "a graph advances the device's generator on every replay. Or move the choice into a function "
        "marked `@graphstep.eager_segment`, which runs on every replay (a host round trip each)"
    ),
    "value": (
        "draw the number outside the step and pass it in as a 0-d tensor on the device, e.g. "
        "`lam = torch.tensor(np.random.beta(0.4, 0.4), device=x.device)` then `train_step(x, y, lam)` "
        "(copied in on every call, no new graph); or draw it on the device inside the step "
        "(`torch.rand((), device=x.device)`)"
    ),
    "layerdrop": (
        "transformers' LayerDrop ({detail}) skips layers by a number drawn on the CPU and tested in "
        "Python. Build the model with `encoder_layerdrop=0` and `decoder_layerdrop=0` (`layerdrop=0` "
        "where the config has one), or set `.layerdrop = 0` on those modules; to keep LayerDrop, run "
        'this step without graphs: `graphstep.Config(backend="eager")`'
    ),
}


def refusal_message(step_name: str, draws: list[Draw]) -> str:
    listed = "\n".join(f"  - {d.describe()}" for d in draws)
    fixes = []
    for draw in draws:
        fix = _FIXES[draw.pattern].format(detail=draw.detail)
        if fix not in fixes:
            fixes.append(fix)
    return (
        f"capturing {step_name} drew random numbers on the host:\n{listed}\n"
        "A graph replays no Python and advances no host generator: every replay would repeat this "
        "one draw, and the generator would stop advancing.\n"
        "What to do: " + "\nOr, for the draw above: ".join(fixes) + ".\n"
        "Nothing was lost: the model, optimizer, inputs and random generators are as they were "
        "before this call, and the step can be called again. Warm-up calls draw freely."
    )


def hazard(draw: Draw) -> str:
    """One line of `graphstep.explain`'s hazards for a host draw."""
    return (
        f"host random draw: {draw.describe()}. A capture refuses it (a graph would repeat this one draw "
        f"on every replay). What to do: {_FIXES[draw.pattern].format(detail=draw.detail)}"
    )
