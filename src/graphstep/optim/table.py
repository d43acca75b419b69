"""What each torch.optim optimizer reads on the device: the data behind `graphstep.optim`'s table.

A hyperparameter can stay *live* inside a CUDA graph when it is a 0-d device tensor that torch's
own implementation reads with device operations only: no `.item()`, no `if x != 0` on it, no
passing it where an operator takes a Python number (which converts with `.item()`). Which ones
qualify depends on the implementation that runs (fused, foreach, for-loop) once graphstep made
the optimizer capturable. Found by running each step with tensor hyperparameters under a
dispatch mode that flags host syncs (tests/test_optim_live.py repeats that check against the
installed torch, so a torch release that changes a path fails a test instead of a training run),
and by reading torch 2.6 and 2.13's sources: the verdicts agree, except that AdamW's for-loop
path read `weight_decay` live in 2.6 (its own adamw.py) and not since AdamW became
`Adam(decoupled_weight_decay=True)`. The table keeps the intersection.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import torch
from torch.optim import Optimizer

Impl = Literal["fused", "foreach", "forloop"]

SCALAR = None
"""In `LIVE`: the key holds one number (as opposed to a tuple of which some positions are live)."""

_ADAM_LIKE = {
    "fused": {"lr": SCALAR},
    "foreach": {"lr": SCALAR},
    # beta2 feeds `addcmul_(value=1 - beta2)`, a Python number: only beta1 is read as a tensor.
    "forloop": {"lr": SCALAR, "eps": SCALAR, "betas": (0,)},
}

LIVE: dict[str, dict[Impl, dict[str, tuple[int, ...] | None]]] = {
    "SGD": {"fused": {"lr": SCALAR}},  # `if group["momentum"] != 0` and float kernel arguments
    "Adam": _ADAM_LIKE,
    "AdamW": _ADAM_LIKE,
    "NAdam": {
        "foreach": {"lr": SCALAR},
        "forloop": {"lr": SCALAR, "eps": SCALAR, "momentum_decay": SCALAR, "betas": (0,)},
    },
    "RAdam": {"foreach": {"lr": SCALAR}, "forloop": {"lr": SCALAR, "eps": SCALAR, "betas": (0,)}},
    # Its foreach update multiplies by beta2 with a tensor overload, but lerps by 1 - beta1.
    "Adamax": {
        "foreach": {"lr": SCALAR, "betas": (1,)},
        "forloop": {"lr": SCALAR, "eps": SCALAR, "betas": (0, 1)},
    },
    "RMSprop": {"foreach": {"lr": SCALAR}, "forloop": {"eps": SCALAR}},
    "Adagrad": {"fused": {"lr": SCALAR}},  # fused Adagrad runs on the CPU only
    "Adadelta": {"foreach": {"lr": SCALAR}, "forloop": {"eps": SCALAR}},
    "ASGD": {
        "foreach": {"lr": SCALAR},
        "forloop": {"lr": SCALAR, "lambd": SCALAR, "alpha": SCALAR, "t0": SCALAR},
    },
    # lr is read only when the state is created (warm-up): a tensor there costs one .item() then.
    "Rprop": {impl: {"lr": SCALAR, "etas": (0, 1), "step_sizes": (0, 1)} for impl in ("foreach", "forloop")},
}
"""Per class and implementation (capturable where the class has the flag): the live keys."""

WHY_NOT_LIVE = {
    ("SGD", "momentum"): "SGD tests `momentum != 0` on the host in every step",
    ("SGD", "*"): "SGD's foreach and for-loop updates take lr, dampening and weight_decay as Python "
    "numbers (alpha=); fused SGD takes all but lr as float kernel arguments",
    ("*", "weight_decay"): "torch tests `weight_decay != 0` on the host in every step",
    ("RMSprop", "momentum"): "RMSprop tests `momentum > 0` on the host in every step",
    ("*", "fused"): "the fused kernel takes it as a float argument",
    ("*", "foreach"): "the foreach update passes it where a Python number is taken (scalar overloads)",
    ("*", "forloop"): "the for-loop update passes it where a Python number is taken (alpha=, value=)",
}

REFUSED = {
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
}
"""Classes that cannot run inside a captured step at all, not even as an eager segment."""

EAGER_ONLY = {
    "Adafactor": (
        "Adafactor reads norms and its step count on the host with .item() in every step(), so its step "
        "can run only eagerly. Use AdamW (capturable, or fused=True) to keep the optimizer in the graph."
    ),
}
"""Classes whose step() synchronises with the host every time: never in a graph, fine eagerly."""

ADAGRAD_ON_DEVICE = (
    "Adagrad keeps its step count on the host and reads it with .item() every step (its fused version "
    "runs only on the CPU), so its step can run only eagerly. Use AdamW or RMSprop (graphstep makes them "
    "capturable) to keep the optimizer in the graph."
)

READ_WHEN_STATE_IS_MADE = {("Adagrad", "initial_accumulator_value"), ("Rprop", "lr")}
"""Read only when a parameter's state is created (an eager warm-up), never by a captured step."""

