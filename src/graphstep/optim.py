"""Optimizers inside a captured step: capturable flags, learning rates as device tensors, checkpoints.

A CUDA graph replays kernels with the arguments they had at capture. For an optimizer that means:

- state kept on the host (Adam's `step` counter when `capturable=False`) is read with `.item()`
  and frozen; `capturable=True` keeps it on the device, so the graph advances it;
- a Python float learning rate is baked into the kernels, so a scheduler's change is ignored.
  A 0-d device tensor is read by the kernels on every replay, so a scheduler that writes it in
  place (`fill_`) is honoured with no re-capture.

`OptimizerAdapter` does both for the step's `torch.optim` optimizers, where the optimizer's own
implementation reads a tensor lr without a host sync (checked against torch 2.6-2.13):

| optimizer | capturable | lr as a device tensor when |
|---|---|---|
| Adam, AdamW | set | always (capturable or fused) |
| Adamax, NAdam, RAdam, ASGD | set | always (capturable) |
| Adadelta, RMSprop | set | the foreach implementation runs (the for-loop one calls `.item()`) |
| Rprop | set | never: it reads lr only when it creates its state, as eager does |
| SGD | no flag | `fused=True` (foreach and for-loop SGD call `.item()` on a tensor lr) |
| Adagrad | no flag | `fused=True`, CPU only; on CUDA it keeps its step count on the host: refused |
| LBFGS, SparseAdam, Adafactor | refused: see `UnsupportedOptimizerError`'s messages | |

Where lr stays a Python float, and for every other hyperparameter (betas, momentum, weight
decay, which OneCycleLR and CyclicLR change too), the value is baked into the graph; graphstep's
guards notice a change and capture again. `fused`/`foreach` are kept as the user chose.

A scheduler or a user may also *assign* `group["lr"] = 0.01` (torch < 2.10 does so in
SequentialLR, CyclicLR and CosineAnnealingWarmRestarts; ReduceLROnPlateau on older releases).
`before_call`, run before every call of the step, copies such a value into the tensor the graph
reads and puts that tensor back. `optimizer.load_state_dict` replaces the state, the param groups
and every tensor in them; hooks installed by `prepare` copy the loaded values into the objects the
graph already uses instead, so resuming from a checkpoint between calls needs no re-capture.

Bitwise equality with eager holds for the *same* optimizer settings: a capturable optimizer with
a float32 tensor lr computes in a different order than the default one, and a float32 lr rounds
the scheduler's float64. Apply `make_capturable` to an eager twin as well to compare runs.

Mixed precision: `torch.amp.GradScaler.step` calls `.item()` to skip a step with inf/nan
gradients unless the optimizer handles the scaling itself (`_step_supports_amp_scaling`: Adam,
AdamW and SGD with `fused=True`), so use a fused optimizer with fp16 and a GradScaler. Scale,
unscale, step and update then stay on the device and a skipped step is skipped as in eager.

Gradient clipping: `clip_grad_norm_(error_if_nonfinite=True)` reads the norm on the host. Keep
the default `False`, return the norm from the step and check `torch.isfinite(norm)` outside it
(every N steps, one sync), or use fp16 with a GradScaler, which skips non-finite steps on the device.

`zero_grad()` (`set_to_none=True`) inside the step needs nothing: the grads a captured backward
creates live in the graph's memory pool, are written by every replay, and are set to None again.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import traceback
import weakref
from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from .errors import GraphStepError, UnsupportedOptimizerError

log = logging.getLogger("graphstep")

__all__ = ["OptimizerAdapter", "UnsupportedOptimizerError", "host_sync_hint", "make_capturable", "plan"]


_REFUSED = {
    "LBFGS": (
        "LBFGS cannot run inside a captured step: its step() calls a closure several times and reads "
        "the loss and the gradients on the host for its line search and convergence tests, which a CUDA "
        "graph cannot replay. Run LBFGS eagerly (without graphstep), or use a first-order optimizer "
        "(AdamW, Adam, SGD) in the captured step."
    ),
    "SparseAdam": (
        "SparseAdam cannot run inside a captured step: it updates only the rows present in a sparse "
        "gradient, whose size depends on the data, and a CUDA graph replays fixed sizes. Use dense "
        "gradients (nn.Embedding(sparse=False)) with Adam or AdamW."
    ),
    "Adafactor": (
        "Adafactor cannot run inside a captured step: every step() reads norms and its step count on the "
        "host with .item(). Use AdamW (capturable, or fused=True) in the captured step."
    ),
}

# Which flags make the optimizer's own code read a 0-d tensor lr on the device (no .item()),
# after `prepare`. Keyed by class name; `_known_class` checks that `step` is not overridden.
_TENSOR_LR = {
    **dict.fromkeys(["Adam", "AdamW"], ("fused", "capturable")),  # either flag
    **dict.fromkeys(["Adamax", "NAdam", "RAdam", "ASGD"], ("capturable",)),
    **dict.fromkeys(["Adadelta", "RMSprop"], ("capturable+foreach",)),
    **dict.fromkeys(["SGD", "Adagrad"], ("fused",)),
}

_WHY_FLOAT = {
    "SGD": "SGD's foreach and for-loop updates read a tensor lr with .item(); SGD(fused=True) reads it on the device",
    "Adagrad": "Adagrad reads a tensor lr with .item() unless fused=True",
    "Adadelta": "Adadelta reads a tensor lr on the device only when capturable (on a GPU) and foreach",
    "RMSprop": "RMSprop reads a tensor lr on the device only when capturable (on a GPU) and foreach",
    "Rprop": "Rprop reads lr only when it creates its state, so a later change has no effect, as in eager",
}

_CAPTURABLE_DEVICES = ("cuda", "xpu")


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What `prepare` does to one param group."""

    capturable: bool
    """Set `capturable=True` (the optimizer has the flag and the device supports it)."""
    tensor_lr: bool
    """Make `lr` a 0-d float32 tensor on the device."""
    why_float: str = ""
    """Why lr stays a Python float (empty when `tensor_lr`)."""


