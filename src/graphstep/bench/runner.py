"""`graphstep bench`: every way to run a training step, side by side on one GPU, in one run.

Two suites: `gpt` (the default; the built-in GPT at two sizes, with a hand-written whole-step graph
as the expert's anchor) and `models` (ResNet-50, ViT-S/16, BERT-base, a 127M Llama, a PPO update, a
GCN; see `models.py`). Methods: see `measure.py`.

Each (config, method) row runs in a fresh process (`worker.py`): its memory peak is its own,
and a crash or a hang costs that row only. A row that fails records its error's first line; one
whose package is missing says so; one that runs past `--row-timeout` is killed and keeps the phases
it finished. Every isolated row compiles from a cold cache: its process gets fresh, empty inductor and
triton cache directories, as on a new machine (`warm_cache=True`, `--warm-cache`: the environment's,
shared by the rows). The gpt suite runs config by config. The models suite runs by priority, so that a
`--budget` (seconds for the whole run) cuts the least important rows: first eager and graphstep on
every config, then graphstep with a compiled model and reduce-overhead, then torch.compile. The
JSON and Markdown files are rewritten after every row, the chart at the end
(`python -m graphstep.bench.report FILE.json` draws it again from a JSON file).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import graphstep

from .measure import MEASUREMENT, Counts, ManualGraphStep, cupti_graph_workaround, measure_row, new_row
from .report import METHOD_ORDER, add_ratios, gpu_slug, markdown_table, sorted_rows, write_results
from .suites import SUITE_METHODS, suites
from .workloads import GPT_CONFIGS

__all__ = [
    "CONFIGS",
    "MEASUREMENT",
    "METHODS",
    "ManualGraphStep",
    "add_ratios",
    "gpu_slug",
    "run_bench",
    "write_results",
]

CONFIGS = GPT_CONFIGS
"""The default suite's configs (kept for scripts that import them)."""
METHODS = METHOD_ORDER
PRIORITY = (("eager", "graphstep", "manual_graph"), ("graphstep_compiled", "reduce_overhead"), ("compile",))
"""The models suite runs pass by pass, every config in each pass: what a --budget cuts comes last.
The first compiling row of a model pays for inductor's cold cache (the later ones reuse part of it)."""
ROW_TIMEOUT_S = 420.0
"""A row is killed past this: cold inductor compilation of ResNet-50's training graph takes about a minute."""
MIN_ROW_S = 30.0
"""With a --budget, a row is not started with less than this left."""


def default_counts(quick: bool, timed_steps: int) -> Counts:
    return Counts(
        warmup_calls=6, timed_steps=timed_steps, pipelined_calls=100, profiled_steps=3 if quick else 5
    )


