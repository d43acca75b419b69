"""What `graphstep bench` trains: a `Workload` per config (model, optimizer, scheduler, step, data),
and the gpt suite's configs (`suites.py` lists the suites).

`--suite gpt` (the default) is the built-in GPT at two sizes; `--suite models` is real models no one
here wrote (`models.py`: torchvision, timm, transformers, torch_geometric, and a PPO update).
A builder gets a `BuildContext` (device, how many calls the run makes, tiny sizes for CPU tests) and
returns a `Workload`. A builder whose package is missing raises `PackageMissing`: the row says so.

Every method of one config runs `workload.make_step(forward)`, where `forward` is the model itself or
a `torch.compile`d model; the scheduler, where there is one, steps after every call, outside the
step, as a real training loop does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..demo.gpt import GPT, GPT2_SMALL, TINY, GPTConfig, make_batches
from ..demo.train import CLIP_NORM, LR, make_optimizer, make_train_step

StepFn = Callable[..., Tensor]


class PackageMissing(Exception):
    """A workload's package is not installed, or does not import: the row is skipped, saying which."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildContext:
    device: torch.device
    """Where the model, data and optimizer state live."""
    n_calls: int
    """Calls the run will make (warm-up, timed, pipelined, profiled): schedulers are sized to it."""
    tiny: bool = False
    """Tiny sizes, for CPU tests: same code paths, seconds instead of minutes."""

    def fused(self) -> dict[str, Any]:
        """Optimizer keyword arguments: none on CUDA (each method gets the optimizer as users write
        it; graphstep adapts it itself). On CPU, where tests capture with the recording backend,
        `fused=True`: the other implementations read their step count on the host there."""
        return {} if self.device.type == "cuda" else {"fused": True}

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on CUDA (every method, every model); nothing on CPU, where tests run."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclasses.dataclass(kw_only=True)
class Workload:
    model: nn.Module
    """The root module: graphstep's `model=`, what the compile methods compile, what is counted."""
    optimizer: torch.optim.Optimizer
    """As a user constructs it; graphstep adapts it on its first call (capturable, lr a tensor)."""
    make_step: Callable[[Callable[..., Any]], StepFn]
    """`make_step(forward)` -> the training step; `forward` is `model` or a compiled `model`."""
    batches: list[tuple[Tensor, ...]]
    """Positional arguments of successive calls, cycled."""
    scheduler: Any = None
    """`.step()` after every call, outside the step (None: no scheduler)."""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    """JSON-able description: shapes, optimizer, scheduler, package versions."""

    def after_call(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    name: str
    """Name on the command line and in the results."""
    label: str
    """How the README's table names it."""
    build: Callable[[BuildContext], Workload]
    """Builds the workload (imports its package first)."""
    packages: tuple[str, ...] = ()
    """Import names of the optional packages it needs (checked before a process is started)."""
    timed_steps: int = 100
    """Steps timed per method in a full run."""
    quick_timed_steps: int = 30
    """Steps timed per method with --quick."""


def need(package: str) -> Any:
    """Import an optional package, or raise `PackageMissing` saying why it cannot be used."""
    try:
        return importlib.import_module(package)
    except Exception as e:  # a broken install (an extension built for another torch) counts as missing
        first = (str(e).strip().splitlines() or [""])[0]
        raise PackageMissing(
            f"{package} is not usable here ({type(e).__name__}: {first}); pip install 'graphstep[bench]'"
        ) from e


def version_of(module: Any) -> str:
    return str(getattr(module, "__version__", "?"))


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the GPT suite


def _gpt(cfg: GPTConfig, batch_size: int) -> Callable[[BuildContext], Workload]:
    def build(ctx: BuildContext) -> Workload:
        model_cfg = (
            dataclasses.replace(cfg, vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
            if ctx.tiny
            else cfg
        )
        bs = 2 if ctx.tiny else batch_size
        torch.manual_seed(0)
        with ctx.device:
            model = GPT(model_cfg)
        # Every method, eager ones included, gets graphstep's optimizer settings (capturable, lr a
        # device tensor), as in earlier runs of this suite: the numbers stay comparable with them.
        if ctx.device.type == "cuda":
            opt = make_optimizer(model, ctx.device)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, **ctx.fused())
        amp = ctx.device.type == "cuda"
        return Workload(
            model=model,
            optimizer=opt,
            make_step=lambda forward: make_train_step(forward, opt, amp=amp),
            batches=make_batches(model_cfg, batch_size=bs, n_batches=8, device=ctx.device),
            details=dict(
                model=dataclasses.asdict(model_cfg),
                batch=f"{bs}×{model_cfg.seq_len} tokens",
                optimizer=f"AdamW(lr={LR}) with graphstep.optim.make_capturable for every method "
                "(capturable=True, lr a device tensor)",
                clip=CLIP_NORM,
                scheduler=None,
            ),
        )

    return build


GPT_CONFIGS = {
    # Launch-bound: each kernel is shorter than its launch, so the host decides the step time.
    "tiny": BenchConfig(
        name="tiny", label="tiny GPT (0.9M, batch 8×64)", build=_gpt(TINY, 8), timed_steps=200, quick_timed_steps=30
    ),
    # 8 x 1024 tokens with bf16 autocast peaks well under 20 GB.
    "gpt2_small": BenchConfig(
        name="gpt2_small", label="GPT-2 small (163M, batch 8×1024)", build=_gpt(GPT2_SMALL, 8),
        timed_steps=100, quick_timed_steps=20,
    ),
}  # fmt: skip