FLAGS = frozenset(
    {
        "foreach",
        "fused",
        "capturable",
        "differentiable",
        "maximize",
        "nesterov",
        "amsgrad",
        "centered",
        "decoupled_weight_decay",
    }
)
"""Switches that pick a code path: never live (a change is a different computation)."""


def known_class(optimizer: Optimizer) -> str | None:
    """The torch.optim class whose step() `optimizer` runs, by name; None for anything else (a
    custom optimizer, a torch class whose step() a subclass overrides: it may read values any way)."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in LIVE:
            return cls.__name__ if type(optimizer).step is cls.step else None
    return None


def torch_class(optimizer: Optimizer, names: dict) -> str | None:
    """The first torch.optim class among `optimizer`'s bases named in `names`."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in names:
            return cls.__name__
    return None


def capturable_devices() -> tuple[str, ...]:
    """Device types where torch runs capturable optimizers (its own list: cuda, xpu, hpu, ...)."""
    from torch.optim import optimizer as torch_optimizer

    supported = getattr(torch_optimizer, "_get_capturable_supported_devices", None)  # private; 2.3+
    return tuple(supported(supports_xla=False)) if supported is not None else ("cuda", "xpu")


def implementation(group: dict) -> Impl:
    """The implementation a param group's step runs (resolving foreach=None as torch does)."""
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "forloop"
    from torch.optim.optimizer import _default_to_fused_or_foreach  # private; present in 2.6-2.13

    _, foreach = _default_to_fused_or_foreach(
        list(group["params"]), differentiable=bool(group.get("differentiable")), use_fused=False
    )
    return "foreach" if foreach else "forloop"


def numbers_of(optimizer: Optimizer) -> list[str]:
    """The hyperparameters of `optimizer.defaults` that hold numbers (or tuples of numbers)."""
    found = []
    for key, value in optimizer.defaults.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if key not in FLAGS and values and all(_is_number(v) for v in values):
            found.append(key)
    return found


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool)


HAS_FUSED = ("SGD", "Adam", "AdamW", "Adagrad")

FUSED_BY_CHOICE = ("SGD", "Adam", "AdamW")
"""Classes graphstep runs fused on CUDA when their user chose neither `foreach` nor `fused`.

torch's default there is foreach. For Adam/AdamW a captured step needs it capturable, and that
update keeps the step count and the bias corrections as per-parameter 0-d device tensors and divides
by them with extra foreach kernels (ViT-S/16: 304 more launches and 0.7 ms more GPU time per step
than eager's non-capturable foreach). The fused kernel reads the step count and lr on the device
anyway, in one launch per chunk of tensors: the graph costs the GPU no more than eager. SGD's foreach
update takes lr as a Python number (a schedule moves it to an eager segment) and, with weight
decay, allocates a copy of every gradient (in an eager segment, outside the graph's pool, where no
freed activation memory is at hand); its fused kernel reads lr as a device tensor and allocates
nothing. An explicit choice (`foreach=True`, `foreach=False`, `fused=False`) is kept; so is the
user's (torch's default) wherever the fused kernel would refuse the group (`why_not_fused`): sparse
gradients (`nn.Embedding(sparse=True)`, known from the module before the first step, or seen at a
step), a dtype or device it does not take. Such an optimizer's step then runs as torch's default
would, and with sparse gradients as an eager segment (`optim/modes.py`).
"""


def user_chose_neither(name: str, group: dict, device: torch.device) -> bool:
    """A group graphstep would run fused: SGD/Adam/AdamW on CUDA, neither foreach nor fused chosen."""
    if name not in FUSED_BY_CHOICE or device.type != "cuda" or group.get("differentiable"):
        return False
    return group.get("foreach") is None and group.get("fused") is None


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The parameter dtypes torch's fused SGD/Adam/AdamW kernels update (float8 is floating point too)."""


