"""`OptimizerAdapter`: optimizers inside a captured step — capturable flags, live hyperparameters,
checkpoints.

A CUDA graph replays kernels with the arguments they had at capture. For an optimizer that means:
state kept on the host (Adam's `step` counter when `capturable=False`) would be read with `.item()`
and frozen, so `capturable=True` keeps it on the device; and a Python number (lr, betas, ...) is
baked into the kernels, so a hyperparameter torch reads on the device without a host sync is held as
a 0-d device tensor (*live*) that a scheduler's change is copied into. Which values stay live, per
optimizer and implementation, is `table.py`'s data and the table in docs/optimizers.md (a test keeps
them equal); the rest of the reasoning is written there too. `foreach`/`fused` stay as the user chose,
with one exception: SGD, Adam and AdamW on CUDA whose user chose neither run fused (graphstep's
choice, logged once; `table.FUSED_BY_CHOICE` says why), unless torch's fused kernel would refuse the
group: sparse gradients (a sparse embedding's weight, known before the first step; or a sparse
gradient seen at a step, which puts the group back before the fused kernel runs: `live.py`), a dtype
or a device it does not take. Such a group keeps its user's implementation, with a log line saying why.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ..diagnostics import host_sync_hint
from ..errors import GraphStepError, UnsupportedOptimizerError
from . import table
from .live import LIVE, Live
from .load import install_load_hooks, move_host_state
from .plan import GroupPlan, check_supported, eager_only_reason, plan

log = logging.getLogger("graphstep")

__all__ = [
    "OptimizerAdapter",
    "UnsupportedOptimizerError",
    "baked_hyperparameters",
    "host_sync_hint",
    "make_capturable",
    "plan",
    "sparse_parameters",
]


def baked_hyperparameters(group: dict) -> dict[str, Any]:
    """The values of a param group that a captured graph bakes in, for the guards to compare.

    Tensors are read live and left out (comparing them would read them on the host); in a tuple
    holding some tensors (betas with a live beta1), the tensors are replaced by a marker so the
    numbers beside them are still compared. Containers are copied (lists as tuples), so that one
    changed in place later differs from what was recorded.
    """
    baked = {}
    for key, value in group.items():
        if key == "params" or isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (tuple, list)):  # a copy: a list changed in place must differ from it
            value = tuple(_LIVE_MARK if isinstance(v, torch.Tensor) else v for v in value)
        elif isinstance(value, (dict, set)):
            value = copy.deepcopy(value)
        baked[key] = value
    return baked


_LIVE_MARK = "<device tensor>"


class OptimizerAdapter:
    """Makes the step's torch.optim optimizers capturable and keeps their hyperparameters live.

    `prepare(device)` once, before the first warm-up of a step that runs on `device`; then
    `before_call()` before every call of the step (warm-up, capture and replay alike).
    `allow_eager=True`: optimizers whose step can only run eagerly (Adagrad on a GPU, Adafactor)
    are accepted, for a caller that runs them in an eager segment (see `eager_only`).
    """

    def __init__(self, optimizers: Iterable[Optimizer], *, allow_eager: bool = False):
        self.optimizers = list(optimizers)
        self.allow_eager = allow_eager
        for optimizer in self.optimizers:
            check_supported(optimizer)
            if not allow_eager and table.torch_class(optimizer, table.EAGER_ONLY):
                raise UnsupportedOptimizerError(
                    f"{type(optimizer).__qualname__}: {eager_only_reason(optimizer, True)}"
                )
        self.device: torch.device | None = None

    def prepare(self, device: torch.device | str, sparse: Iterable[torch.Tensor] = ()) -> None:
        """Set capturable flags, move host state to the device, install the hooks. Idempotent.

        Live hyperparameters become device tensors at the first `before_call` or optimizer step.
        `sparse`: parameters known to get sparse gradients (`sparse_parameters`): never fused.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device is not None:
            if device != self.device:
                raise GraphStepError(f"the optimizers were prepared for {self.device}, not {device}.")
            return
        known_sparse = {id(p) for p in sparse}
        plans = [
            plan(optimizer, device, known_sparse) for optimizer in self.optimizers
        ]  # raises before any change
        for optimizer, group_plans in zip(self.optimizers, plans):
            if group_plans and group_plans[0].eager_only and not self.allow_eager:
                why = group_plans[0].eager_only
                raise UnsupportedOptimizerError(f"{type(optimizer).__qualname__} on {device.type}: {why}")
        self.device = device
        for optimizer, group_plans in zip(self.optimizers, plans):
            first = optimizer not in LIVE  # a second adapter of it (an eager twin's, say) logs nothing
            live = Live.of(optimizer, device)
            live.plans = group_plans
            live.sparse |= {
                i for g in optimizer.param_groups for p in g["params"] if (i := id(p)) in known_sparse
            }
            for group, p in zip(optimizer.param_groups, group_plans):
                if p.capturable:
                    group["capturable"] = True
                if p.fuse:
                    group["fused"] = True
            if any(p.capturable for p in group_plans):
                optimizer.defaults["capturable"] = True  # for groups added later
            # Unlike torch's constructor for a user's fused=True, `_step_supports_amp_scaling` is not set
            # when graphstep chose fused: the optimizer still looks to GradScaler and Lightning like the one
            # the user built, which leaves unscaling to them (Lightning's mixed-precision plugin refuses to
            # clip an optimizer that unscales itself; seen on the H100 with bf16-mixed and clipping).
            # GradScaler then reads found_inf on the host: an eager segment (backends/library_segments.py).
            chose_fused = any(p.fuse for p in group_plans)
            if (
                chose_fused
                and optimizer.defaults.get("foreach") is None
                and optimizer.defaults.get("fused") is None
            ):
                optimizer.defaults["fused"] = True  # for groups added later
            move_host_state(optimizer)
            install_load_hooks(optimizer, Live.absorb_loaded)
            if first:
                _log_plan(optimizer, group_plans)

    def before_call(self) -> None:
        """Put the live tensors into the param groups, copying in any number assigned since.

        An identity test per live key when nothing was assigned.
        """
        for optimizer in self.optimizers:
            live = LIVE.get(optimizer)
            if live is not None:
                live.absorb(optimizer)

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

    # -- what the step's lifecycle asks ----------------------------------------------------------

    def live_keys(self, optimizer: Optimizer) -> set[str]:
        """Hyperparameters live in every param group of `optimizer`: "lr", "betas" (both positions
        live) or "betas[0]" (only that position). Empty for an optimizer graphstep does not know."""
        plans = self._plans(optimizer)
        if not plans:
            return set()
        keys = None
        for p in plans:
            names = set()
            for key, where in p.live.items():
                if where is table.SCALAR or len(where) == _width(optimizer, key):
                    names.add(key)
                names.update(f"{key}[{i}]" for i in where or ())
            keys = names if keys is None else keys & names
        return keys or set()

    def can_stay_in_graph(self, optimizer: Optimizer, key: str) -> bool:
        """Whether a change of param-group `key` ("lr", "betas", "betas[1]", "initial_lr", ...)
        leaves `optimizer`'s step correct inside the graph: the key is live, or torch's step never
        reads it after the state exists (a scheduler's own bookkeeping such as `initial_lr`,
        `max_momentum`). False for anything of an optimizer graphstep does not know: a change of a
        baked key needs its step to run eagerly (an eager segment)."""
        if key in self.live_keys(optimizer):
            return True
        name = table.known_class(optimizer)
        if name is None or self.eager_only(optimizer):
            return False
        base = key.split("[", 1)[0]
        return base not in optimizer.defaults or (name, base) in table.READ_WHEN_STATE_IS_MADE

    def eager_only(self, optimizer: Optimizer) -> str | None:
        """Why `optimizer`'s step can never be in a graph (host reads in every step), or None."""
        plans = self._plans(optimizer)
        return (plans[0].eager_only if plans else eager_only_reason(optimizer, True)) or None

    def sparse_grads(self, optimizer: Optimizer) -> str | None:
        """Why `optimizer`'s step cannot be in a graph because of sparse gradients, or None."""
        live = LIVE.get(optimizer)
        if live is None or not live.sparse:
            return None
        return (
            "it updates parameters whose gradients are sparse (nn.Embedding or nn.EmbeddingBag with "
            "sparse=True): how many rows a sparse gradient holds, and how many a momentum buffer made "
            "from it accumulates, depends on the data, and a graph holds fixed sizes"
        )

    def why_baked(self, optimizer: Optimizer, key: str) -> str:
        """One line for a log message: why a change of `key` cannot stay in the graph."""
        plans = self._plans(optimizer)
        return table.why_baked(table.known_class(optimizer), plans[0].impl if plans else None, key)

    def _plans(self, optimizer: Optimizer) -> list[GroupPlan]:
        live = LIVE.get(optimizer)
        if live is not None and live.plans:
            return live.plans
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return plan(optimizer, self.device or (params[0].device if params else "cpu"))


