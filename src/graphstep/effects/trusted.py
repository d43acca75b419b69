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

TRUSTED: dict[str, str | None] = {
    "graphstep": "graphstep's own bookkeeping (guards, segments, live hyperparameters): it redoes per call what "
    "a replay needs",
    "graphstep.demo": None,  # the demo is a training script like the user's
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
