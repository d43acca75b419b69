"""A stand-in for a user's helper module: a loss whose numbers live outside the step function.

The step in tests/test_guards_reads.py calls these; their globals and closure cells are not the
step's own, so only watching what the step's Python reads can guard them.
"""

from __future__ import annotations

import dataclasses
import types

import torch

TEMPERATURE = 1.0
LOSS_WEIGHT = 1.0  # read as `helpers_reads.LOSS_WEIGHT` by the step
SETTINGS = {"scale": 1.0}  # a dict: guarded by content
LOSS_WEIGHTS = [1.0]  # a list, changed in place by the property test
NESTED = types.SimpleNamespace(loss=types.SimpleNamespace(weight=1.0))


def reset_containers() -> None:
    """The containers above back to their first contents, in place."""
    SETTINGS.clear()
    SETTINGS["scale"] = 1.0
    LOSS_WEIGHTS[:] = [1.0]
    NESTED.loss.weight = 1.0


@dataclasses.dataclass
class LossConfig:
    scale: float = 1.0
    squared: bool = True


CONFIG = LossConfig()


def tempered(out: torch.Tensor) -> torch.Tensor:  # out: (B, 1)
    return out / TEMPERATURE


def make_weighted_loss(weight: float):
    """A loss with its weight in a closure cell, and a setter that changes the cell."""

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        err = tempered(out) - y
        err = err.square() if CONFIG.squared else err.abs()
        return err.mean() * weight * CONFIG.scale * SETTINGS["scale"] * sum(LOSS_WEIGHTS) * NESTED.loss.weight

    def set_weight(value: float) -> None:
        nonlocal weight
        weight = value

    return loss, set_weight
