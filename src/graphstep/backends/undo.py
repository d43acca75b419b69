"""`UndoLog`: remember every tensor a piece of code writes, so its writes can be taken back.

A capture that executes the step (the recording backend) and then fails must leave
the model and optimizer as they were before the call. Under this dispatch mode each tensor
is copied just before its first in-place or `out=` write; `roll_back()` copies them back.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..state import holders


@functools.cache
def written_arguments(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """Positions and names of the arguments an operation writes to (in-place and out= arguments)."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


class UndoLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.before(func, args, kwargs)
        return func(*args, **kwargs)

    def before(self, func, args: tuple, kwargs: dict) -> None:
        for i, name in written_arguments(func):
            value = args[i] if i < len(args) else kwargs.get(name)
            for written in value if isinstance(value, (list, tuple)) else [value]:
                if not isinstance(written, torch.Tensor) or written.device.type == "meta":
                    continue
                if written.layout != torch.strided:  # sparse (SGD's momentum of a sparse gradient)
                    key = (id(written), -1, (), ())  # no storage of its own: the tensor itself, kept
                    if key not in self._seen:
                        self._seen.add(key)
                        self._saved.append((written, written.detach().clone()))
                    continue
                for t in holders(written):
                    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
                    if key not in self._seen:
                        self._seen.add(key)
                        self._saved.append((t.detach(), t.detach().clone()))

    def roll_back(self) -> None:
        """Put back every tensor written since this log was entered, newest write first."""
        with torch.no_grad():
            for target, saved in reversed(self._saved):
                if target.layout != torch.strided or _holds_storage(target):
                    target.copy_(saved)


def _holds_storage(t: torch.Tensor) -> bool:
    """False for a tensor whose storage was freed since (FSDP2 frees gathered parameters by
    resizing their storage to 0): nothing of it outlives the step, so nothing to put back."""
    if t.numel() == 0:
        return True
    end = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() >= end * t.element_size()