def why_not_fused(
    params: list, device: torch.device, sparse: Collection[int] = (), name: str | None = None
) -> str:
    """Why torch's fused kernel would refuse these parameters on `device` (empty: it takes them).
    `name`: the optimizer's class in the table (which fused kernel its step calls)."""
    if not fused_kernel_takes(params, device):
        return (
            f"torch's fused kernels take only plain floating-point tensors, all on {device.type}: "
            "its parameters are not"
        )
    if any(type(p).__name__ == "DTensor" for p in params) and not _dtensor_shards_fused(name):
        return (
            f"its parameters are DTensors (FSDP2, tensor parallel), and this torch's DTensor has no "
            f"sharding rule for the fused {name} kernel"
        )
    dtypes = sorted({str(p.dtype) for p in params if p.dtype not in FUSED_DTYPES})
    if dtypes:
        return f"the fused kernel does not update {', '.join(dtypes)} parameters"
    if any(id(p) in sparse or (p.grad is not None and p.grad.is_sparse) for p in params):
        return SPARSE_NOT_FUSED
    return ""


def _dtensor_shards_fused(name: str | None) -> bool:
    """Whether DTensor has a sharding rule for `name`'s fused kernel (Adam and AdamW have; SGD had
    none on torch 2.11: its first step raised NotImplementedError under FSDP2, seen on two H100s)."""
    kernel = {
        "SGD": "_fused_sgd_",
        "Adam": "_fused_adam",
        "AdamW": "_fused_adamw_",
        "Adagrad": "_fused_adagrad_",
    }
    if name not in kernel:
        return False
    try:
        import torch.distributed.tensor._ops  # noqa: F401  (registers the rules)
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    rules = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(str(op).startswith(f"aten.{kernel[name]}") for t in tables for op in getattr(rules, t, {}))


SPARSE_NOT_FUSED = (
    "its gradients are sparse (nn.Embedding or nn.EmbeddingBag with sparse=True), which torch's fused "
    "kernel refuses"
)


def fused_kernel_takes(params: list, device: torch.device) -> bool:
    """Whether every parameter is on `device` and of a kind torch's fused kernels update."""
    # torch's own test (floating point, a plain tensor type, a device with fused kernels).
    from torch.optim.optimizer import _default_to_fused_or_foreach  # private; present in 2.6-2.13

    fused, _ = _default_to_fused_or_foreach(params, differentiable=False, use_fused=True)
    return bool(params) and fused and all(p.device.type == device.type for p in params)


def why_baked(name: str | None, impl: Impl | None, key: str) -> str:
    """Why `key` of a `name` optimizer running `impl` stays a Python number baked into the graph."""
    if name is None:
        return "graphstep does not know how this optimizer's step() reads its hyperparameters"
    if key in FLAGS:
        return f"{key} picks a code path"
    for k in ((name, key), (name, "*"), ("*", key), ("*", impl)):
        if k in WHY_NOT_LIVE:
            return WHY_NOT_LIVE[k]
    return "torch reads it on the host"


def table_rows() -> list[tuple[str, str, str, str]]:
    """(optimizer, implementation, device tensor, eager segment on first change) per row, from `LIVE`."""
    params = [torch.nn.Parameter(torch.zeros(1))]
    rows = []
    for name, by_impl in LIVE.items():
        numbers = numbers_of(getattr(torch.optim, name)(params))
        for impl in (("fused",) if name in HAS_FUSED else ()) + ("foreach", "forloop"):
            if name == "Adagrad" and impl != "fused":
                rows.append((name, impl, "-", "the whole step, always (host step count; see below)"))
                continue
            live = by_impl.get(impl, {})
            tensors, baked = [], []
            for key in numbers:
                if (name, key) in READ_WHEN_STATE_IS_MADE and key not in live:
                    continue  # a change matters to new state only, made eagerly
                where = live.get(key, "baked")
                if where is SCALAR:
                    tensors.append(key)
                elif where == "baked":
                    baked.append(key)
                else:
                    tensors += [f"{key}[{i}]" for i in where]
                    baked += [f"{key}[{i}]" for i in range(2) if i not in where]
            rows.append((name, impl, ", ".join(tensors) or "-", ", ".join(baked) or "-"))
    return rows


def table_markdown() -> str:
    """The optimizer x hyperparameter x mechanism table, as in `graphstep.optim`'s docstring."""
    lines = [
        "| optimizer | implementation | device tensor (live) | eager segment on first change |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table_rows()]
    return "\n".join(lines)
