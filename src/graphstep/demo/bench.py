"""`graphstep bench`: every way to run a training step, side by side on one GPU, in one run.

Methods (same model, data, AdamW made capturable with a tensor lr, clip_grad_norm_(1.0), bf16 autocast):
  eager               the step as written
  compile             torch.compile(model); backward, clip and optimizer eager
  reduce_overhead     torch.compile(model, mode="reduce-overhead"): cudagraph trees around the
                      model's forward and backward; clip and optimizer eager
  manual_graph        the whole step hand-captured with torch.cuda.graph (the expert's recipe)
  graphstep           graphstep.capture around the eager step
  graphstep_compiled  graphstep.capture around the step with a torch.compile(model) inside

How each number is measured: see MEASUREMENT below (also written into every result file).

Results go to `<out>/<gpu>_<date>.json`, `.md` and `.png` (`_quick` appended for --quick runs).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import itertools
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import graphstep
from graphstep.demo.gpt import GPT, GPT2_SMALL, TINY, GPTConfig, make_batches
from graphstep.demo.train import CLIP_NORM, LR, StepFn, make_optimizer, make_train_step, synchronize, timed

log = logging.getLogger("graphstep")

METHODS = ("eager", "compile", "reduce_overhead", "manual_graph", "graphstep", "graphstep_compiled")
WARMUP_CALLS = 6
"""Calls before timing: graphstep's 3 warm-up steps + its capture, cudagraph trees' warm-up + record,
compilation, with a margin. The same for every method."""
N_BATCHES = 8

MEASUREMENT = {
    "step_ms": "median over the timed steps of one step's wall clock, with torch.cuda.synchronize() before "
    "and after the call: one step's latency (host dispatch plus GPU work, nothing of the previous step queued).",
    "kernel_ms": "GPU time of one step of this row's method: torch.profiler over a few steady-state steps, the "
    "sum of the self device time of every GPU event (kernels, memcpy, memset; the profiler table's 'Self CUDA "
    "time total') divided by the steps. For graph methods, the replayed graph's kernels. The floor step_ms "
    "could reach.",
    "peak_reserved_gib": "torch.cuda.max_memory_reserved() at the end of the method, its peak statistics reset "
    "at the start, after the previous method's model, graphs and compiled code were freed and empty_cache() ran.",
    "capture_s": f"wall clock of the first {WARMUP_CALLS} calls, synchronised: warm-up, compilation, capture, until "
    "steady state. Every method gets the same number of calls, so eager's value is what that many plain steps "
    "cost. Compilation can be faster when inductor's on-disk cache was warmed by an earlier method or run.",
    "ratio_to_graphstep": "step_ms divided by graphstep's step_ms for the same config (> 1: slower than graphstep).",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    name: str
    """Name on the command line and in the results."""
    model: GPTConfig
    """Model shape."""
    batch_size: int
    """Sequences per step (each `model.seq_len` tokens)."""
    timed_steps: int
    """Steps timed per method in a full run."""
    quick_timed_steps: int
    """Steps timed per method with --quick."""


CONFIGS = {
    # Launch-bound: each kernel is shorter than its launch, so the host decides the step time.
    "tiny": BenchConfig(name="tiny", model=TINY, batch_size=8, timed_steps=200, quick_timed_steps=30),
    # 8 x 1024 tokens with bf16 autocast peaks well under 20 GB.
    "gpt2_small": BenchConfig(
        name="gpt2_small", model=GPT2_SMALL, batch_size=8, timed_steps=100, quick_timed_steps=20
    ),
}


def run_bench(
    *,
    configs: Sequence[str] = tuple(CONFIGS),
    methods: Sequence[str] = METHODS,
    out_dir: str | Path = "benchmarks/results",
    quick: bool = False,
    steps: int | None = None,
) -> int:
    """Benchmark `methods` on `configs`, write the result files, print the table.

    Returns 0 when every method ran, 1 when some failed (their rows carry the error), 2 without CUDA.
    """
    if not torch.cuda.is_available():
        print(
            "graphstep bench needs a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "It compares CUDA graph methods, which do not exist on CPU. "
            "`graphstep demo` runs on CPU and checks graphstep's results against eager.",
            file=sys.stderr,
        )
        return 2
    unknown = [c for c in configs if c not in CONFIGS] + [m for m in methods if m not in METHODS]
    if unknown or (steps is not None and steps < 1):
        raise ValueError(
            f"unknown {unknown} (configs: {list(CONFIGS)}, methods: {list(METHODS)}) or steps {steps} < 1"
        )

    _cupti_graph_workaround()
    device = torch.device("cuda")
    profiled_steps = 3 if quick else 5
    rows: list[dict[str, Any]] = []
    for name in configs:
        bc = CONFIGS[name]
        timed_steps = steps or (bc.quick_timed_steps if quick else bc.timed_steps)
        batches = make_batches(bc.model, batch_size=bc.batch_size, n_batches=N_BATCHES, device=device)
        for method in methods:
            rows.append(
                _run_method(method, bc, batches, timed_steps=timed_steps, profiled_steps=profiled_steps)
            )
    add_ratios(rows)

    meta = _meta(configs=configs, methods=methods, quick=quick, steps=steps, profiled_steps=profiled_steps)
    paths = write_results(rows, meta, out_dir)
    print(markdown_table(rows))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 1 if any(r["error"] for r in rows) else 0


# ---------------------------------------------------------------- one method


def _run_method(
    method: str,
    bc: BenchConfig,
    batches: list[tuple[Tensor, Tensor]],
    *,
    timed_steps: int,
    profiled_steps: int,
) -> dict[str, Any]:
    row: dict[str, Any] = dict(
        config=bc.name, method=method, step_ms=None, kernel_ms=None, peak_reserved_gib=None,
        capture_s=None, ratio_to_graphstep=None, final_loss=None, error=None,
    )  # fmt: skip
    _release()
    torch.cuda.reset_peak_memory_stats()
    device = torch.device("cuda")
    close: Callable[[], None] | None = None
    try:
        torch.manual_seed(0)  # identical initial weights for every method
        with device:
            model = GPT(bc.model)
        opt = make_optimizer(model, device)
        step, close = _make_step(method, model, opt)
        batch = itertools.cycle(batches)

        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(WARMUP_CALLS):
            step(*next(batch))
        synchronize(device)
        row["capture_s"] = time.perf_counter() - t0

        step_s = []
        for _ in range(timed_steps):
            loss, dt = timed(step, *next(batch), device=device)
            step_s.append(dt)
        row["step_ms"] = statistics.median(step_s) * 1e3
        final_loss = loss.item()  # read now: reduce_overhead's next step overwrites its graph-owned output
        row["kernel_ms"] = _kernel_ms(step, [next(batch) for _ in range(profiled_steps)])
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if math.isfinite(final_loss):
            row["final_loss"] = final_loss
        else:  # JSON has no NaN: the value goes into the error
            row["error"] = f"non-finite loss {final_loss} after {WARMUP_CALLS + timed_steps} steps"
    except Exception as e:  # one broken method must not lose the others' numbers
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        log.warning(
            "graphstep bench: %s/%s failed: %s",
            bc.name,
            method,
            row["error"],
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
    finally:
        try:
            if close is not None:
                close()
        except Exception as e:
            log.warning(
                "graphstep bench: %s/%s: releasing its graphs failed: %s: %s",
                bc.name,
                method,
                type(e).__name__,
                e,
            )
    if row["error"] is None:
        log.info(
            "graphstep bench: %s/%s: %.2f ms/step, kernels %s ms, peak reserved %.2f GiB, %.1f s to steady state",
            bc.name, method, row["step_ms"], _fmt(row["kernel_ms"]), row["peak_reserved_gib"], row["capture_s"],
        )  # fmt: skip
    return row


def _make_step(
    method: str, model: GPT, opt: torch.optim.Optimizer
) -> tuple[StepFn, Callable[[], None] | None]:
    """The step callable for `method`, and what releases its graphs (None: nothing to release)."""
    if method == "eager":
        return make_train_step(model, opt, amp=True), None
    if method == "compile":
        return make_train_step(torch.compile(model), opt, amp=True), None
    if method == "reduce_overhead":
        inner = make_train_step(torch.compile(model, mode="reduce-overhead"), opt, amp=True)

        def step(x: Tensor, y: Tensor) -> Tensor:
            # Tells cudagraph trees a new iteration begins: the previous step's graph outputs may now
            # be overwritten. Without it, grads the optimizer read look still alive and it re-records.
            torch.compiler.cudagraph_mark_step_begin()
            return inner(x, y)

        return step, None
    if method == "manual_graph":
        manual = ManualGraphStep(make_train_step(model, opt, amp=True))
        return manual, manual.close
    if method in ("graphstep", "graphstep_compiled"):
        forward = torch.compile(model) if method == "graphstep_compiled" else model
        captured = graphstep.capture(make_train_step(forward, opt, amp=True), model=model, optimizer=opt)
        return captured, captured.close
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


class ManualGraphStep:
    """The whole step hand-captured into one CUDA graph: what graphstep automates, with none of its checks.

    Calls 1..warmup run the step eagerly on a side stream (AdamW creates its moments, cuBLAS its
    workspaces; capture would fail or bake in the wrong state otherwise). The next call copies its
    inputs into static buffers, captures the step (capture runs nothing) and replays it; later calls
    copy inputs and replay. Each call is one real step. The loss returned is the graph's own buffer.
    """

    def __init__(self, fn: StepFn, *, warmup: int = 3):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.side = torch.cuda.Stream()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[Tensor, Tensor, Tensor] | None = None  # x, y, loss

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = self.fn(x, y)
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        if self.graph is None:
            sx, sy = x.clone(), y.clone()
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (NCCL's watchdog, say) may use CUDA meanwhile.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.static = (sx, sy, self.fn(sx, sy))
        else:
            assert self.static is not None
            self.static[0].copy_(x)
            self.static[1].copy_(y)
        self.graph.replay()
        return self.static[2]

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()  # frees the graph's private memory pool
        self.graph, self.static = None, None


def _kernel_ms(step: StepFn, batches: list[tuple[Tensor, Tensor]]) -> float | None:
    """GPU milliseconds of one step: profiler device time of `len(batches)` steps, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x, y in batches:
            step(x, y)
        torch.cuda.synchronize()
    # The same sum as the profiler table's "Self CUDA time total": device-side events only, so
    # nothing is counted twice through the CPU ops that launched it.
    total_us = sum(
        e.self_device_time_total
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )
    if total_us <= 0:
        log.warning("graphstep bench: the profiler recorded no GPU activity; kernel_ms left empty")
        return None
    return total_us / 1e3 / len(batches)


