"""How far graphstep's optimizer settings move training from torch's defaults.

graphstep makes optimizers capturable and holds live hyperparameters as float32 device tensors
(`graphstep.optim.make_capturable`). Same settings, same bits: a captured step equals its eager
twin. Against an optimizer left as constructed (capturable=False, Python-float hyperparameters) the
arithmetic differs by rounding: capturable updates order their operations differently, a float32
lr rounds the scheduler's float64 value, a step count lives in a float32 tensor. This trains a small
transformer N steps twice from the same start and data, once with each, and reports the relative
parameter difference ||p_graphstep - p_default|| / ||p_default|| (all parameters as one vector).
Yardstick: the same difference between torch's own foreach and for-loop implementations, both
default. Schedules: constant lr, a linear warm-up from lr 0 then linear decay (transformers'
`get_linear_schedule_with_warmup`), OneCycleLR cycling momentum or beta1.

On the CPU torch refuses capturable optimizers; this script adds "cpu" to torch's list of capturable
devices so the CPU runs the GPU's capturable code paths (device-agnostic Python over ATen operations).
`--device cuda` measures on a GPU with no patch. Writes <hw>_<date>_optim-numerics.json and .md to --out.

    PYTHONPATH=src python benchmarks/optim_numerics.py [--device cpu] [--steps 100]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch
from torch import nn
from torch.optim import lr_scheduler as sched

import graphstep
from graphstep.bench.runner import gpu_slug
from graphstep.optim import make_capturable

OPTIONS = {
    "SGD": dict(lr=0.05, momentum=0.9, weight_decay=1e-4),
    "Adam": dict(lr=1e-3),
    "AdamW": dict(lr=1e-3, weight_decay=1e-2),
    "NAdam": dict(lr=1e-3),
    "RAdam": dict(lr=1e-3),
    "Adamax": dict(lr=2e-3),
    "RMSprop": dict(lr=1e-3, momentum=0.9),
    "Adagrad": dict(lr=1e-2),
    "Adadelta": dict(lr=1.0),
    "ASGD": dict(lr=1e-2),
    "Rprop": dict(lr=1e-3),
}
FLAGS = {
    "foreach": dict(foreach=True),
    "forloop": dict(foreach=False),
    "fused": dict(fused=True),
    "default": {},  # neither flag: on CUDA graphstep runs SGD/Adam/AdamW fused (its choice), torch foreach
}
VOCAB, SEQ, BATCH, WIDTH = 128, 16, 8, 32


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x, y: (B, T) int64
        return nn.functional.cross_entropy(self.head(self.block(self.embed(x))).flatten(0, 1), y.flatten())


def warmup(opt: torch.optim.Optimizer, steps: int) -> sched.LRScheduler:
    warm = max(1, steps // 10)
    return sched.LambdaLR(opt, lambda s: s / warm if s < warm else max(0.0, (steps - s) / (steps - warm)))


def onecycle(opt: torch.optim.Optimizer, steps: int) -> sched.LRScheduler:
    cycles = "momentum" in opt.defaults or "betas" in opt.defaults
    return sched.OneCycleLR(opt, max_lr=3 * opt.defaults["lr"], total_steps=steps + 1, cycle_momentum=cycles)


SCHEDULES = {"constant": None, "warmup-from-0": warmup, "OneCycleLR": onecycle}


@contextlib.contextmanager
def capturable_on_cpu(enabled: bool):
    """Add "cpu" to torch's capturable devices (every torch.optim module holds its own reference)."""
    modules = [
        m
        for n, m in sys.modules.items()
        if n.startswith("torch.optim") and hasattr(m, "_get_capturable_supported_devices")
    ]
    saved = {m: m._get_capturable_supported_devices for m in modules}
    if enabled:
        for m, f in saved.items():
            m._get_capturable_supported_devices = lambda supports_xla=True, f=f: [*f(supports_xla), "cpu"]
    try:
        yield
    finally:
        for m, f in saved.items():
            m._get_capturable_supported_devices = f


