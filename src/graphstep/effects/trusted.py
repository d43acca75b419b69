"""The code whose writes a capture does not judge, each with the reason: the one list of exceptions.

Where code lives decides nothing: a package from pip that advances a Python counter in the step is as
frozen by a replay as the user's own `self.seen += 1`, so `writes.WriteWatch` judges library code as it
judges the user's. The exceptions are code graphstep knows: its Python writes in a step are
bookkeeping set again to the same effect on every call, redone by graphstep after each replay, or
state whose per-step values are tensors (which the graph updates). A package is named by its module
prefix; the longest prefix that matches decides, and a prefix mapped to None is judged after all.
"""

from __future__ import annotations

import functools
import sys
import types

from ..guards.user_code import is_user_file

TRUSTED: dict[str, str | None] = {
    "graphstep": "graphstep's own bookkeeping (guards, segments, live hyperparameters): it redoes per call what "
    "a replay needs",
    "graphstep.demo": None,  # the demo is a training script like the user's
    "graphstep.bench": None,  # so is the benchmark's step
    "torch": "torch's Python in a step (module calls and their hooks' machinery, autograd, autocast, "
    "checkpointing, DDP and FSDP2, GradScaler, the optimizers' base class) sets the same per-call "
    "bookkeeping on every call; values that change per step are tensors, which the graph updates, and "
    "torch's optimizers keep theirs on the device once graphstep makes them capturable",
    "torch.optim.lr_scheduler": None,  # a scheduler stepped inside the step advances a Python epoch
    "pytorch_lightning": "Lightning's loop bookkeeping: graphstep's Lightning integration captures the "
    "training step alone and redoes `self.log` and the step counters after each replay",
    "lightning": "Lightning's loop bookkeeping (as pytorch_lightning)",
    "lightning_fabric": "Lightning Fabric's bookkeeping (as pytorch_lightning)",
    "transformers.trainer": "the HF Trainer's bookkeeping: graphstep's Hugging Face integration redoes it "
    "after each replay",
    "transformers.utils": "transformers' caches of its own checks and one-time warnings (`warning_once`)",
    "accelerate": "accelerate's gradient-accumulation state and hooks: graphstep's Hugging Face integration "
    "keeps the accumulation counter and redoes its bookkeeping",
    "torchmetrics": None,  # a metric's Python counters in `update` are the user's state
    "omegaconf": "OmegaConf's interpolation parser keeps its position in long-lived lexer objects (scratch "
    "state, reset on every parse); the values a step reads from a config are guarded by content",
}
"""Module prefix -> why its writes are not judged (None: judged after all)."""

_STDLIB = (
    "the standard library: its writes in a step are caches and registries (logging's level cache, "
    "warnings' once-registry, a context manager's own generator), not values a step computes with"
)


@functools.lru_cache(maxsize=8192)
def reason(module: str) -> str | None:
    """Why code of `module` is trusted, or None when its writes are judged."""
    top = module.split(".", 1)[0]
    if top in sys.stdlib_module_names:
        return _STDLIB
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in TRUSTED:
            return TRUSTED[prefix]
    return None


def _generated(filename: str) -> bool:
    """Code made with `exec` (a dataclass's `__init__`, attrs' methods): nobody's line to fix. An
    interactive session's ("<stdin>", "<ipython-input-...>") is the user's."""
    return filename == "<string>" or filename.startswith(("<frozen", "<attrs generated"))


class CodeKinds:
    """Which running code is the user's, and which is judged at all (the user's, and library code
    this list does not trust), cached per code object for one watch."""

    def __init__(self) -> None:
        self._user: dict[types.CodeType, bool] = {}
        self._judged: dict[types.CodeType, bool] = {}

    def is_user(self, code: types.CodeType) -> bool:
        user = self._user.get(code)
        if user is None:
            name = code.co_filename
            user = self._user[code] = not _generated(name) and is_user_file(name)
        return user

    def is_judged(self, frame: types.FrameType) -> bool:
        code = frame.f_code
        judged = self._judged.get(code)
        if judged is None:
            module = frame.f_globals.get("__name__") or ""
            judged = self._judged[code] = not _generated(code.co_filename) and (
                self.is_user(code) or reason(module) is None
            )
        return judged

    def users_caller(self, frame: types.FrameType) -> types.FrameType | None:
        """The innermost user frame that led to library `frame`."""
        caller = frame.f_back
        while caller is not None and not self.is_user(caller.f_code):
            caller = caller.f_back
        return caller