def _cupti_graph_workaround() -> None:
    """Keep CUPTI attached between profiler sessions on CUDA < 12.6, as torch.profiler does itself
    when inductor's global cudagraphs flag is set: re-initialising CUPTI once CUDA graphs exist
    crashes there. manual_graph and graphstep do not set that flag, and we profile once per method."""
    cuda = torch.version.cuda
    if cuda and tuple(int(v) for v in cuda.split(".")[:2]) < (12, 6):
        os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")
        os.environ.setdefault("TEARDOWN_CUPTI", "0")


def _release() -> None:
    """Free everything the previous method left: compiled code, cudagraph trees, cached blocks."""
    gc.collect()  # the previous method's model and step sit in reference cycles (closures, hooks)
    torch._dynamo.reset()  # also resets cudagraph trees and their memory pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- results


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Set each row's `ratio_to_graphstep` (step_ms over graphstep's, same config; None without one)."""
    ref = {r["config"]: r["step_ms"] for r in rows if r["method"] == "graphstep" and r["step_ms"]}
    for r in rows:
        base = ref.get(r["config"])
        r["ratio_to_graphstep"] = r["step_ms"] / base if base and r["step_ms"] is not None else None


def gpu_slug(name: str) -> str:
    """A short file-name-safe GPU name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090"."""
    words = [w for w in re.split(r"[\s_-]+", name) if w.lower() not in ("nvidia", "geforce", "tesla", "")]
    if not words:
        return "gpu"
    slug = words[0] + (words[1] if len(words) > 1 and words[0].isalpha() else "")
    return re.sub(r"[^a-z0-9]", "", slug.lower()) or "gpu"