def train(
    name: str,
    impl: str,
    schedule: str,
    graphstep_settings: bool,
    steps: int,
    device: str,
    lr_scale: float = 1.0,
) -> tuple:
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    options = dict(OPTIONS[name], lr=OPTIONS[name]["lr"] * lr_scale)
    opt = getattr(torch.optim, name)(model.parameters(), **options, **FLAGS[impl])
    if graphstep_settings:
        make_capturable(opt, device)  # before the scheduler, as users write it
    scheduler = SCHEDULES[schedule](opt, steps) if SCHEDULES[schedule] else None
    g = torch.Generator().manual_seed(1)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = torch.randint(VOCAB, (BATCH, SEQ), generator=g).to(device)
        loss = model(x, x.roll(1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).double().cpu(), loss.item()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--optimizers", default=",".join(OPTIONS), help="comma-separated subset")
    args = parser.parse_args()
    if args.device != "cpu":  # run-to-run deterministic, so every difference is the settings'
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rows = []
    with capturable_on_cpu(args.device == "cpu"):
        for name in args.optimizers.split(","):
            fused = name in ("SGD", "Adam", "AdamW") or (name == "Adagrad" and args.device == "cpu")
            impls = ["foreach", "forloop"] + (["fused"] if fused else [])
            impls += ["default"] if name in ("SGD", "Adam", "AdamW") else []
            for schedule in SCHEDULES:
                default = {i: train(name, i, schedule, False, args.steps, args.device) for i in impls}
                yardstick = rel_diff(default["forloop"][0], default["foreach"][0])
                # torch's fused kernel against its default (foreach), both as constructed: what choosing
                # fused moves by itself, before any graphstep setting.
                fused_vs_default = (
                    rel_diff(default["fused"][0], default["default"][0]) if "default" in default else None
                )
                # One float32 ulp more lr, every step: how far plain rounding noise carries in N steps.
                nudged = train(name, "foreach", schedule, False, args.steps, args.device, 1 + 2.0**-23)[0]
                ulp = rel_diff(nudged, default["foreach"][0])
                for impl in impls:
                    if name == "Adagrad" and impl != "fused":
                        continue  # its step runs eagerly on a GPU, as constructed: nothing changes
                    ours, loss = train(name, impl, schedule, True, args.steps, args.device)
                    rows.append(
                        dict(
                            optimizer=name,
                            impl=impl,
                            schedule=schedule,
                            rel_diff=rel_diff(ours, default[impl][0]),
                            yardstick_foreach_vs_forloop=yardstick,
                            yardstick_lr_one_ulp=ulp,
                            torch_fused_vs_default=fused_vs_default if impl == "default" else None,
                            loss_default=default[impl][1],
                            loss_graphstep=loss,
                        )
                    )
                    print(_line(rows[-1]), flush=True)
    write(rows, args)


def _fmt(x: float | None) -> str:
    return "-" if x is None else "NaN" if math.isnan(x) else "0" if x == 0 else f"{x:.1e}"


def _line(r: dict) -> str:
    return (
        f"| {r['optimizer']} | {r['impl']} | {r['schedule']} | {_fmt(r['rel_diff'])} | "
        f"{_fmt(r['yardstick_foreach_vs_forloop'])} | {_fmt(r['yardstick_lr_one_ulp'])} | "
        f"{_fmt(r.get('torch_fused_vs_default'))} | "
        f"{r['loss_default']:.4f} | {r['loss_graphstep']:.4f} |"
    )


def write(rows: list[dict], args: argparse.Namespace) -> None:
    hw = "cpu" if args.device == "cpu" else gpu_slug(torch.cuda.get_device_name())
    stem = Path(args.out) / f"{hw}_{datetime.date.today().isoformat()}_optim-numerics"
    stem.parent.mkdir(parents=True, exist_ok=True)
    config = dict(
        device=args.device,
        hardware=platform.processor() or platform.machine()
        if args.device == "cpu"
        else torch.cuda.get_device_name(),
        torch=torch.__version__,
        graphstep=graphstep.__version__,
        python=platform.python_version(),
        steps=args.steps,
        model=f"Embedding({VOCAB}, {WIDTH}) + TransformerEncoderLayer({WIDTH}, 4 heads, ff {2 * WIDTH}) + Linear, float32",
        batch=f"{BATCH} x {SEQ} random tokens, next-token targets",
        options=OPTIONS,
        capturable_on_cpu=args.device == "cpu",
    )
    stem.with_suffix(".json").write_text(json.dumps(dict(config=config, rows=rows), indent=1))
    lines = [
        f"# Optimizer numerics: graphstep's settings vs torch's defaults ({args.device}, {args.steps} steps)",
        "",
        f"torch {torch.__version__}, graphstep {graphstep.__version__}, {config['model']}, batch {config['batch']}.",
        "`rel diff`: ||p_graphstep - p_default|| / ||p_default|| over all parameters after the last step;",
        "graphstep = `make_capturable` (capturable, live hyperparameters as float32 tensors), default = the",
        "optimizer as constructed. Yardsticks, both between default runs: `foreach vs for-loop` (torch's two",
        "implementations) and `lr +1 ulp` (the foreach run with lr * (1 + 2^-23): float32 rounding noise",
        "carried through N steps). NaN: capturable for-loop Adam/AdamW at lr exactly 0 (pytorch#126514).",
        "impl `default`: constructed with neither foreach nor fused; graphstep runs SGD/Adam/AdamW fused there on",
        "CUDA (its choice; on the CPU it keeps torch's choice), torch's default is foreach. `torch fused vs",
        "default`: torch's fused=True against its default, both as constructed (what fused moves by itself).",
        "",
        "| optimizer | impl | schedule | rel diff | foreach vs for-loop | lr +1 ulp | torch fused vs default "
        "| loss default | loss graphstep |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        *[_line(r) for r in rows],
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