def _known_class(optimizer: Optimizer) -> str | None:
    """The torch.optim class whose implementation `optimizer` runs, or None for anything else."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and (
            cls.__name__ in _TENSOR_LR or cls.__name__ in _WHY_FLOAT
        ):
            # A subclass that overrides step() may read lr differently: trust only torch's own.
            return cls.__name__ if type(optimizer).step is cls.step else None
    return None


def _check_supported(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, Optimizer):
        raise UnsupportedOptimizerError(
            f"graphstep handles torch.optim.Optimizer instances; got {type(optimizer).__qualname__}."
        )
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _REFUSED:
            raise UnsupportedOptimizerError(f"{type(optimizer).__qualname__}: {_REFUSED[cls.__name__]}")


def _foreach_runs(group: dict) -> bool:
    """Whether the group's step takes the foreach implementation (resolving foreach=None as torch does)."""
    if group.get("foreach") is not None or group.get("fused"):
        return bool(group.get("foreach"))
    from torch.optim.optimizer import _default_to_fused_or_foreach  # private; present in 2.6-2.13

    _, foreach = _default_to_fused_or_foreach(
        list(group["params"]), differentiable=bool(group.get("differentiable")), use_fused=False
    )
    return bool(foreach)


def plan(optimizer: Optimizer, device: torch.device | str) -> list[GroupPlan]:
    """What `prepare(device)` would do to each of `optimizer`'s param groups. Changes nothing."""
    _check_supported(optimizer)
    device = torch.device(device)
    name = _known_class(optimizer)
    capturable_device = device.type in _CAPTURABLE_DEVICES
    if name == "Adagrad" and capturable_device and not all(g.get("fused") for g in optimizer.param_groups):
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__qualname__} on {device.type}: Adagrad keeps its step count on the host and "
            "reads it with .item() every step, so a CUDA graph would freeze it (its fused version runs only "
            "on the CPU). Use AdamW or RMSprop (graphstep makes them capturable) in the captured step."
        )
    plans = []
    for group in optimizer.param_groups:
        capturable = "capturable" in group and capturable_device and not group.get("differentiable")
        flags = dict(group, capturable=group.get("capturable") or capturable)
        on = {
            "fused": bool(flags.get("fused")),
            "capturable": bool(flags.get("capturable")),
            "capturable+foreach": bool(flags.get("capturable")) and _foreach_runs(flags),
        }
        ok = not group.get("differentiable") and any(on[f] for f in _TENSOR_LR.get(name or "", ()))
        why = "" if ok else _WHY_FLOAT.get(name or "", "")
        if not ok and not why:
            why = f"{name or type(optimizer).__qualname__} is not known to read a tensor lr without .item() here"
        plans.append(GroupPlan(capturable=capturable, tensor_lr=ok, why_float=why))
    return plans