def run_bench(
    *,
    suite: str = "gpt",
    configs: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
    out_dir: str | Path = "benchmarks/results",
    quick: bool = False,
    steps: int | None = None,
    budget_s: float | None = None,
    row_timeout_s: float = ROW_TIMEOUT_S,
    isolate: bool = True,
    command: str | None = None,
    device: str = "cuda",
    tiny: bool = False,
    counts: Counts | None = None,
    graphstep_config: dict[str, Any] | None = None,
    warm_cache: bool = False,
) -> int:
    """Benchmark `methods` on `configs` of `suite`, write the result files, print the table.

    Returns 0 when every row ran or was skipped (a package missing, the budget spent), 1 when some
    failed (their rows carry the error), 2 without CUDA or for names the suite does not have.
    `device`, `tiny`, `counts` and `graphstep_config` are for CPU tests of this machinery.
    `warm_cache`: rows use the environment's compile caches instead of a fresh one each.
    """
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "graphstep bench needs a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "It compares CUDA graph methods, which do not exist on CPU. "
            "`graphstep demo` runs on CPU and checks graphstep's results against eager.",
            file=sys.stderr,
        )
        return 2
    all_suites = suites()
    if suite not in all_suites:
        print(
            f"graphstep bench: unknown suite {suite!r}; choose from {', '.join(all_suites)}", file=sys.stderr
        )
        return 2
    table = all_suites[suite]
    configs = list(configs or table)
    methods = [m for m in METHOD_ORDER if m in (methods or SUITE_METHODS[suite])]
    bad = [c for c in configs if c not in table] + [m for m in methods if m not in SUITE_METHODS[suite]]
    if bad or not methods:
        print(
            f"graphstep bench: suite {suite!r} has no {', '.join(map(repr, bad)) or 'methods selected'}; "
            f"its configs: {','.join(table)}; its methods: {','.join(SUITE_METHODS[suite])}",
            file=sys.stderr,
        )
        return 2

    if not isolate:
        cupti_graph_workaround()
    row_counts = {
        c: counts
        or default_counts(quick, steps or (table[c].quick_timed_steps if quick else table[c].timed_steps))
        for c in configs
    }
    if suite == "gpt":  # few rows, no hurry: config by config, as earlier runs of this suite
        order = [(c, m) for c in configs for m in methods]
    else:
        order = [(c, m) for group in PRIORITY for c in configs for m in group if m in methods]
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    meta = dict(
        gpu=gpu_slug(gpu_name) if device == "cuda" else "cpu", gpu_name=gpu_name, torch=torch.__version__,
        cuda=torch.version.cuda, date=datetime.date.today().isoformat(), python=platform.python_version(),
        graphstep=getattr(graphstep, "__version__", None), suite=suite, quick=quick, methods=methods,
        order=[f"{c}/{m}" for c, m in order], isolate=isolate, budget_s=budget_s, row_timeout_s=row_timeout_s,
        command=command, counts={**vars(next(iter(row_counts.values()))), "timed_steps": "per config"},
        configs={c: dict(label=table[c].label, timed_steps=row_counts[c].timed_steps, parameters=None, details=None)
                 for c in configs},
        measurement=MEASUREMENT, compile_cache=compile_cache(isolate, warm_cache),
    )  # fmt: skip

    rows: list[dict[str, Any]] = []
    unusable: dict[str, str] = {}  # config -> why its package cannot be used
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="graphstep-bench-", ignore_cleanup_errors=True) as tmp:
        for i, (config, method) in enumerate(order, 1):
            left = None if budget_s is None else budget_s - (time.monotonic() - start)
            missing = [p for p in table[config].packages if importlib.util.find_spec(p) is None]
            if missing:
                unusable.setdefault(
                    config, f"{', '.join(missing)} not installed; pip install 'graphstep[bench]'"
                )
            row = new_row(suite, config, method)
            if config in unusable:
                row.update(skipped=unusable[config], phase="done")
            elif left is not None and left < MIN_ROW_S:
                row.update(skipped=f"not run: the --budget of {budget_s:.0f} s was spent", phase="done")
            else:
                job = dict(
                    suite=suite, config=config, method=method, counts=vars(row_counts[config]), device=device,
                    tiny=tiny, graphstep_config=graphstep_config, row_path=str(Path(tmp) / f"row{i}.json"),
                    compile_cache=meta["compile_cache"],
                )  # fmt: skip
                timeout = row_timeout_s if left is None else min(row_timeout_s, left)
                try:
                    row = _run_isolated(job, timeout, Path(tmp), i) if isolate else _run_inline(job)
                except Exception as e:  # the harness itself: still no reason to lose the other rows
                    row["error"] = f"bench harness: {type(e).__name__}: {e}"[:300]
                if row.get("skipped"):  # the worker could not build the model: its package
                    unusable.setdefault(config, row["skipped"])
                if timeout < row_timeout_s and (row.get("error") or "").startswith("timed out"):
                    row.update(skipped=f"cut short by the --budget: {row['error']}", error=None)
            row["compile_cache"] = meta["compile_cache"]
            rows.append(row)
            _remember_config(meta, row)
            add_ratios(rows)
            _print_row(i, len(order), row)
            _write(rows, meta, out_dir, chart=False)
    paths = _write(rows, meta, out_dir, chart=True)
    print(markdown_table(sorted_rows(rows, meta)))
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {time.monotonic() - start:.0f} s")
    return 1 if any(r["error"] for r in rows) else 0


