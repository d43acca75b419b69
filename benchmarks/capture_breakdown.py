"""Where does graphstep's time to steady state go, beyond a hand-written graph's?

The bench's `capture_s` column is the wall clock of the first 6 calls (`bench/measure.py`, `Counts`):
the hand-written graph (`ManualGraphStep`) runs 3 eager warm-ups, one capture and 2 replays; graphstep
runs its warm-ups, its capture (with every watch on the step's Python: writes, reads, host draws)
and replays. This runs both on the gpt suite's workloads (the demo GPT, tiny and GPT-2 small, as the
bench builds them) and a transformers GPT-2 small, and splits graphstep's extra time into parts:

- timed directly (wrapped, inclusive): the first call's setup (`StepContext.open`; on CUDA the backend
  made and cuBLAS primed in it), the census of objects (`values.Census`), the garbage collection before
  a capture, the write watch's bytecode reading, the snapshot taken before a capture, the guard built
  after it (`StateGuard`), the read watch's own work on entry and exit, the step's eager runs in
  warm-ups, the backend's capture and the CUDA graph's begin and end;
- the workload's first run in the process, apart (a fresh process's first capture pays more);
- by leaving one watch out (a fresh step each): the write watch (census + opcode tracing), the read
  watch (its profile function in the probing warm-ups and at capture), the host random watch.

Each graphstep run is made with every tracer path this Python offers (`GRAPHSTEP_TRACER`:
"settrace"; on Python >= 3.12 also "monitoring", PEP 669's `sys.monitoring` with events only on the
code objects that can write; see src/graphstep/guards/tracing.py). Writes
<out>/<gpu>_<date>_capture_breakdown.{json,md}.

Run (GPU): `python benchmarks/capture_breakdown.py --out benchmarks/results`
Run (CPU, recording backend, small shapes): `python benchmarks/capture_breakdown.py --device cpu --small`
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import graphstep
from graphstep import capturing, effects, lifecycle, step_context
from graphstep import signature as sig
from graphstep.backends import cuda as cuda_backend
from graphstep.backends import output_ring
from graphstep.backends.base import HostBackend
from graphstep.backends.cuda import CudaGraphBackend
from graphstep.backends.recording import RecordingBackend
from graphstep.bench.measure import ManualGraphStep
from graphstep.bench.report import gpu_slug
from graphstep.bench.workloads import GPT_CONFIGS, BuildContext, Workload
from graphstep.demo.gpt import GPT, GPT2_SMALL, make_batches
from graphstep.demo.train import make_optimizer, make_train_step
from graphstep.effects import host_random, targets, values
from graphstep.effects.writes import WriteWatch
from graphstep.guards import reads, state_guard

try:
    from graphstep.guards import tracing
except ImportError:  # a graphstep from before guards/tracing.py: its legacy hooks only
    tracing = None

CALLS = 6
"""As the bench's `Counts.warmup_calls`."""

CLOCK = [time.perf_counter]
"""Wall clock on the GPU, as the bench; on the CPU this thread's CPU time (`--clock thread`): the CPU
machine is shared, and its wall clock swings by half from run to run."""


# -- workloads ---------------------------------------------------------------------------------------


def _small_gpt2(ctx: BuildContext) -> Workload:
    """GPT-2 small's depth (12 blocks, 12 heads) at CPU size (192 wide, 2×64 tokens, 8192-token
    vocabulary): the Python the watches see is the same as at full size, the arithmetic far less."""
    cfg = dataclasses.replace(GPT2_SMALL, vocab_size=8192, seq_len=64, n_embd=192)
    torch.manual_seed(0)
    with ctx.device:
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return Workload(
        model=model,
        optimizer=opt,
        make_step=lambda forward: make_train_step(forward, opt, amp=False),
        batches=make_batches(cfg, batch_size=2, n_batches=2, device=ctx.device),
    )