class OptimizerAdapter:
    """Makes the step's torch.optim optimizers capturable and keeps hyperparameters out of the graph.

    `prepare(device)` once, before the first warm-up of a step that runs on `device`; then
    `before_call()` before every call of the step (warm-up, capture and replay alike).
    """

    def __init__(self, optimizers: Iterable[Optimizer]):
        self.optimizers = list(optimizers)
        for optimizer in self.optimizers:
            _check_supported(optimizer)
        self.device: torch.device | None = None
        # Per optimizer, per param group: the lr tensor the graph reads, or None (lr stays a float).
        self._lrs: list[tuple[Optimizer, list[torch.Tensor | None]]] = []

    def prepare(self, device: torch.device | str) -> None:
        """Set capturable flags, move host state to the device, make lrs device tensors. Idempotent."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device is not None:
            if device != self.device:
                raise GraphStepError(f"the optimizers were prepared for {self.device}, not {device}.")
            return
        plans = [plan(optimizer, device) for optimizer in self.optimizers]  # raises before any change
        self.device = device
        for optimizer, group_plans in zip(self.optimizers, plans):
            lrs = [
                _apply(optimizer, group, p, device) for group, p in zip(optimizer.param_groups, group_plans)
            ]
            if any(p.capturable for p in group_plans):
                optimizer.defaults["capturable"] = True  # for groups added later
            _move_host_state(optimizer)
            _install_load_hooks(optimizer)
            self._lrs.append((optimizer, lrs))
            _log_plan(optimizer, group_plans)

    def before_call(self) -> None:
        """Copy an lr that was assigned (not written in place) into the tensor the graph reads.

        A dict lookup and an identity test per param group when nothing changed.
        """
        for optimizer, lrs in self._lrs:
            groups = optimizer.param_groups
            if len(groups) != len(lrs):
                self._adopt_new_groups(optimizer, lrs)
            for group, lr in zip(groups, lrs):
                if lr is not None and group["lr"] is not lr:
                    _absorb(group, lr)

    def state_layout(self) -> tuple:
        """Which parameters have optimizer state, and which keys: changes while state is still being
        created lazily (the first step, or the step after loading a state without it).

        A capture must not record such a step: it would bake a first step's branch (fused SGD's
        `is_first_step`, Adam creating zeroed moments) into every replay. Compare it before and
        after a warm-up call and warm up again while it changes. O(parameters): not per replay.
        """
        return tuple(
            (id(opt.state), tuple(len(opt.state.get(p, ())) for g in opt.param_groups for p in g["params"]))
            for opt in self.optimizers
        )

    def _adopt_new_groups(self, optimizer: Optimizer, lrs: list) -> None:
        # add_param_group after prepare: treat the new groups as prepare would. Their parameters
        # are new to the graph, so the step captures again anyway (guards).
        group_plans = plan(optimizer, self.device)
        del lrs[len(optimizer.param_groups) :]
        for group, p in list(zip(optimizer.param_groups, group_plans))[len(lrs) :]:
            lrs.append(_apply(optimizer, group, p, self.device))
        _move_host_state(optimizer)


def make_capturable(optimizer: Optimizer, device: torch.device | str | None = None) -> OptimizerAdapter:
    """Prepare `optimizer` as `graphstep.capture(optimizer=...)` does, and return its adapter.

    Apply it to an eager twin too, so both runs use the same settings (a bitwise comparison needs
    that). `device` defaults to the device of the optimizer's first parameter. Call the returned
    adapter's `before_call()` before each eager step if lrs may be assigned as floats.
    """
    if device is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
    adapter = OptimizerAdapter([optimizer])
    adapter.prepare(device)
    return adapter


def host_sync_hint(frames: Iterable[traceback.FrameSummary]) -> str | None:
    """If a host sync happened inside an optimizer-related torch function, what to do instead."""
    for frame in frames:
        name = os.path.basename(frame.filename)
        if name == "grad_scaler.py":
            return (
                "GradScaler.step reads found_inf on the host with .item() unless the optimizer unscales "
                "and skips on the device: construct it with fused=True (Adam, AdamW, SGD)"
            )
        if name == "clip_grad.py":
            return (
                "clip_grad_norm_(error_if_nonfinite=True) reads the norm on the host: keep the default "
                "error_if_nonfinite=False, return the norm from the step and check torch.isfinite(norm) "
                "outside it, or use fp16 with a GradScaler, which skips non-finite steps on the device"
            )
        if name == "lr_scheduler.py":
            return "call the learning-rate scheduler's step() outside the captured step, between calls"
    return None


# -- helpers ------------------------------------------------------------------------------------


def _apply(optimizer: Optimizer, group: dict, p: GroupPlan, device: torch.device) -> torch.Tensor | None:
    if p.capturable:
        group["capturable"] = True
    if not p.tensor_lr:
        return None
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.dim() == 0 and lr.dtype == torch.float32 and lr.device == device:
        return lr  # already what the graph needs: keep the caller's tensor (they may hold it)
    tensor = torch.empty((), dtype=torch.float32, device=device)
    _absorb(group, tensor)
    return tensor


def _absorb(group: dict, lr: torch.Tensor) -> None:
    """Write group["lr"]'s value into `lr` (stream-ordered, no host sync) and put `lr` back."""
    group["lr"] = _write_lr(group["lr"], lr)