def _meta(
    *, configs: Sequence[str], methods: Sequence[str], quick: bool, steps: int | None, profiled_steps: int
):
    gpu_name = torch.cuda.get_device_name()
    details = {}
    for name in configs:
        bc = CONFIGS[name]
        with torch.device("meta"):  # counts parameters without allocating them
            n_params = sum(p.numel() for p in GPT(bc.model).parameters())
        details[name] = dict(
            model=dataclasses.asdict(bc.model), batch_size=bc.batch_size, tokens_per_step=bc.batch_size * bc.model.seq_len,
            parameters=n_params, timed_steps=steps or (bc.quick_timed_steps if quick else bc.timed_steps),
            warmup_calls=WARMUP_CALLS, profiled_steps=profiled_steps,
        )  # fmt: skip
    return dict(
        gpu=gpu_slug(gpu_name), gpu_name=gpu_name, torch=torch.__version__, cuda=torch.version.cuda,
        date=datetime.date.today().isoformat(), python=platform.python_version(),
        graphstep=getattr(graphstep, "__version__", None), quick=quick, methods=list(methods), configs=details,
        step=f"AdamW(lr={LR}, graphstep.optim.make_capturable: capturable=True, lr a device tensor; foreach), clip_grad_norm_({CLIP_NORM}), "
        "bf16 autocast, zero_grad(set_to_none=True); deterministic algorithms off",
        measurement=MEASUREMENT,
    )  # fmt: skip


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write `<gpu>_<date>[_quick]` .json (meta + rows), .md and, with matplotlib, .png. Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['gpu']}_{meta['date']}" + ("_quick" if meta.get("quick") else "")
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    paths[1].write_text(_markdown(rows, meta))
    try:
        import matplotlib
    except ImportError:
        log.warning(
            "graphstep bench: matplotlib is not installed: no chart written (pip install 'graphstep[bench]')"
        )
        return paths
    matplotlib.use("Agg")  # files only, no display needed
    paths.append(out / f"{stem}.png")
    _plot(rows, meta, paths[2])
    return paths


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | method | step ms | × graphstep | kernel ms | peak reserved GiB | capture s | error |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['method']} | {_fmt(r['step_ms'])} | {_fmt(r['ratio_to_graphstep'])} | "
            f"{_fmt(r['kernel_ms'])} | {_fmt(r['peak_reserved_gib'])} | {_fmt(r['capture_s'], 1)} | "
            f"{(r.get('error') or '').replace('|', '/')} |"
        )
    return "\n".join(lines)


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    parts = [
        f"# graphstep bench: {meta['gpu_name']}, {meta['date']}{' (quick run)' if meta.get('quick') else ''}",
        f"torch {meta['torch']}, CUDA {meta['cuda']}, graphstep {meta.get('graphstep')}, Python {meta.get('python')}.",
        f"Every method runs the same step: {meta['step']}.",
        markdown_table(rows),
        "## Configs",
        *(
            f"- **{name}**: {d['parameters'] / 1e6:.1f}M parameters ({', '.join(f'{k}={v}' for k, v in d['model'].items())}), "
            f"batch {d['batch_size']} ({d['tokens_per_step']} tokens/step); {d['warmup_calls']} warm-up calls, "
            f"{d['timed_steps']} timed steps, {d['profiled_steps']} profiled steps per method."
            for name, d in meta["configs"].items()
        ),
        "## How each number is measured",
        *(f"- `{k}`: {v}" for k, v in meta["measurement"].items()),
    ]
    return "\n\n".join(parts) + "\n"


def _plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(6.5 * len(configs), 4.5), squeeze=False)
    for ax, config in zip(axes[0], configs, strict=True):
        sub = [r for r in rows if r["config"] == config]
        xs = range(len(sub))
        step = [r["step_ms"] or 0.0 for r in sub]
        ax.bar(xs, step, color="#4c72b0", label="step ms (synchronised wall clock)")
        ax.bar(
            xs,
            [r["kernel_ms"] or 0.0 for r in sub],
            width=0.4,
            color="#dd8452",
            label="GPU kernel ms (profiler)",
        )
        for x, r in zip(xs, sub, strict=True):
            label = "failed" if r["error"] else f"{r['step_ms']:.2f}"
            ax.text(x, step[x], label, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [r["method"] for r in sub], rotation=30, ha="right")
        ax.set_ylabel("ms per step")
        ax.set_title(config)
        ax.legend(fontsize=8)
    fig.suptitle(f"graphstep bench: {meta['gpu_name']}, torch {meta['torch']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
