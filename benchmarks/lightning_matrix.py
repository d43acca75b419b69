"""Which Lightning recipes `GraphStepCallback` trains bitwise equal to plain Lightning, on one GPU.

    python benchmarks/lightning_matrix.py [--steps 16] [--out DIR]

The matrix: {SGD + momentum, SGD + Nesterov, AdamW, Adagrad, NAdam} x {OneCycleLR, StepLR,
CosineAnnealingLR, LambdaLR warm-up} x {"32-true", "bf16-mixed", "16-mixed"}, plus fused SGD and AdamW
under "16-mixed" (the optimizers that unscale themselves) and a few `accumulate_grad_batches > 1` rows.
Every combination trains a small MLP classifier twice in one process, in deterministic mode: plain
Lightning whose optimizer is prepared with `graphstep.optim.make_capturable` (the settings graphstep
gives a captured one), then the same with `GraphStepCallback`; gradient clipping on (off for the fused
optimizers under "16-mixed", which Lightning refuses to clip), the schedule
stepped every step, `self.log` in `training_step`. A row is "equal" when every step's loss, every
logged value, the step count and every parameter are bitwise equal (`torch.equal`), else "differs";
"error" when the graphstep run raised (its type, message and how many warm-ups and captures it had
done). Step times: ms per step over the second half of each run, synchronised.

Writes <out>/<gpu>_<date>_lightning-matrix.json (GPU, torch and Lightning versions, the config, a
row per combination) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import torch

import graphstep

try:
    import pytorch_lightning as pl
except ImportError:  # the unified package
    import lightning.pytorch as pl

from graphstep.demo.train import deterministic
from graphstep.integrations.lightning import callback_class

OPTIMIZERS: dict[str, Callable] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-3),
    "sgd_momentum_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True),
}


def _one_cycle(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    cycles = "momentum" in opt.defaults or "betas" in opt.defaults  # Adagrad has neither
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=4 * opt.defaults["lr"], total_steps=steps + 1, cycle_momentum=cycles
    )


SCHEDULES: dict[str, Callable] = {
    "one_cycle": _one_cycle,
    "step": lambda opt, steps: torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, steps // 4), gamma=0.5),
    "cosine": lambda opt, steps: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
    "warmup": lambda opt, steps: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)),
}

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
BASE = ("sgd_momentum", "sgd_nesterov", "adamw", "adagrad", "nadam")
ACCUMULATION = [  # (optimizer, schedule, precision, accumulate_grad_batches)
    ("sgd_nesterov", "one_cycle", "32-true", 2),
    ("sgd_momentum", "step", "bf16-mixed", 3),
    ("adamw", "cosine", "bf16-mixed", 2),
    ("nadam", "warmup", "32-true", 3),
    ("adamw_fused", "one_cycle", "16-mixed", 2),
]


def combinations() -> list[tuple[str, str, str, int]]:
    rows = [(o, s, p, 1) for o in BASE for s in SCHEDULES for p in PRECISIONS]
    rows += [(o, s, "16-mixed", 1) for o in ("sgd_momentum_fused", "adamw_fused") for s in SCHEDULES]
    return rows + ACCUMULATION


class Classifier(pl.LightningModule):
    def __init__(self, optimizer: str, schedule: str, steps: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 10)
        )
        self.recipe = optimizer, schedule, steps

    def training_step(self, batch, batch_idx):
        x, y = batch  # (64, 32) float, (64,) int
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer, schedule, steps = self.recipe
        opt = OPTIMIZERS[optimizer](self.parameters())
        graphstep.optim.make_capturable(opt, self.device)  # the same settings with and without graphstep
        sched = SCHEDULES[schedule](opt, steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Record(pl.Callback):
    """Every batch's loss, every logged row, and the time of the second half of the batches."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.losses: list[torch.Tensor] = []
        self.rows: list[dict] = []
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if len(self.losses) == self.batches // 2:
            _sync()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].clone())
        self.rows.append({k: v.clone() for k, v in trainer.callback_metrics.items()})

    def on_train_end(self, trainer, pl_module):
        _sync()
        self.end = time.perf_counter()

    def ms_per_step(self, accumulate: int) -> float:
        steps = (self.batches - self.batches // 2) / accumulate
        return (self.end - self.start) / steps * 1e3


def clips(case: tuple[str, str, str, int]) -> bool:
    """Gradient clipping is on, except for a fused optimizer under "16-mixed": it unscales inside its
    step, after Lightning would clip, and Lightning refuses that combination itself."""
    return not ("fused" in case[0] and case[2] == "16-mixed")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fit(case: tuple[str, str, str, int], steps: int, callbacks: list, accelerator: str = "gpu") -> dict:
    """One Lightning run of `case`; its losses, logged rows, module, step count and step time."""
    optimizer, schedule, precision, accumulate = case
    batches = steps * accumulate
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(batches * 64, 32, generator=g), torch.randint(0, 10, (batches * 64,), generator=g)
    )
    record = _Record(batches)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator=accelerator,
        devices=1,
        precision=precision,
        gradient_clip_val=1.0 if clips(case) else None,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *callbacks],
    )
    module = Classifier(optimizer, schedule, steps)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
    return {
        "losses": record.losses,
        "rows": record.rows,
        "module": module,
        "global_step": trainer.global_step,
        "progress": progress_counters(trainer.fit_loop.state_dict()),
        "ms": record.ms_per_step(accumulate),
    }


