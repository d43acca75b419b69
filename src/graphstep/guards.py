"""Guards: a replay never silently differs from eager.

A CUDA graph remembers addresses and Python numbers. `StateGuard` records, when a graph is
captured, everything the replay silently depends on, and before every replay checks it still
holds:

- every state tensor (parameters, buffers, optimizer state, tensors the step reaches through
  its closure or globals) still has the same storage, shape, dtype and stride;
- every `.grad` that outlives the step is still the same tensor (not replaced, not None);
- every module is in the mode (train/eval) it was captured in;
- optimizer param groups hold the same parameters and the same Python hyperparameters
  (a float lr, betas, eps, weight_decay, momentum, ...);
- closure cells and globals the step reads still hold the same objects;
- no module had a parameter, buffer or submodule re-registered (`load_state_dict(assign=True)`,
  `model.fc = nn.Linear(...)`): a global registration hook bumps an epoch counter.

The common case costs one pass in C++ over the tensors' data pointers (on CUDA builds) plus
a few attribute reads; names and reasons are only worked out once something changed.
Strong references are held, so memory a graph uses can never be freed under it.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .state import TrainingState, follow, storage_paths

_epoch = itertools.count()
_structure_epoch = 0
_hooks_installed = False


def _bump_structure_epoch(*_: Any) -> None:
    global _structure_epoch
    _structure_epoch = next(_epoch)


def _install_registration_hooks() -> None:
    """Count every parameter, buffer and submodule (re-)registration in the process.

    Installed when the first guard is made, never at import.
    """
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module

    for name in (
        "register_module_parameter_registration_hook",
        "register_module_buffer_registration_hook",
        "register_module_module_registration_hook",
    ):
        register = getattr(module, name, None)
        if register is not None:
            register(_bump_structure_epoch)  # returns None: the registration goes ahead unchanged
    _hooks_installed = True


_data_ptr = torch.Tensor.data_ptr
_get_grad = operator.attrgetter("grad")
_get_training = operator.attrgetter("training")
_ptrs_equal_in_cpp = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _same_data_ptrs(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:
    if _ptrs_equal_in_cpp is not None:
        return _ptrs_equal_in_cpp(tensors, ptrs, indices)
    return list(map(_data_ptr, tensors)) == ptrs


@dataclasses.dataclass
class _Tracked:
    name: str
    tensor: torch.Tensor
    """As the step sees it: a plain tensor, or a DTensor."""
    path: tuple[str, ...]
    """From `tensor` to the plain tensor holding the memory (see `storage_paths`)."""
    meta: tuple  # (data_ptr, shape, stride, dtype) of that plain tensor

    def storage(self) -> torch.Tensor:
        return follow(self.tensor, self.path)


def _meta(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def hyperparameters(group: dict) -> dict[str, Any]:
    """The Python values of a param group that a graph bakes in (tensors are read live)."""
    return {k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}


def named_state_tensors(state: TrainingState, fn: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor that exists before the step and that the step can read or write, named."""
    names: dict[int, str] = {}
    for prefix, module in state.named_modules_roots():
        for name, p in module.named_parameters():
            names.setdefault(id(p), f"{prefix}.{name}")
            yield f"{prefix}.{name}", p
        for name, b in module.named_buffers():
            yield f"{prefix}.{name}", b
    for i, opt in enumerate(state.optimizers):
        label = "optimizer" if len(state.optimizers) == 1 else f"optimizer[{i}]"
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                param_name = names.get(id(p), f"param_groups[{gi}].params[{pi}]")
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        yield f"{label}.state[{param_name}].{key}", value
            for key, value in group.items():
                if isinstance(value, torch.Tensor):
                    yield f"{label}.param_groups[{gi}].{key}", value
    for label, _, value in bindings(fn):
        if isinstance(value, torch.Tensor):
            yield label, value