def _write(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path, *, chart: bool
) -> list[Path]:
    try:
        return write_results(rows, meta, out_dir, chart=chart)
    except Exception as e:  # a full disk must not end the run: the next row tries again
        print(
            f"graphstep bench: writing the results to {out_dir} failed: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return []


def _remember_config(meta: dict[str, Any], row: dict[str, Any]) -> None:
    entry = meta["configs"].get(row["config"])
    if entry is not None and row.get("parameters") and entry.get("parameters") is None:
        entry.update(parameters=row["parameters"], details=row.get("details"))


def _run_inline(job: dict[str, Any]) -> dict[str, Any]:
    """The row in this process (--in-process): quicker, but memory peaks include earlier rows' leftovers."""
    t0 = time.monotonic()
    try:
        row = measure_row(
            suite=job["suite"], config=job["config"], method=job["method"], counts=Counts(**job["counts"]),
            device=job["device"], tiny=job["tiny"], graphstep_config=job["graphstep_config"],
        )  # fmt: skip
    finally:
        _release(job["device"])
    row["worker_s"] = time.monotonic() - t0
    return row


def _release(device: str) -> None:
    """Free everything the previous method left: compiled code, cudagraph trees, cached blocks."""
    gc.collect()  # the previous method's model and step sit in reference cycles (closures, hooks)
    torch._dynamo.reset()  # also resets cudagraph trees and their memory pool
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _run_isolated(job: dict[str, Any], timeout: float, tmp: Path, i: int) -> dict[str, Any]:
    """The row in a fresh `python -m graphstep.bench.worker` process, killed past `timeout` seconds."""
    job_path, log_path = tmp / f"job{i}.json", tmp / f"row{i}.log"
    job_path.write_text(json.dumps(job))
    src = str(Path(graphstep.__file__).resolve().parents[1])  # the graphstep this process runs
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    cache = tmp / f"compile_cache{i}"
    if job.get("compile_cache") == "cold":  # a fresh machine's: inductor and triton compile everything
        env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"] = (
            str(cache / "inductor"),
            str(cache / "triton"),
        )
    cmd = worker_command(job_path)
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log_file:
        # Its own process group: on a timeout the worker and its compile workers go together.
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
            shutil.rmtree(cache, ignore_errors=True)
    elapsed = time.monotonic() - t0
    tail = _tail(log_path)
    row_path = Path(job["row_path"])
    try:
        row = json.loads(row_path.read_text())
    except (OSError, ValueError):  # it died before writing its first phase
        row = new_row(job["suite"], job["config"], job["method"])
    if row.get("phase") != "done" and not row.get("error"):
        if timed_out:
            row["error"] = f"timed out after {elapsed:.0f} s during {row.get('phase')} (killed)"
        else:
            last = next((line for line in reversed(tail) if line.strip()), "")
            row["error"] = f"worker exited with code {proc.returncode} during {row.get('phase')}: {last}"[
                :300
            ]
    row["worker_s"] = elapsed
    row["log_tail"] = tail
    return row


def compile_cache(isolate: bool, warm_cache: bool) -> str:
    """Which compile cache the rows use: "cold" (a fresh, empty one per row's process), "warm" (the
    environment's, shared with earlier rows and runs) or "in-process" (one process's, shared by its rows)."""
    return "warm" if warm_cache else "cold" if isolate else "in-process"


def worker_command(job_path: Path) -> list[str]:
    """The command line of one row's process (a function, so tests can start something else)."""
    return [sys.executable, "-m", "graphstep.bench.worker", str(job_path)]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the worker's process group (the worker, if still running, and what it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, n: int = 25) -> list[str]:
    try:
        text = path.read_bytes()[-20_000:].decode("utf-8", errors="replace")
    except OSError:
        return []
    # Progress bars redraw with carriage returns: keep each line's last state.
    return [line.rsplit("\r", 1)[-1][:300] for line in text.splitlines()][-n:]


def _print_row(i: int, n: int, row: dict[str, Any]) -> None:
    head = f"[{i}/{n}] {row['config']}/{row['method']}"
    took = f" ({row['worker_s']:.0f} s)" if row.get("worker_s") is not None else ""
    if row.get("skipped"):
        print(f"{head}: skipped: {row['skipped']}", flush=True)
        return
    numbers = ", ".join(
        f"{label} {row[key]:.2f}"
        for key, label in (("step_ms", "step ms"), ("pipelined_ms", "pipelined ms"), ("kernel_ms", "kernel ms"),
                           ("peak_reserved_gib", "peak reserved GiB"), ("capture_s", "to steady state s"))
        if row.get(key) is not None
    )  # fmt: skip
    g = row.get("graphstep")
    if g:
        numbers += f", graphstep captures {g.get('captures')} variants {g.get('variants')} replays {g.get('replays')}"
    print(f"{head}: {numbers}{took}", flush=True)
    if row.get("error"):
        print(f"{head} FAILED: {row['error']}", flush=True)
        for line in (row.get("log_tail") or [])[-12:]:
            print(f"    | {line}", file=sys.stderr, flush=True)
