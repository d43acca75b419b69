"""The training state a step works on: its modules and optimizers, and how to put it back.

A CUDA capture executes no kernel, so tensor *values* are untouched when it fails; but the
Python side of the step did run: backward attached fresh (uninitialised) `.grad` tensors,
the optimizer may have added state entries, a module may have switched mode. `Snapshot`
records those references before a capture and puts them back if it fails, so the model and
optimizer are exactly as they were before the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map

from .errors import UnsupportedInputError


def as_list(value: object, kind: type, what: str) -> list:
    """`model=` and `optimizer=` take one object or several."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, kind):
            raise UnsupportedInputError(
                f"capture({what}=...) takes a {kind.__module__}.{kind.__qualname__} or a list of them; "
                f"got {type(item).__qualname__}."
            )
    return items


def storage_paths(t: torch.Tensor) -> list[tuple[str, ...]]:
    """Attribute paths from a tensor to the plain tensors that hold its memory.

    `()` for a plain tensor; `("_local_tensor",)` for a DTensor (FSDP2, tensor parallel): a
    wrapper subclass has no data pointer of its own.
    """
    if not is_traceable_wrapper_subclass(t):
        return [()]
    attrs, _ = t.__tensor_flatten__()
    inner = [(a, getattr(t, a)) for a in attrs]
    return [(a, *rest) for a, v in inner if isinstance(v, torch.Tensor) for rest in storage_paths(v)]


def follow(t: torch.Tensor, path: tuple[str, ...]) -> torch.Tensor:
    for attr in path:
        t = getattr(t, attr)
    return t


def holders(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s memory: `t` itself, or a DTensor's local shard."""
    return [follow(t, path) for path in storage_paths(t)]


def op_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an ATen operation's arguments or results (`args`, `kwargs`, `out`): lists,
    tuples and dicts of them, walked without pytree's general machinery (a dispatch mode calls this
    for every operation of a step)."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, found)


def map_op_tensors(fn: Any, value: Any) -> Any:
    """`value` with `fn(t)` for each tensor `t` in it: the structures of `op_tensors`, rebuilt."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(map_op_tensors(fn, v) for v in value)
    if kind is dict:
        return {k: map_op_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple, dict)) and op_tensors(value):  # a named tuple holding tensors
        return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)
    return value


@dataclasses.dataclass
class TrainingState:
    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of the modules and optimizers, each once, in a stable order."""
        seen: dict[int, torch.Tensor] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def tensors_kept(self) -> list[torch.Tensor]:
        """What the state keeps from call to call beside the parameters: grads, module buffers, and the
        tensors of each optimizer's state (made lazily, in the first warm-up)."""
        kept = [p.grad for p in self.parameters() if p.grad is not None]
        kept += [b for m in self.modules for b in m.buffers()]
        for opt in self.optimizers:
            for entry in opt.state.values():
                values = entry.values() if isinstance(entry, dict) else (entry,)
                kept += [v for v in values if isinstance(v, torch.Tensor)]
        return kept

    labels: dict[int, str] = dataclasses.field(default_factory=dict)
    """Names of modules found in the step's closure or globals rather than passed as model=."""

    def named_modules_roots(self) -> list[tuple[str, nn.Module]]:
        default = ["model"] if len(self.modules) == 1 else [f"model[{i}]" for i in range(len(self.modules))]
        return [(self.labels.get(id(m), name), m) for name, m in zip(default, self.modules)]

    def discover(self, labelled: Iterable[tuple[str, object]]) -> list[torch.Generator]:
        """Add the modules and optimizers among a step's closure and globals, by their names there.
        Returns the CUDA generators among them (the graph must advance those)."""
        generators = []
        for label, obj in labelled:
            if isinstance(obj, torch.Generator) and obj.device.type == "cuda":
                generators.append(obj)
            if isinstance(obj, nn.Module):
                if not any(obj is sub for root in self.modules for sub in root.modules()):
                    self.modules.append(obj)
                    self.labels[id(obj)] = label
            elif isinstance(obj, torch.optim.Optimizer) and not any(obj is o for o in self.optimizers):
                self.optimizers.append(obj)
        return generators

    def devices(self) -> set[torch.device]:
        found = {p.device for p in self.parameters()}
        for m in self.modules:
            found.update(b.device for b in m.buffers())
        return found


@dataclasses.dataclass
class Snapshot:
    """Python references a step can change even when none of its kernels ran."""

    grads: list[tuple[torch.Tensor, torch.Tensor | None]]
    optimizer_state: list[tuple[torch.optim.Optimizer, list[tuple[Any, Any, dict | None]], list[dict]]]
    """Per optimizer: (parameter, its state dict, that dict's contents) in order, and the groups."""
    modules: list[tuple[nn.Module, dict]]
    """Each module's attributes (its `__dict__`, shallow): train/eval, and what a library's forward
    rebinds with `setattr` (a metric's state tensors) before a capture fails."""
    cpu_rng: torch.Tensor
    cuda_rng: list[tuple[int, torch.Tensor]]

    @classmethod
    def take(cls, state: TrainingState, cuda_devices: Iterable[int] = ()) -> Snapshot:
        return cls(
            grads=[(p, p.grad) for p in state.parameters()],
            optimizer_state=[
                (
                    opt,
                    # An optimizer may keep a value of its own among its parameters' entries (a step
                    # count under a string key): kept as it is.
                    [(p, s, dict(s) if isinstance(s, dict) else None) for p, s in opt.state.items()],
                    [dict(g) for g in opt.param_groups],
                )
                for opt in state.optimizers
            ],
            modules=[(m, dict(m.__dict__)) for root in state.modules for m in root.modules()],
            cpu_rng=torch.get_rng_state(),
            cuda_rng=[(i, torch.cuda.get_rng_state(i)) for i in cuda_devices],
        )

    def restore(self) -> None:
        for p, grad in self.grads:
            p.grad = grad
        for opt, saved_state, saved_groups in self.optimizer_state:
            # The same dict objects, in the same order, holding the same values: a graph's guard
            # compares them by identity (guards/optimizer.py).
            opt.state.clear()
            for p, entry, contents in saved_state:
                if contents is not None:
                    entry.clear()
                    entry.update(contents)
                opt.state[p] = entry
            for group, saved in zip(opt.param_groups, saved_groups):
                group.clear()
                group.update(saved)
        for m, saved in self.modules:
            now = m.__dict__
            for key in [k for k in now if k not in saved]:
                del now[key]
            for key, value in saved.items():
                if now.get(key, saved) is not value:
                    now[key] = value
        torch.set_rng_state(self.cpu_rng)
        for i, rng in self.cuda_rng:
            torch.cuda.set_rng_state(rng, i)