def bindings(fn: Callable) -> list[tuple[str, Callable[[], Any], Any]]:
    """Closure cells and globals of the step that hold tensors, modules, optimizers or generators.

    Each as `(label, read, object)`: `read()` gives what the name refers to now.
    """
    kinds = (torch.Tensor, nn.Module, torch.optim.Optimizer, torch.Generator)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not assigned yet
            continue
        if isinstance(value, kinds):
            found.append((f"closure variable {name!r}", lambda c=cell: c.cell_contents, value))
    module_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        value = module_globals.get(name)
        if isinstance(value, kinds):
            found.append((f"global {name!r}", lambda g=module_globals, n=name: g.get(n), value))
    return found


class StateGuard:
    """What one captured graph depends on, and the check that it still holds."""

    def __init__(
        self,
        state: TrainingState,
        fn: Callable,
        *,
        strict: bool,
        grads_before: list[tuple[torch.Tensor, torch.Tensor | None]],
        eager_optimizers: list[torch.optim.Optimizer] = (),
    ):
        _install_registration_hooks()
        self.epoch = _structure_epoch
        self.strict = strict
        self.tracked = [
            _Tracked(n, t, path, _meta(follow(t, path)))
            for n, t in named_state_tensors(state, fn)
            for path in storage_paths(t)
        ]
        # Optimizer state is replaced wholesale (load_state_dict swaps `optimizer.state`, an O(1)
        # check); its thousands of tensors get a pointer check of their own only when strict.
        checked = [t for t in self.tracked if strict or ".state[" not in t.name]
        checked.sort(key=lambda t: bool(t.path))  # plain tensors first, then DTensors' shards
        self.tensors = [t.tensor for t in checked if not t.path]
        self.wrapped = [(t.tensor, t.path) for t in checked if t.path]
        """Read again on every check: a DTensor's local shard can be swapped under it."""
        self.ptrs = [t.meta[0] for t in checked]
        self.metas = [t.meta for t in checked]
        self.indices = list(range(len(checked)))
        self.param_names = {id(t.tensor): t.name for t in self.tracked}
        # A graph reads a parameter's grad only if the grad existed before the step and the step
        # accumulated into it (still the same tensor after). If the grad did not exist, the graph
        # writes a fresh one: replaying it is right only while the grad is None before the call.
        reads = [(p, g) for p, g in grads_before if g is not None and p.grad is g]
        self.grad_params = [p for p, _ in reads]
        self.grads = [g for _, g in reads]
        self.fresh_grad_params = [p for p, g in grads_before if g is None and p.grad is not None]
        named_modules = [nm for prefix, root in state.named_modules_roots() for nm in _named(prefix, root)]
        self.module_names = [n for n, _ in named_modules]
        self.modules = [m for _, m in named_modules]
        self.training = list(map(_get_training, self.modules))
        self.optimizers = [
            (
                opt,
                opt.state,
                opt.param_groups,
                [(g, g["params"], len(g["params"]), hyperparameters(g)) for g in opt.param_groups],
                len(opt.param_groups),
            )
            for opt in state.optimizers
            if not any(opt is e for e in eager_optimizers)  # they run eagerly: nothing baked
        ]
        self.bindings = bindings(fn)
        self.parameter_ids = [id(p) for p in state.parameters()]
        self.state = state

    # -- the check on every replay ---------------------------------------------------------

    def holds(self) -> bool:
        """True when a replay would do what eager would. Cheap; no messages. Grads the user set to
        None between calls are re-attached (zeroed) here rather than reported."""
        if self.epoch != _structure_epoch:
            return False
        tensors = (
            self.tensors + [follow(t, path) for t, path in self.wrapped] if self.wrapped else self.tensors
        )
        if tensors and not _same_data_ptrs(tensors, self.ptrs, self.indices):
            return False
        if self.strict and [_meta(t) for t in tensors] != self.metas:
            return False
        grads_kept = not self.grads or all(map(operator.is_, map(_get_grad, self.grad_params), self.grads))
        if not grads_kept and not self._restore_cleared_grads():
            return False
        if self.fresh_grad_params and any(g is not None for g in map(_get_grad, self.fresh_grad_params)):
            return False
        if list(map(_get_training, self.modules)) != self.training:
            return False
        for opt, state, groups_list, groups, n_groups in self.optimizers:
            if opt.state is not state or opt.param_groups is not groups_list or len(groups_list) != n_groups:
                return False
            for group, params, n_params, hyper in groups:
                if (
                    group["params"] is not params
                    or len(params) != n_params
                    or hyperparameters(group) != hyper
                ):
                    return False
        return all(read() is value for _, read, value in self.bindings)

    def _restore_cleared_grads(self) -> bool:
        """Grads set to None between calls (`zero_grad()` outside the step): eager would start
        from zero, so zero the graph's grad buffers in place and attach them again. Any other
        replacement cannot be absorbed: False."""
        cleared = []
        for p, g in zip(self.grad_params, self.grads):
            if p.grad is None:
                cleared.append((p, g))
            elif p.grad is not g:
                return False
        with torch.no_grad():
            torch._foreach_zero_([g for _, g in cleared])
        for p, g in cleared:
            p.grad = g
        return True

    # -- the slow path: what changed, by name ------------------------------------------------

    def changes(self) -> list[str]:
        """Human-readable reasons the guard fails, by qualified name."""
        found: list[str] = []
        for item in self.tracked:
            t = item.storage()
            ptr, shape, stride, dtype = item.meta
            if t.data_ptr() != ptr:
                found.append(
                    f"{item.name}: storage moved (param.data reassigned, or load_state_dict replaced it)"
                )
            elif (tuple(t.shape), t.stride(), t.dtype) != (shape, stride, dtype):
                found.append(
                    f"{item.name}: shape/stride/dtype changed from {list(shape)} {dtype} to {list(t.shape)} {t.dtype}"
                )
        for p, grad in zip(self.grad_params, self.grads):
            if p.grad is not None and p.grad is not grad:
                found.append(
                    f"{self.param_names.get(id(p), 'a parameter')}.grad: replaced by another tensor (the graph accumulates into the old one)"
                )
        for p in self.fresh_grad_params:
            if p.grad is not None:
                found.append(
                    f"{self.param_names.get(id(p), 'a parameter')}.grad: exists now, but the graph was captured "
                    "without one and would overwrite it instead of accumulating"
                )
        for name, m, was in zip(self.module_names, self.modules, self.training):
            if m.training != was:
                found.append(
                    f"{name}: switched to {'train' if m.training else 'eval'} mode (captured in {'train' if was else 'eval'})"
                )
        for i, (opt, state, groups_list, groups, n_groups) in enumerate(self.optimizers):
            label = "optimizer" if len(self.optimizers) == 1 else f"optimizer[{i}]"
            if opt.state is not state:
                found.append(f"{label}.state: replaced (optimizer.load_state_dict?)")
            if opt.param_groups is not groups_list or len(opt.param_groups) != n_groups:
                found.append(f"{label}.param_groups: groups added or replaced")
                continue
            for gi, (group, params, n_params, hyper) in enumerate(groups):
                if group["params"] is not params or len(params) != n_params:
                    found.append(f"{label}.param_groups[{gi}]: parameters added or removed")
                now = hyperparameters(group)
                for key in sorted(set(now) | set(hyper)):
                    if now.get(key) != hyper.get(key):
                        found.append(
                            f"{label}.param_groups[{gi}]['{key}']: {hyper.get(key)!r} -> {now.get(key)!r} "
                            "(a Python number is baked into the graph)"
                        )
        for label, read, value in self.bindings:
            if read() is not value:
                found.append(f"{label}: now refers to another object")
        if self.epoch != _structure_epoch:
            now_ids = [id(p) for p in self.state.parameters()]
            if now_ids != self.parameter_ids:
                found.append(
                    "a module's parameters were replaced or re-registered (setattr, load_state_dict(assign=True))"
                )
        if not found and self.epoch != _structure_epoch:
            # Something was registered somewhere in the process, but not in this step's modules.
            self.epoch = _structure_epoch
        return found


def _named(prefix: str, root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, m in root.named_modules():
        yield (f"{prefix}.{name}" if name else prefix), m