def progress_counters(state: dict, path: str = "") -> dict[str, int]:
    """A Lightning loop's counters (what a checkpoint resumes from), flattened:
    {'epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad.total.completed': n, ...}."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(progress_counters(value, f"{path}{key}."))
        elif isinstance(value, int) and not isinstance(value, bool):
            found[path + key] = value
    return found


def differences(plain: dict, graphed: dict) -> list[str]:
    """What differs between two runs (empty: bitwise equal)."""
    found = []
    if plain["global_step"] != graphed["global_step"]:
        found.append(f"global_step {plain['global_step']} != {graphed['global_step']}")
    counters = [k for k in plain["progress"] if plain["progress"][k] != graphed["progress"].get(k)]
    if counters:
        found.append(f"Lightning's counters differ: {counters[:3]}")
    if len(plain["losses"]) != len(graphed["losses"]):
        found.append(f"{len(plain['losses'])} batches != {len(graphed['losses'])}")
    for i, (a, b) in enumerate(zip(plain["losses"], graphed["losses"])):
        if not torch.equal(a, b):
            found.append(f"loss of batch {i}: {a.item()!r} != {b.item()!r}")
            break
    for i, (a, b) in enumerate(zip(plain["rows"], graphed["rows"])):
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            found.append(f"logged values after batch {i}: {a} != {b}")
            break
    for (name, p), q in zip(plain["module"].named_parameters(), graphed["module"].parameters()):
        if not torch.equal(p, q):
            found.append(f"parameter {name}: max |diff| {(p - q).abs().max().item():.3g}")
            break
    return found


def run_case(case: tuple[str, str, str, int], steps: int, *, cpu: bool = False) -> dict:
    """Plain Lightning, then GraphStepCallback, on `case`: a result row. `cpu`: a smoke test of this
    script (graphstep's recording backend, which bakes Python as a CUDA graph does)."""
    accelerator = "cpu" if cpu else "gpu"
    optimizer, schedule, precision, accumulate = case
    row: dict = {"optimizer": optimizer, "schedule": schedule, "precision": precision}
    row["accumulate_grad_batches"] = accumulate
    row["gradient_clip_val"] = 1.0 if clips(case) else None
    with deterministic():
        try:
            plain = fit(case, steps, [], accelerator)
        except Exception as exc:  # the recipe fails without graphstep too: not graphstep's to judge
            return row | {"result": "plain error", "error": f"{type(exc).__name__}: {exc}"[:600]}
        row["plain_ms"] = round(plain["ms"], 3)
        config = graphstep.Config(backend="recording") if cpu else None
        callback = callback_class(pl.__name__)(config=config)
        try:
            graphed = fit(case, steps, [callback], accelerator)
        except Exception as exc:
            stats = callback.stats
            row |= {"result": "error", "error_type": type(exc).__name__, "error": str(exc)[:1200]}
            row["at"] = {"warmups": stats.warmup_calls, "captures": stats.captures} if stats else None
            row["where"] = traceback.format_exception(exc)[-1][:300]
            if "scaler.step" in str(exc):  # GradScaler.step reads found_inf on the host (non-fused)
                row["blocked_by"] = (
                    "GradScaler.step host sync (an automatic eager segment for it is in progress)"
                )
            return row
    found = differences(plain, graphed)
    s = callback.stats
    row |= {"result": "differs" if found else "equal", "graphstep_ms": round(graphed["ms"], 3)}
    row["speedup"] = round(plain["ms"] / graphed["ms"], 2)
    row["stats"] = {"warmups": s.warmup_calls, "captures": s.captures, "replays": s.replays}
    if found:
        row["differences"] = found
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Lightning matrix: GraphStepCallback vs plain Lightning ({meta['gpu']}, torch {meta['torch']}, "
        f"Lightning {meta['lightning']}, {meta['date']})",
        "",
        f"{meta['config']}",
        "",
        "Result: "
        + ", ".join(f"{sum(r['result'] == k for r in rows)} {k}" for k in ("equal", "differs", "error"))
        + " (error: a GraphStepError at the first capture; plain ms / graphstep ms: per optimizer step).",
        "",
        "| optimizer | schedule | precision | accumulate | clip | result | plain ms | graphstep ms | speed-up | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.get("blocked_by") or (
            r.get("error_type", "") + ": " + r["error"][:160] if "error" in r else ""
        )
        note += "; ".join(r.get("differences", []))[:160]
        lines.append(
            f"| {r['optimizer']} | {r['schedule']} | {r['precision']} | {r['accumulate_grad_batches']} | "
            f"{r.get('gradient_clip_val') or 'off'} | {r['result']} | {r.get('plain_ms', '')} | {r.get('graphstep_ms', '')} | {r.get('speedup', '')} | "
            f"{note.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent / "results")))
    parser.add_argument("--only", default="", help="run combinations whose name contains this")
    parser.add_argument("--cpu", action="store_true", help="a smoke test on the CPU (recording backend)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("lightning_matrix: needs a CUDA GPU (or --cpu for a smoke test)")
        return 1
    meta = {
        "gpu": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "date": datetime.date.today().isoformat(),
        "config": (
            f"MLP 32-128-10 (GELU, LayerNorm), batch 64, {args.steps} optimizer steps per run, "
            "gradient_clip_val=1.0, schedule stepped every step, self.log in training_step, "
            "deterministic algorithms, optimizers prepared with graphstep.optim.make_capturable in both runs"
        ),
    }
    rows = []
    for case in combinations():
        if args.only and args.only not in "-".join(map(str, case)):
            continue
        start = time.perf_counter()
        if args.cpu and (case[2] == "16-mixed" or "fused" in case[0]):
            continue  # no GradScaler, no fused SGD/AdamW on the CPU
        row = run_case(case, args.steps, cpu=args.cpu)
        row["wall_s"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("where",)})[:400], flush=True)
    gpu = "h100" if "H100" in meta["gpu"] else meta["gpu"].split()[-1].lower()
    stem = Path(args.out) / f"{gpu}_{meta['date']}_lightning-matrix"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(meta, rows))
    counts = {
        r: sum(row["result"] == r for row in rows) for r in ("equal", "error", "differs", "plain error")
    }
    print(f"lightning_matrix: {counts} -> {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
