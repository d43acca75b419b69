"""The suites of `graphstep bench` and the methods each runs.

`gpt` (the default): the built-in GPT at two sizes (`workloads.py`), with the hand-written
whole-step graph and the whole step compiled (`compiled_step`, `compiled_step_ro`) as anchors. `models`: real models
no one here wrote (`models.py`).
"""

from __future__ import annotations

from .models import MODEL_CONFIGS
from .workloads import GPT_CONFIGS, BenchConfig

SUITE_METHODS = {
    "gpt": (
        "eager",
        "compile",
        "reduce_overhead",
        "compiled_step",
        "compiled_step_ro",
        "manual_graph",
        "graphstep",
        "graphstep_compiled",
    ),
    # No hand-written graph here: it would bake the schedulers' learning rates and momentum in.
    "models": ("eager", "compile", "reduce_overhead", "graphstep", "graphstep_compiled"),
}


def suites() -> dict[str, dict[str, BenchConfig]]:
    """Every suite's configs, by name."""
    return {"gpt": GPT_CONFIGS, "models": MODEL_CONFIGS}