def _write_lr(value: object, lr: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise GraphStepError(
                    f"a param group's lr is a tensor of shape {tuple(value.shape)}; it must hold one number."
                )
            lr.copy_(value.detach().reshape(()))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            lr.fill_(float(value))
        else:
            raise GraphStepError(
                f"a param group's lr is a {type(value).__qualname__} ({value!r}); it must be a number."
            )
    return lr


def _move_host_state(optimizer: Optimizer) -> None:
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


_hooked: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def _install_load_hooks(optimizer: Optimizer) -> None:
    """Make `optimizer.load_state_dict` write into the tensors and containers a graph already uses.

    load_state_dict builds a new `state` dict, new param group dicts and new tensors, none of
    which a captured graph (or the guards, which check the containers' identity) would see. The
    pre-hook remembers the old ones; the post-hook writes the loaded values into them and puts
    them back: group values in place (a changed Python hyperparameter is then seen by the guards),
    lr through the adapter's tensor, and the state tensors copied in place, but only if every one
    of them matches (same parameters, keys, shapes, dtypes, devices, equal non-tensor values).
    Otherwise the loaded state stays as torch made it, and the guards capture the step again.
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
                if key == "lr" and isinstance(kept, torch.Tensor) and group["lr"] is not kept:
                    group["lr"] = _write_lr(group["lr"], kept)
                elif key != "params" and isinstance(kept, torch.Tensor) and _same_slot(kept, group.get(key)):
                    group[key] = kept.copy_(group[key])  # initial_lr and the like, tracked by the guards
        old_list[:] = old_dicts
        optimizer.param_groups = old_list
        _move_host_state(optimizer)  # host `step` tensors of a non-capturable checkpoint
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


def _log_plan(optimizer: Optimizer, group_plans: list[GroupPlan]) -> None:
    name = type(optimizer).__qualname__
    capturable = any(p.capturable for p in group_plans)
    floats = [i for i, p in enumerate(group_plans) if not p.tensor_lr]
    if not floats:
        log.info(
            "graphstep: %s: capturable=%s; lr is a device tensor, schedulers need no re-capture.",
            name,
            capturable,
        )
        return
    log.info(
        "graphstep: %s: capturable=%s; lr of param group(s) %s stays a Python float (%s): a change of it "
        "captures the step again.",
        name,
        capturable,
        floats,
        group_plans[floats[0]].why_float,
    )