def make_capturable(
    optimizer: Optimizer, device: torch.device | str | None = None, model: torch.nn.Module | None = None
) -> OptimizerAdapter:
    """Prepare `optimizer` as `graphstep.capture(optimizer=...)` does, and return its adapter.

    Apply it to an eager twin, so both runs use the same settings (a bitwise comparison needs
    that). `device` defaults to the device of the optimizer's first parameter. Nothing is needed
    per step: a step pre-hook keeps the live hyperparameters in the param groups (and puts a group
    that meets sparse gradients back to its user's implementation before its first step). `model`:
    its sparse embeddings' weights are known to get sparse gradients before any step.
    """
    if device is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
    adapter = OptimizerAdapter([optimizer], allow_eager=True)
    adapter.prepare(device, sparse_parameters([model] if model is not None else []))
    return adapter


def sparse_parameters(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The weights of the sparse embeddings (`nn.Embedding` / `nn.EmbeddingBag` with `sparse=True`)
    among `modules` and their submodules: their gradients are sparse."""
    found: dict[int, torch.Tensor] = {}
    for root in modules:
        for module in root.modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
                found[id(module.weight)] = module.weight
    return list(found.values())


def sparse_padding(roots: Iterable[tuple[str, torch.nn.Module]]) -> str | None:
    """Why a step training these modules (label, module) cannot be graphed because of a sparse
    embedding with a `padding_idx`, or None. Its backward leaves the padding rows out of the sparse
    gradient (boolean-mask indexing): a size that depends on the data, found only as a host sync
    inside autograd's backward, where no user line explains it."""
    for label, root in roots:
        for path, module in root.named_modules():
            if (
                isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                and module.sparse
                and module.padding_idx is not None
                and module.weight.requires_grad
            ):
                where = f"{label}.{path}" if path else label
                kind = type(module).__name__
                return (
                    f"{where} is nn.{kind}(sparse=True, padding_idx={module.padding_idx}): its backward leaves "
                    "the padding rows out of the sparse gradient, so the gradient's size depends on the data, "
                    "which no graph can hold. Use sparse=False (a dense gradient, any optimizer, all in the "
                    "graph), or sparse=True without padding_idx (the optimizer's step then runs as an eager "
                    'segment), or run this step with Config(backend="eager").'
                )
    return None


# -- helpers ------------------------------------------------------------------------------------


def _width(optimizer: Optimizer, key: str) -> int:
    value = optimizer.defaults.get(key)
    return len(value) if isinstance(value, (tuple, list)) else 1


def _log_plan(optimizer: Optimizer, group_plans: list[GroupPlan]) -> None:
    name = type(optimizer).__qualname__
    if group_plans and group_plans[0].eager_only:
        log.info("graphstep: %s: its step runs eagerly: %s", name, group_plans[0].eager_only)
        return
    numbers_ = table.numbers_of(optimizer)
    if any(p.fuse for p in group_plans):
        log.info(
            "graphstep: %s: runs fused=True (graphstep's choice on CUDA for SGD, Adam and AdamW constructed "
            "with neither foreach nor fused): its foreach update would cost the GPU more than eager's inside "
            "a graph, or bake lr; the fused kernel does neither. Pass foreach=True to keep foreach.",
            name,
        )
    for i, p in enumerate(group_plans):
        if p.kept:
            log.info(
                "graphstep: %s param group %d keeps its user's implementation (%s), not fused=True: %s.",
                name,
                i,
                p.impl,
                p.kept,
            )
        live = sorted(p.live)
        baked = [k for k in numbers_ if k not in p.live or p.live[k] is not table.SCALAR]
        log.info(
            "graphstep: %s param group %d (%s%s): live on the device: %s; baked into the graph (a change "
            "is caught by the guards): %s.",
            name,
            i,
            p.impl,
            ", capturable" if p.capturable else "",
            ", ".join(live) or "nothing",
            ", ".join(baked) or "nothing",
        )
        if table.known_class(optimizer) in ("Adam", "AdamW") and p.capturable and p.impl == "forloop":
            log.warning(
                "graphstep: %s with foreach=False made capturable writes NaN into parameters whose second "
                "moment is 0 when lr is exactly 0 (torch's capturable for-loop update divides 0 by -0; "
                "pytorch#126514), as a warm-up schedule starting at lr=0 does. Use foreach=True (the GPU "
                "default) or fused=True.",
                name,
            )
