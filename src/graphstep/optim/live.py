"""Live hyperparameters: the device tensors a captured step reads instead of Python numbers.

One `Live` per optimizer holds, per param group, a 0-d float32 tensor for each live key (or for
each live position of a tuple such as `betas`). They are put into the param group at the first
`absorb` (the optimizer's first step or a captured step's first call), and every number assigned
to the key since is copied into them (stream-ordered, no host sync) and the tensor put back. A
step pre-hook does that in an eager loop, so `make_capturable` needs no per-step call.
"""

from __future__ import annotations

import logging
import numbers
import weakref

import torch
from torch.optim import Optimizer

from ..errors import GraphStepError
from . import table
from .load import move_host_state
from .plan import GroupPlan, plan

log = logging.getLogger("graphstep")


class Live:
    """The device tensors of one optimizer's live hyperparameters, shared by every adapter of it
    and by its step pre-hook. Holds no reference to the optimizer (it is the value of a weak map)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.plans: list[GroupPlan] = []
        self.slots: list[list[_Slot]] = []
        """Per param group, one per live key; made at the first absorb."""
        self.sparse: set[int] = set()
        """Ids of the parameters known to get sparse gradients: a sparse embedding's weight (told by
        `prepare`), or a sparse gradient seen at a step (`watch_grads`)."""
        self._seen = 0
        """The leading param groups that have shown every gradient at a step (`watch_grads`)."""

    @staticmethod
    def of(optimizer: Optimizer, device: torch.device) -> Live:
        live = LIVE.get(optimizer)
        if live is None:
            live = LIVE[optimizer] = Live(device)
            optimizer.register_step_pre_hook(_before_step)
        return live

    def absorb(self, optimizer: Optimizer, *, in_step: bool = False) -> None:
        groups = optimizer.param_groups
        if len(groups) != len(self.slots):
            self._adopt_groups(optimizer)
        for group, slots in zip(groups, self.slots):
            for slot in slots:
                value = group.get(slot.key)
                if value is slot.current:
                    continue
                if in_step and _capturing():
                    raise GraphStepError(
                        f"param_groups[...]['{slot.key}'] was assigned {value!r} inside the captured step, "
                        "where a graph would bake it. Assign hyperparameters between calls (a scheduler's "
                        "step() too), or write the tensor in the group in place."
                    )
                group[slot.key] = slot.current = slot.take(value)

    def watch_grads(self, optimizer: Optimizer) -> None:
        """Before a step: a sparse gradient in a group graphstep made fused puts the group back to its
        user's implementation now, before torch's fused kernel refuses it (`table.why_not_fused`).
        A group is looked at until it has shown every gradient once: O(groups) after that."""
        groups = optimizer.param_groups
        for i in range(self._seen, len(groups)):
            params = groups[i]["params"]
            found = [id(p) for p in params if p.grad is not None and p.grad.is_sparse]
            if found:
                self.sparse.update(found)
                if i < len(self.plans) and self.plans[i].fuse:
                    self._unfuse(optimizer, i)
            if i == self._seen and all(p.grad is not None for p in params):
                self._seen = i + 1

    def _unfuse(self, optimizer: Optimizer, i: int) -> None:
        group = optimizer.param_groups[i]
        group["fused"] = None  # its user's choice: graphstep sets fused=True only where it was None
        if optimizer.defaults.get("fused") is True and not any(
            p.fuse for j, p in enumerate(self.plans) if j != i
        ):
            optimizer.defaults["fused"] = None
        new = plan(optimizer, self.device, self.sparse)
        if i < len(self.slots):
            keys = set(new[i].live)
            for slot in self.slots[i]:
                if slot.key not in keys:  # the number (or the user's tensor) it held, back
                    group[slot.key] = slot.given
            kept = [s for s in self.slots[i] if s.key in keys]
            self.slots[i] = kept + [
                _Slot(k, w, self.device) for k, w in new[i].live.items() if all(s.key != k for s in kept)
            ]
        self.plans[i] = new[i]
        log.info(
            "graphstep: %s param group %d keeps its user's implementation (%s), not fused=True: %s.",
            type(optimizer).__qualname__,
            i,
            new[i].impl,
            table.SPARSE_NOT_FUSED,
        )

    @staticmethod
    def absorb_loaded(optimizer: Optimizer) -> None:
        """After `load_state_dict`: copy the loaded numbers into the tensors, if they are in use."""
        live = LIVE.get(optimizer)
        if live is not None and any(s.current is not None for slots in live.slots for s in slots):
            live.absorb(optimizer)

    def _adopt_groups(self, optimizer: Optimizer) -> None:
        # The first absorb, or add_param_group since: plan the new groups as prepare would. Their
        # parameters are new to a graph, so a captured step captures again anyway (guards).
        groups = optimizer.param_groups
        if len(self.plans) != len(groups):
            self.plans = plan(optimizer, self.device, self.sparse)
            for group, p in list(zip(groups, self.plans))[len(self.slots) :]:
                if p.capturable:
                    group["capturable"] = True
            move_host_state(optimizer)
        del self.slots[len(groups) :]
        for p in self.plans[len(self.slots) :]:
            self.slots.append([_Slot(key, where, self.device) for key, where in p.live.items()])


class _Slot:
    """One live key of one param group: its tensor(s) and the object last put in the group."""

    def __init__(self, key: str, positions: tuple[int, ...] | None, device: torch.device):
        self.key = key
        self.positions = positions
        self.device = device
        self.tensors: list[torch.Tensor | None] = (
            [None] if positions is None else [None] * (max(positions) + 1)
        )
        self.current: object = None
        self.given: object = None
        """What was last assigned to the key (a number, or a tuple): what the group holds again should
        the key stop being live (`Live._unfuse`)."""

    def take(self, value: object) -> object:
        """Write `value`'s live numbers into this slot's tensors; what the group should hold."""
        self.given = value
        if self.positions is None:
            return self._write(0, value)
        if not isinstance(value, (tuple, list)) or len(value) < len(self.tensors):
            raise GraphStepError(
                f"a param group's {self.key} is {value!r}; it must be a tuple of {len(self.tensors)} numbers."
            )
        return tuple(self._write(i, v) if i in self.positions else v for i, v in enumerate(value))

    def _write(self, i: int, value: object) -> torch.Tensor:
        tensor = self.tensors[i]
        if tensor is None:
            if _usable(value, self.device):
                self.tensors[i] = value  # the caller's own tensor: keep it (they may hold it)
                return value
            tensor = self.tensors[i] = torch.empty((), dtype=torch.float32, device=self.device)
        if value is tensor:
            return tensor
        with torch.no_grad():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise GraphStepError(
                        f"a param group's {self.key} is a tensor of shape {tuple(value.shape)}; it must hold one number."
                    )
                tensor.copy_(value.detach().reshape(()))
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                tensor.fill_(float(value))
            else:
                raise GraphStepError(
                    f"a param group's {self.key} is a {type(value).__qualname__} ({value!r}); it must be a number."
                )
        return tensor


LIVE: weakref.WeakKeyDictionary[Optimizer, Live] = weakref.WeakKeyDictionary()


def _before_step(optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
    """Step pre-hook: an eager loop needs no per-step call (`make_capturable`)."""
    live = LIVE.get(optimizer)
    if live is not None:
        live.watch_grads(optimizer)
        live.absorb(optimizer, in_step=True)


def _capturing() -> bool:
    """A CUDA stream, or graphstep's recording backend, is capturing: a write now would be baked."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # private; 2.0-2.13

    # The recording backend's dispatch mode marks itself; asked by attribute, so that the optimizer
    # layer does not import the backends above it.
    return any(getattr(mode, "stands_in_for_a_capture", False) for mode in _get_current_dispatch_mode_stack())


def _usable(value: object, device: torch.device) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.dtype == torch.float32
        and value.device == device
        and not value.requires_grad
    )