def _hf_gpt2(small: bool) -> Callable[[BuildContext], Workload]:
    def build(ctx: BuildContext) -> Workload:
        import transformers

        cfg = transformers.GPT2Config()  # GPT-2 small: 12 layers, 768 wide
        batch, seq = (2, 64) if small else (8, 1024)
        if small:  # its depth, at CPU size (as _small_gpt2)
            cfg.vocab_size, cfg.n_embd, cfg.n_positions = 8192, 192, 64
        torch.manual_seed(0)
        with ctx.device:
            model = transformers.GPT2LMHeadModel(cfg)
        model.config.use_cache = False
        opt = (
            make_optimizer(model, ctx.device)
            if ctx.device.type == "cuda"
            else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        )
        ids = [torch.randint(cfg.vocab_size, (batch, seq), device=ctx.device) for _ in range(2)]

        def make_step(forward: Callable) -> Callable:
            amp = ctx.device.type == "cuda"

            def train_step(ids: torch.Tensor) -> torch.Tensor:
                with ctx.autocast() if amp else contextlib.nullcontext():
                    loss = forward(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            return train_step

        return Workload(model=model, optimizer=opt, make_step=make_step, batches=[(i,) for i in ids])

    return build


def workloads(small: bool) -> dict[str, Callable[[BuildContext], Workload]]:
    found = {"gpt tiny": GPT_CONFIGS["tiny"].build}
    found["gpt2_small"] = _small_gpt2 if small else GPT_CONFIGS["gpt2_small"].build
    try:
        import transformers  # noqa: F401

        found["transformers GPT-2 small"] = _hf_gpt2(small)
    except ImportError:
        pass
    return found


# -- timing parts ------------------------------------------------------------------------------------


class Parts:
    """Seconds spent inside wrapped functions, by part (inclusive; a part called inside another
    counts in both)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attribute: str, part: str) -> None:
        raw = vars(owner)[attribute]
        wrapper = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        original = raw.__func__ if wrapper is not None else raw

        timed = functools.wraps(original)(_timer(original, self.seconds, part))
        setattr(owner, attribute, wrapper(timed) if wrapper is not None else timed)
        self._undo.append(lambda: setattr(owner, attribute, raw))

    def wrap_context(self, owner: Any, part: str) -> None:
        """Time the `__enter__` and `__exit__` of a context manager class, together."""
        self.wrap(owner, "__enter__", part)
        self.wrap(owner, "__exit__", part)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


_TIMER = """
def timer(original, seconds, part, clock):
    def timed(*a, **k):
        start = clock()
        try:
            return original(*a, **k)
        finally:
            seconds[part] = seconds.get(part, 0.0) + clock() - start
    return timed
"""
_namespace: dict[str, Any] = {}
# Made with exec: code in "<string>" is nobody's, so graphstep's watches of the step's Python (reads,
# writes) leave the timers alone, as they leave a library's code (a timer written here would be
# user code whose dict of seconds changes on every call: a value that churns).
exec(compile(_TIMER, "<string>", "exec"), _namespace)


def _timer(original: Callable, seconds: dict[str, float], part: str) -> Callable:
    return _namespace["timer"](original, seconds, part, lambda: CLOCK[0]())


@contextlib.contextmanager
def timed_parts(device: torch.device) -> Iterator[Parts]:
    parts = Parts()
    parts.wrap(step_context.StepContext, "open", "setup (StepContext.open)")
    parts.wrap(values.Census, "__init__", "census")
    parts.wrap(capturing.Snapshot, "take", "snapshot before capture")
    parts.wrap(state_guard.StateGuard, "__init__", "guard built")
    parts.wrap_context(reads.ReadWatch, "read watch enter/exit")
    parts.wrap_context(host_random.HostRandomWatch, "host random watch enter/exit")
    parts.wrap(lifecycle.Lifecycle, "warm_up", "warm-up calls (all)")
    parts.wrap(lifecycle, "capture_variant", "capture call (all)")
    backend = CudaGraphBackend if device.type == "cuda" else HostBackend
    parts.wrap(backend, "warmup", "warm-ups' eager step (backend.warmup)")
    # Inside the capture call: what is not the step's own Python under the watches.
    optional = [
        (lifecycle.Lifecycle, "capture", "capture call, lifecycle (Lifecycle.capture)"),
        (CudaGraphBackend if device.type == "cuda" else RecordingBackend, "capture", "backend.capture"),
        (gc, "collect", "gc.collect"),
        (values.Census, "drop", "census dropped"),
        (WriteWatch, "__exit__", "write watch exit"),
        (output_ring, "prepare", "output ring prepared"),
        (output_ring, "record", "output ring recorded"),
        (sig, "replayable_outputs", "outputs described"),
        (targets, "stores", "write watch: bytecode read (targets.stores)"),
    ]
    if device.type == "cuda":
        optional += [
            (torch.cuda.CUDAGraph, "capture_begin", "CUDAGraph.capture_begin"),
            (torch.cuda.CUDAGraph, "capture_end", "CUDAGraph.capture_end"),
            (CudaGraphBackend, "__init__", "setup: backend made (CudaGraphBackend)"),
            (cuda_backend, "_prime_library_workspaces", "setup: cuBLAS workspaces primed"),
        ]
    for owner, attribute, part in optional:
        if attribute in vars(owner):  # (an older graphstep may lack it)
            parts.wrap(owner, attribute, part)
    try:
        yield parts
    finally:
        parts.undo()


@contextlib.contextmanager
def without(watch: str) -> Iterator[None]:
    """One watch left out of the capture (for its cost only: captures without it are not safe)."""
    if watch == "writes":
        original = effects.watch_writes
        capturing.effects.watch_writes = lambda name, *, allow_writes, graphs: original(
            name, allow_writes=allow_writes, graphs=False
        )
        try:
            yield
        finally:
            capturing.effects.watch_writes = original
    elif watch == "reads":
        original_enter, original_exit = reads.ReadWatch.__enter__, reads.ReadWatch.__exit__

        def enter(self: reads.ReadWatch) -> reads.ReadWatch:
            return self

        reads.ReadWatch.__enter__, reads.ReadWatch.__exit__ = enter, lambda self, *exc: None
        try:
            yield
        finally:
            reads.ReadWatch.__enter__, reads.ReadWatch.__exit__ = original_enter, original_exit
    elif watch == "host random":
        original = host_random.refusing
        host_random.refusing = _not_refusing()
        try:
            yield
        finally:
            host_random.refusing = original
    else:
        yield


def _not_refusing() -> Callable:
    @contextlib.contextmanager
    def plain(name, backend, fn, splitter, args, kwargs, captured):
        captured["host_draws"] = []
        yield splitter

    return plain


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_manual(build: Callable, device: torch.device) -> dict[str, float]:
    """The hand-written graph's 6 calls (CUDA); on CPU, its 4 calls that run the step (no replays)."""
    workload = build(BuildContext(device=device, n_calls=CALLS))
    step = workload.make_step(workload.model)
    cuda = device.type == "cuda"
    manual = ManualGraphStep(step) if cuda else step
    _sync(device)
    start = CLOCK[0]()
    for i in range(CALLS if cuda else 4):
        manual(*workload.batches[i % len(workload.batches)])
    _sync(device)
    seconds = CLOCK[0]() - start
    if cuda:
        manual.close()
    return {"total": seconds}


def run_graphstep(build: Callable, device: torch.device, *, left_out: str = "") -> dict[str, float]:
    workload = build(BuildContext(device=device, n_calls=CALLS))
    config = graphstep.Config(backend="auto" if device.type == "cuda" else "recording")
    step = workload.make_step(workload.model)
    with timed_parts(device) as parts, without(left_out):
        captured = graphstep.capture(step, model=workload.model, optimizer=workload.optimizer, config=config)
        _sync(device)
        start = CLOCK[0]()
        for i in range(CALLS):
            captured(*workload.batches[i % len(workload.batches)])
            if i == 3:
                _sync(device)
                through_capture = CLOCK[0]() - start
        _sync(device)
        seconds = CLOCK[0]() - start
    stats = captured.stats
    captured.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    calls = {
        "warm-up calls": stats.warmup_calls,
        "captures": stats.captures,
        "eager calls": stats.eager_calls,
    }
    if calls != {"warm-up calls": config.warmup_steps, "captures": 1, "eager calls": 0}:
        print(f"note: {calls} (not 3 warm-ups and one capture): the parts are of those", file=sys.stderr)
    return {"total": seconds, "through capture": through_capture, **parts.seconds, **calls}


_COUNTER = """
def counter(original, counts, name):
    def counted(*a, **k):
        counts[name] = counts.get(name, 0) + 1
        return original(*a, **k)
    return counted
"""
exec(compile(_COUNTER, "<string>", "exec"), _namespace)


def count_hooks(build: Callable, device: torch.device) -> dict[str, int]:
    """How often the watches' Python hooks run in one graphstep run (warm-ups and capture): what the
    tracer path changes. Counted in a run of its own (not timed)."""
    counts: dict[str, int] = {}
    patched = [  # (owner, its hook's name in this version, or in the version before guards/tracing.py)
        (WriteWatch, ("frame_kind", "_trace"), "write watch: frames judged"),
        (WriteWatch, ("opcode",), "write watch: instructions seen"),
        (reads.ReadWatch, ("_started", "_profile"), "read watch: hook calls"),
        (host_random.HostRandomWatch, ("_profile",), "host random watch: profile function calls"),
    ]
    originals = []
    for owner, names, label in patched:
        name = next((n for n in names if n in vars(owner)), None)
        if name is None:  # (a version without it)
            continue
        originals.append((owner, name, vars(owner)[name]))
        setattr(owner, name, _namespace["counter"](vars(owner)[name], counts, label))
    try:
        run_graphstep(build, device)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return counts


def median_run(run: Callable[[], dict[str, float]], repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        runs.append(run())
        gc.collect()  # the last run's model and graphs go before the next is timed
    return {key: statistics.median(r.get(key, 0.0) for r in runs) for key in runs[0]}


def tracers() -> tuple[str, ...]:
    return tracing.available() if tracing is not None else ("settrace",)


def measure(name: str, build: Callable, device: torch.device, repeats: int) -> dict[str, Any]:
    gc.collect()
    first = run_graphstep(build, device)  # pays the imports, kernels, caches: reported apart
    manual = median_run(lambda: run_manual(build, device), repeats)
    row: dict[str, Any] = {"workload": name, "manual": manual, "first": first, "tracers": {}}
    for tracer in tracers():
        os.environ["GRAPHSTEP_TRACER"] = tracer
        full = median_run(lambda: run_graphstep(build, device), repeats)
        costs = {}
        for watch in ("writes", "reads", "host random"):
            rest = median_run(lambda w=watch: run_graphstep(build, device, left_out=w), repeats)
            costs[f"{watch} watch (left out: total saved)"] = full["total"] - rest["total"]
        row["tracers"][tracer] = {
            "graphstep": full,
            "watch costs": costs,
            "hooks": count_hooks(build, device),
        }
    os.environ.pop("GRAPHSTEP_TRACER", None)
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Time to steady state, broken down: {result['gpu']}, Python {result['python']}, "
        f"torch {result['torch']}, {result['date']} (commit {result['commit']})",
        "",
        f"Seconds ({result['clock']} clock), medians of {result['repeats']}; {CALLS} calls as the bench's `capture_s` (on CPU the "
        "hand-written row is its 4 eager runs of the step: no graph to replay). Parts are inclusive. "
        "`first run`: graphstep's first run of the workload, default tracer, before anything else of it ran "
        "(the first workload's pays the process's first capture).",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines += ["", f"## {row['workload']}", "", f"failed: {row['error']}"]
            continue
        lines += ["", f"## {row['workload']}", "", f"hand-written graph: {row['manual']['total']:.3f} s", ""]
        names = list(
            dict.fromkeys(k for t in row["tracers"].values() for k in (*t["graphstep"], *t["watch costs"]))
        )
        # This workload's first run, default tracer (the first workload's is the process's first capture).
        first = row.get("first", {})
        columns = [*row["tracers"], "first run"] if first else list(row["tracers"])
        lines += ["| part | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
        for key in names:
            cells = []
            for t in [*row["tracers"].values(), {"graphstep": first, "watch costs": {}}][: len(columns)]:
                value = t["graphstep"].get(key, t["watch costs"].get(key))
                cells.append("" if value is None else f"{value:.3f}")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        hooks = list(dict.fromkeys(k for t in row["tracers"].values() for k in t.get("hooks", {})))
        for key in hooks:
            cells = [str(t.get("hooks", {}).get(key, "")) for t in row["tracers"].values()]
            lines.append(f"| {key} (calls) | " + " | ".join(cells) + " |")
        for tracer, t in row["tracers"].items():
            ratio = t["graphstep"]["total"] / row["manual"]["total"]
            lines.append(f"\n{tracer}: graphstep / hand-written = {ratio:.2f}×")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="GPT-2 small's depth at a CPU-sized batch")
    parser.add_argument("--only", default="", help="workload names (comma-separated substrings)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--clock", choices=("wall", "thread"), help="default: wall on CUDA, thread on CPU")
    args = parser.parse_args()
    clock = args.clock or ("wall" if args.device.startswith("cuda") else "thread")
    CLOCK[0] = time.perf_counter if clock == "wall" else time.thread_time
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the thread clock counts this thread only
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "?"
    cuda = device.type == "cuda"
    result = {
        "question": "Where does graphstep's time to steady state go, beyond a hand-written graph's?",
        "gpu": torch.cuda.get_device_name(device) if cuda else "none (recording backend on CPU)",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "repeats": args.repeats,
        "clock": clock,
        "rows": [],
    }
    slug = (gpu_slug(torch.cuda.get_device_name(device)) if cuda else "cpu") + "_" + result["date"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, build in workloads(args.small or not cuda).items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        started = time.perf_counter()
        try:
            result["rows"].append(measure(name, build, device, args.repeats))
        except Exception as e:  # one workload's failure is reported, the others still run
            traceback.print_exc()
            result["rows"].append({"workload": name, "error": f"{type(e).__name__}: {e}"})
        print(f"{name}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        # Written after every workload: a run cut short keeps what it measured.
        (out / f"{slug}_capture_breakdown.json").write_text(json.dumps(result, indent=2) + "\n")
        text = markdown(result)
        (out / f"{slug}_capture_breakdown.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
