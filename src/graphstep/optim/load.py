"""An optimizer's `load_state_dict` between calls of a captured step, and its host-side state.

`load_state_dict` builds a new `state` dict, new param group dicts and new tensors, none of which a
captured graph (or the guards, which check the containers' identity) would see. The hooks here
make it write into the objects a graph already uses instead, so resuming from a checkpoint between
calls needs no re-capture.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.optim import Optimizer

_hooked: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def move_host_state(optimizer: Optimizer) -> None:
    """Capturable groups keep 0-d state (step, mu_product, eta, mu) on the parameter's device, as
    torch does when it loads a capturable optimizer's state; state made before `prepare` may be on the host."""
    for group in optimizer.param_groups:
        if not group.get("capturable"):
            continue
        for param in group["params"]:
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if key == "step" and not isinstance(value, torch.Tensor):
                    state[key] = torch.tensor(float(value), dtype=torch.float32, device=param.device)
                elif isinstance(value, torch.Tensor) and value.dim() == 0 and value.device != param.device:
                    state[key] = value.to(param.device)


def install_load_hooks(optimizer: Optimizer, after_load: Callable[[Optimizer], None]) -> None:
    """Make `optimizer.load_state_dict` write into the tensors and containers a graph already uses.

    The pre-hook remembers the old containers; the post-hook writes the loaded values into them and
    puts them back: group values in place (a changed Python hyperparameter is then seen by the
    guards), tensors in groups copied in place where the loaded value fits them, and the state
    tensors copied in place, but only if every one of them matches (same parameters, keys, shapes,
    dtypes, devices, equal non-tensor values). Otherwise the loaded state stays as torch made it,
    and the guards capture the step again. `after_load(optimizer)` then copies loaded numbers into
    live hyperparameter tensors. Once per optimizer.
    """
    if optimizer in _hooked:
        return
    stash: dict = {}

    def pre(opt: Optimizer, state_dict: dict) -> None:
        stash["before"] = (
            opt.state,
            opt.param_groups,
            list(opt.param_groups),
            [dict(g) for g in opt.param_groups],
        )

    def post(opt: Optimizer) -> None:
        _restore_after_load(opt, *stash.pop("before"))
        after_load(opt)

    if not hasattr(optimizer, "_optimizer_load_state_dict_pre_hooks"):
        # A wrapper that never ran `Optimizer.__init__` (pytorch-optimizer's Magma): its own
        # `load_state_dict` runs no torch hooks, so there is nothing to hook.
        return
    optimizer.register_load_state_dict_pre_hook(pre)
    optimizer.register_load_state_dict_post_hook(post)
    _hooked.add(optimizer)


def _same_slot(old: object, new: object) -> bool:
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
    return not isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor) and old == new


def _restore_after_load(
    optimizer: Optimizer, old_state: dict, old_list: list, old_dicts: list[dict], old_values: list[dict]
) -> None:
    with torch.no_grad():
        for group, before, loaded in zip(old_dicts, old_values, optimizer.param_groups):
            group.clear()
            group.update(loaded)  # the same `params` list: load_state_dict keeps it
            if before.get("capturable") and "capturable" in group:
                group["capturable"] = True  # e.g. a checkpoint saved by a non-capturable eager twin
            for key, kept in before.items():
                if key != "params" and isinstance(kept, torch.Tensor) and _same_slot(kept, group.get(key)):
                    group[key] = kept.copy_(group[key])  # lr, initial_lr and the like, read by a graph
        old_list[:] = old_dicts
        optimizer.param_groups = old_list
        move_host_state(optimizer)  # host `step` tensors of a non-capturable checkpoint
        loaded = optimizer.state
        fits = set(loaded) == set(old_state) and all(
            set(loaded[p]) == set(s) and all(_same_slot(v, loaded[p][k]) for k, v in s.items())
            for p, s in old_state.items()
        )
        if not fits:
            return
        for p, s in old_state.items():
            for key, kept in s.items():
                if isinstance(kept, torch.Tensor) and loaded[p][key] is not kept:
                    kept.copy_(loaded[p][key])
        optimizer.state = old_state
