"""`Change`: one reason a graph's guard fails, as a user reads it and as the lifecycle acts on it."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Change:
    """One reason a guard fails, as a user reads it (`str(change)`) and as the lifecycle acts on it."""

    text: str
    variant: bool = False
    """True for a value that can come back and for which a graph captured separately is valid:
    a module's mode, a `requires_grad`, a module attribute, an optimizer hyperparameter baked into
    the graph, a Python value of a global or closure. False for identity changes: storage moved, a
    grad replaced, an object rebound, param groups replaced, a (re-)registration."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer whose param-group hyperparameters changed (it could run eagerly instead)."""
    key: str | None = None
    """Which param-group key of `optimizer` changed."""
    warm_up: bool = False
    """Run the next call eagerly before capturing: it creates state lazily (a parameter unfrozen
    that its optimizer holds no state for yet), which a capture would bake in as a first step."""

    def __str__(self) -> str:
        return self.text
