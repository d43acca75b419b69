"""Planning an optimizer for a captured step: which flags to set and which hyperparameters stay live.

`plan` reads `table.py`'s facts about torch's optimizers and decides, per param group, what
`OptimizerAdapter.prepare` will do; it changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from ..errors import UnsupportedOptimizerError
from . import table


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What `prepare` does to one param group."""

    capturable: bool
    """Set `capturable=True` (the optimizer has the flag and the device supports it)."""
    fuse: bool
    """Set `fused=True`: graphstep's choice for SGD/Adam/AdamW on CUDA whose user chose neither
    `foreach` nor `fused` (see `table.FUSED_BY_CHOICE`)."""
    impl: str
    """The implementation its step runs: "fused", "foreach" or "forloop"."""
    live: Mapping[str, tuple[int, ...] | None]
    """Live keys: None for a number, the live positions for a tuple (betas, etas, step_sizes)."""
    why_float: str = ""
    """Why lr stays a Python number (empty when it is live)."""
    eager_only: str = ""
    """Why this optimizer's step can only run eagerly (empty when it can be in a graph)."""
    kept: str = ""
    """Why a group graphstep would run fused keeps its user's implementation: torch's fused kernel
    would refuse it (sparse gradients, a dtype it does not update; see `table.why_not_fused`)."""

    @property
    def tensor_lr(self) -> bool:
        return "lr" in self.live


def plan(optimizer: Optimizer, device: torch.device | str, sparse: Collection[int] = ()) -> list[GroupPlan]:
    """What `prepare(device)` would do to each of `optimizer`'s param groups. Changes nothing.
    `sparse`: ids of the parameters known to get sparse gradients (never fused)."""
    check_supported(optimizer)
    device = torch.device(device)
    name = table.known_class(optimizer)
    on_device = device.type in table.capturable_devices()
    eager_only = eager_only_reason(optimizer, on_device)
    plans = []
    for group in optimizer.param_groups:
        differentiable = bool(group.get("differentiable"))
        capturable = "capturable" in group and on_device and not differentiable
        chooses = name is not None and table.user_chose_neither(name, group, device)
        kept = table.why_not_fused(list(group["params"]), device, sparse, name) if chooses else ""
        fuse = chooses and not kept
        impl = "fused" if fuse else table.implementation(group)
        live: Mapping[str, Any] = {}
        # Classes with a capturable flag read tensors only on their capturable paths (and fused).
        reads_tensors = impl == "fused" or capturable or group.get("capturable") or "capturable" not in group
        if name is not None and not differentiable and not eager_only and reads_tensors:
            live = table.LIVE[name].get(impl, {})
        why = "" if "lr" in live else table.why_baked(name, impl, "lr")
        plans.append(GroupPlan(capturable, fuse, impl, dict(live), why, eager_only, kept))
    return plans


def check_supported(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, Optimizer):
        raise UnsupportedOptimizerError(
            f"graphstep handles torch.optim.Optimizer instances; got {type(optimizer).__qualname__}."
        )
    refused = table.torch_class(optimizer, table.REFUSED)
    if refused is not None:
        raise UnsupportedOptimizerError(f"{type(optimizer).__qualname__}: {table.REFUSED[refused]}")


def eager_only_reason(optimizer: Optimizer, on_device: bool) -> str:
    name = table.torch_class(optimizer, table.EAGER_ONLY)
    if name is not None:
        return table.EAGER_ONLY[name]
    if (
        on_device
        and table.known_class(optimizer) == "Adagrad"
        and not all(g.get("fused") for g in optimizer.param_groups)
    ):
        return table.ADAGRAD_ON_DEVICE
    return ""
