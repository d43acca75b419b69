"""One row of `graphstep bench`: one method on one config, measured in the process that calls it.

Methods (same model, optimizer, scheduler, data and step function for each):
  eager               the step as written
  compile             torch.compile(model); backward, clip and optimizer eager
  reduce_overhead     torch.compile(model, mode="reduce-overhead"): cudagraph trees around the
                      model's forward and backward; clip and optimizer eager
  compiled_step       torch.compile(the whole step) with compiled autograd: forward, backward,
                      clip and the optimizer step in one compiled function (default mode)
  compiled_step_ro    the same in mode="reduce-overhead" (cudagraph trees around what it compiled)
  manual_graph        the whole step hand-captured with torch.cuda.graph (gpt suite only)
  graphstep           graphstep.capture around the eager step
  graphstep_compiled  graphstep.capture around the step with a torch.compile(model) inside

`measure_row` builds the workload, runs the method through its phases (warm-up, timed steps,
pipelined calls, profiled steps) and writes the row to a JSON file after every phase, so a row cut
short by a timeout still has what it measured. What each number means: `MEASUREMENT`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import graphstep

from .suites import suites
from .workloads import BuildContext, PackageMissing, StepFn, Workload, n_parameters

log = logging.getLogger("graphstep")

GIB = 2**30
MEASUREMENT = {
    "step_ms": "median over the timed steps of one call's wall clock, with torch.cuda.synchronize() before and "
    "after the call: one step's latency (host dispatch plus GPU work, nothing of the previous step queued). "
    "The scheduler steps after the clock stops.",
    "pipelined_ms": "wall clock of N back-to-back calls (each followed by the scheduler's step, as a real loop "
    "does) with one torch.cuda.synchronize() at the end, divided by N: throughput, host work overlapping "
    "the GPU's.",
    "kernel_ms": "GPU time of one step of this row's method: torch.profiler over a few steady-state steps, the "
    "sum of the self device time of every GPU event (kernels, memcpy, memset; the profiler table's 'Self CUDA "
    "time total') divided by the steps. For graph methods, the replayed graph's kernels. The floor "
    "pipelined_ms could reach.",
    "pipelined_over_kernel": "pipelined_ms / kernel_ms: 1.00 means the GPU never waits for the host, nor "
    "between kernels (kernel_ms leaves out the GPU's own gaps between the kernels of a graph).",
    "graph_floor_ms": "graphstep rows: the captured graph alone, launched pipelined_calls times back to back "
    "with one synchronisation at the end, per launch: pipelined_ms without graphstep's host work and input "
    "copies. pipelined_ms / graph_floor_ms near 1 means graphstep's host side costs the GPU nothing.",
    "host_us": "median over the pipelined calls of the host time of one call (until it returns, GPU work "
    "not awaited), in microseconds. In a GPU-bound loop the launch queue fills after some tens of calls and "
    "every later call waits about one step's GPU time: when more than half the calls wait, this is the GPU's "
    "time, not the host's (see host_burst_us).",
    "host_burst_us": "median host time of one call over `bursts` runs of `burst_calls` calls in a row, each "
    "run after a synchronisation: as in the pipelined loop, but too few calls for the GPU's launch queue to "
    "fill, so no call waits for earlier steps. The host's own time per call.",
    "graphstep_host_us": "graphstep rows: its own StepStats.replay_s / replays over the pipelined calls, "
    "in microseconds: graphstep's host time per replayed call.",
    "peak_reserved_gib": "torch.cuda.max_memory_reserved() after the pipelined calls (before profiling), in a "
    "fresh process per row unless the run says otherwise: the method's own peak, no leftovers of another.",
    "peak_allocated_gib": "torch.cuda.max_memory_allocated() at the same point.",
    "capture_s": "wall clock of the warm-up calls, synchronised: warm-up, compilation, capture, until steady "
    "state. Every method gets the same number of calls. Compilation is faster when inductor's on-disk cache "
    "was warmed by an earlier row or run (the run's method order is in `order`).",
    "ratio_to_graphstep": "step_ms divided by graphstep's step_ms for the same config (> 1: slower).",
    "pipelined_ratio_to_graphstep": "pipelined_ms divided by graphstep's pipelined_ms for the same config.",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counts:
    warmup_calls: int = 6
    """Calls before timing: graphstep's 3 warm-up steps + its capture (+ a re-capture when an
    optimizer moves to an eager segment), cudagraph trees' warm-up + record, compilation. The same
    for every method."""
    timed_steps: int = 30
    pipelined_calls: int = 100
    profiled_steps: int = 3
    bursts: int = 3
    burst_calls: int = 16
    """Calls in a row for host_burst_us: on an H100 the tiny GPT's queue holds about 57 calls."""

    @property
    def total(self) -> int:
        return (
            self.warmup_calls
            + self.timed_steps
            + self.pipelined_calls
            + self.bursts * self.burst_calls
            + self.profiled_steps
        )


def new_row(suite: str, config: str, method: str) -> dict[str, Any]:
    return dict(
        suite=suite, config=config, method=method, phase="start", error=None, skipped=None, parameters=None,
        step_ms=None, pipelined_ms=None, kernel_ms=None, pipelined_over_kernel=None, host_us=None,
        host_burst_us=None,
        ratio_to_graphstep=None, pipelined_ratio_to_graphstep=None, peak_reserved_gib=None,
        peak_allocated_gib=None, capture_s=None, final_loss=None, graphstep=None, details=None,
    )  # fmt: skip


def measure_row(
    *,
    suite: str,
    config: str,
    method: str,
    counts: Counts,
    device: str = "cuda",
    tiny: bool = False,
    graphstep_config: dict[str, Any] | None = None,
    row_path: str | Path | None = None,
) -> dict[str, Any]:
    """Run `method` on `config` and return its row; also written to `row_path` after every phase.

    Never raises for a failure of the method or the model: the row's `error` says what happened
    (its first line in the tables), `skipped` says why a model could not be built here.
    """

    row = new_row(suite, config, method)
    dev = torch.device(device)

    def phase(name: str) -> None:
        row["phase"] = name
        if row_path is not None:
            _write_json(row_path, row)

    close: Callable[[], None] | None = None
    captured = None
    phase("build")
    try:
        bc = suites()[suite][config]
        workload = bc.build(BuildContext(device=dev, n_calls=counts.total, tiny=tiny))
        row["parameters"] = n_parameters(workload.model)
        row["details"] = workload.details
        step, close, captured = make_method_step(method, workload, graphstep_config)
        _run_phases(row, phase, workload, step, captured, counts, dev)
    except PackageMissing as e:
        row["skipped"] = str(e)
    except Exception as e:  # one broken method must not lose the others' numbers
        first = (str(e).strip().splitlines() or [""])[0]
        row["error"] = f"{type(e).__name__} during {row['phase']}: {first}"[:300]
        row["traceback"] = traceback.format_exc()[-4000:]
        log.warning("graphstep bench: %s/%s failed: %s", config, method, row["error"])
        if captured is not None and row["graphstep"] is None:  # a re-capture storm shows here
            with contextlib.suppress(Exception):
                row["graphstep"] = graphstep_stats(captured.stats)
    finally:
        if close is not None:
            try:
                close()
            except Exception as e:
                log.warning("graphstep bench: %s/%s: releasing its graphs failed: %s", config, method, e)
    phase("done")
    return row


def _run_phases(
    row: dict[str, Any],
    phase: Callable[[str], None],
    workload: Workload,
    step: StepFn,
    captured: Any,
    counts: Counts,
    dev: torch.device,
) -> None:
    batch = itertools.cycle(workload.batches)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    phase("warmup")
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(counts.warmup_calls):
        step(*next(batch))
        workload.after_call()
    _sync(dev)
    row["capture_s"] = time.perf_counter() - t0

    phase("timed")
    step_s = []
    loss = None
    for _ in range(counts.timed_steps):
        args = next(batch)
        _sync(dev)
        t0 = time.perf_counter()
        loss = step(*args)
        _sync(dev)
        step_s.append(time.perf_counter() - t0)
        workload.after_call()
    row["step_ms"] = statistics.median(step_s) * 1e3 if step_s else None
    # Read now: reduce_overhead's next call overwrites its graph-owned output.
    final_loss = float(loss.detach().float()) if loss is not None else None

    phase("pipelined")
    before = captured.stats if captured is not None else None
    _sync(dev)
    t0 = time.perf_counter()
    host_s = calls_in_a_row(step, batch, counts.pipelined_calls, workload.after_call)
    _sync(dev)
    if counts.pipelined_calls:
        row["pipelined_ms"] = (time.perf_counter() - t0) / counts.pipelined_calls * 1e3
        row["host_us"] = statistics.median(host_s) * 1e6
    if captured is not None:
        row["graphstep"] = graphstep_stats(captured.stats, before)
        row["graphstep"]["segments_host_ms"] = segments_host_ms(captured)
        if cuda and counts.pipelined_calls:
            row["graph_floor_ms"] = graph_floor_ms(captured, counts.pipelined_calls)
    if cuda:
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB

    if counts.bursts and counts.burst_calls:
        phase("bursts")
        burst_s = []
        for _ in range(counts.bursts):
            _sync(dev)
            burst_s += calls_in_a_row(step, batch, counts.burst_calls, workload.after_call)
        _sync(dev)
        row["host_burst_us"] = statistics.median(burst_s) * 1e6

    if cuda and counts.profiled_steps:
        phase("profile")
        row["kernel_ms"] = kernel_ms(step, workload, [next(batch) for _ in range(counts.profiled_steps)])
        if row["kernel_ms"] and row["pipelined_ms"]:
            row["pipelined_over_kernel"] = row["pipelined_ms"] / row["kernel_ms"]

    if final_loss is not None and math.isfinite(final_loss):
        row["final_loss"] = final_loss
    elif final_loss is not None:  # JSON has no NaN: the value goes into the error
        row["error"] = f"non-finite loss {final_loss} after {counts.warmup_calls + counts.timed_steps} steps"


def calls_in_a_row(
    step: StepFn, batch: Iterator[tuple], calls: int, after_call: Callable[[], None] = lambda: None
) -> list[float]:
    """The host time of each of `calls` calls made one after another, in seconds: until the call
    returns, with no synchronisation between calls (the loader's work and `after_call`, a scheduler's
    step, left out)."""
    host_s = []
    for _ in range(calls):
        args = next(batch)
        h0 = time.perf_counter()
        step(*args)
        host_s.append(time.perf_counter() - h0)
        after_call()
    return host_s


def graph_floor_ms(captured: Any, calls: int) -> float | None:
    """The captured graph alone, launched `calls` times back to back with one synchronisation at
    the end, per call: what pipelined_ms would be if graphstep's host work (and the input copies)
    cost nothing. None when the step has eager segments or no single current graph."""
    lives = list(getattr(captured, "_lives", {}).values())
    if len(lives) != 1 or lives[0].current is None or lives[0].current.recording.segments:
        return None
    recording = lives[0].current.recording
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        recording.launch()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def segments_host_ms(captured: Any) -> float | None:
    """Host time of the eager segments (graph breaks, eager optimizer steps) in the last replay."""
    lives = [life for life in captured._lives.values() if life.current is not None]
    if len(lives) != 1:
        return None
    return sum(getattr(s, "host_s", 0.0) for s in lives[0].current.recording.segments) * 1e3


def graphstep_stats(stats: Any, before: Any = None) -> dict[str, Any]:
    """The counters a row keeps (a re-capture storm shows in `captures` and `variants`), and the
    host time per replay over the calls since `before` (None when none replayed)."""
    keys = ("warmup_calls", "captures", "variants", "variant_switches", "replays", "eager_calls")
    keys += ("churn_calls", "graph_breaks")
    out: dict[str, Any] = {k: getattr(stats, k, None) for k in keys}
    out["capture_s"] = getattr(stats, "capture_s", None)
    pool = getattr(stats, "pool_bytes", None)
    out["pool_gib"] = pool / GIB if isinstance(pool, (int, float)) else None
    replays = getattr(stats, "replays", 0) - (getattr(before, "replays", 0) if before is not None else 0)
    replay_s = getattr(stats, "replay_s", 0.0) - (
        getattr(before, "replay_s", 0.0) if before is not None else 0.0
    )
    out["host_us_per_replay"] = replay_s / replays * 1e6 if replays > 0 else None
    out["replays_pipelined"] = replays
    return out


# ---------------------------------------------------------------- the methods


def make_method_step(
    method: str, workload: Workload, graphstep_config: dict[str, Any] | None = None
) -> tuple[StepFn, Callable[[], None] | None, Any]:
    """The step callable for `method`, what releases its graphs (or None), and the CapturedStep (or None)."""
    model = workload.model
    if method == "eager":
        return workload.make_step(model), None, None
    if method == "compile":
        return workload.make_step(torch.compile(model)), None, None
    if method == "reduce_overhead":
        inner = workload.make_step(torch.compile(model, mode="reduce-overhead"))

        def step(*args: Any) -> Tensor:
            # Tells cudagraph trees a new iteration begins: the previous step's graph outputs may now
            # be overwritten. Without it, grads the optimizer read look still alive and it re-records.
            torch.compiler.cudagraph_mark_step_begin()
            return inner(*args)

        return step, None, None
    if method in ("compiled_step", "compiled_step_ro"):
        return compiled_step(workload, "reduce-overhead" if method == "compiled_step_ro" else "default")
    if method == "manual_graph":
        manual = ManualGraphStep(workload.make_step(model))
        return manual, manual.close, None
    if method in ("graphstep", "graphstep_compiled"):
        forward = torch.compile(model) if method == "graphstep_compiled" else model
        config = graphstep.Config(**(graphstep_config or {}))
        captured = graphstep.capture(
            workload.make_step(forward), model=model, optimizer=workload.optimizer, config=config
        )
        return captured, captured.close, captured
    raise ValueError(f"unknown method {method!r}")


def compiled_step(workload: Workload, mode: str) -> tuple[StepFn, Callable[[], None], None]:
    """The strongest torch.compile anchor: the whole step compiled, backward through compiled
    autograd (so the backward graph, clipping and the optimizer step are traced with the forward),
    in `mode`. Compiled autograd is a process-wide switch: on until the returned close()."""
    import torch._dynamo.config as dynamo_config

    from graphstep.optim.live import LIVE

    opt = workload.optimizer
    if opt in LIVE:  # the gpt suite's optimizer, made capturable (lr a device tensor) for every method
        # Make the live tensors now, eagerly: made inside a cudagraph-tree region they would be its
        # outputs, overwritten by the next run. Then drop graphstep's step pre-hook, which copies
        # assigned numbers into them (nothing assigns any here: no scheduler): its Python would break
        # the compiled graph in two, and this anchor should be torch.compile at its best.
        graphstep.optim.make_capturable(opt).before_call()
        hooks = opt._optimizer_step_pre_hooks  # private; 2.0-2.13
        for key in [
            k for k, hook in hooks.items() if getattr(hook, "__module__", "") == "graphstep.optim.live"
        ]:
            del hooks[key]
    before = dynamo_config.compiled_autograd
    dynamo_config.compiled_autograd = True
    inner = torch.compile(workload.make_step(workload.model), mode=mode)
    reduce_overhead = mode == "reduce-overhead"

    def step(*args: Any) -> Tensor:
        if reduce_overhead:  # a new iteration: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return inner(*args)

    def close() -> None:
        dynamo_config.compiled_autograd = before

    return step, close, None


class ManualGraphStep:
    """The whole step hand-captured into one CUDA graph: what graphstep automates, with none of its checks.

    Calls 1..warmup run the step eagerly on a side stream (AdamW creates its moments, cuBLAS its
    workspaces; capture would fail or bake in the wrong state otherwise). The next call copies its
    inputs into static buffers, captures the step (capture runs nothing) and replays it; later calls
    copy inputs and replay. Each call is one real step. The result returned is the graph's own buffer.
    """

    def __init__(self, fn: StepFn, *, warmup: int = 3):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.side = torch.cuda.Stream()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: tuple[Any, ...] = ()
        self.static_out: Any = None

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(self.side)
            return out
        if self.graph is None:
            self.static_in = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (NCCL's watchdog, say) may use CUDA meanwhile.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.static_out = self.fn(*self.static_in)
        else:
            for buf, a in zip(self.static_in, args, strict=True):
                if isinstance(buf, Tensor):
                    buf.copy_(a)
        self.graph.replay()
        return self.static_out

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()  # frees the graph's private memory pool
        self.graph, self.static_in, self.static_out = None, (), None


# ---------------------------------------------------------------- measuring


def kernel_ms(step: StepFn, workload: Workload, batches: list[tuple]) -> float | None:
    """GPU milliseconds of one step: profiler device time of `len(batches)` steps, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for args in batches:
            step(*args)
            workload.after_call()
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


def cupti_graph_workaround() -> None:
    """Keep CUPTI attached between profiler sessions on CUDA < 12.6, as torch.profiler does itself
    when inductor's global cudagraphs flag is set: re-initialising CUPTI once CUDA graphs exist
    crashes there. Set before the first profiler session of the process."""
    cuda = torch.version.cuda
    if cuda and tuple(int(v) for v in cuda.split(".")[:2]) < (12, 6):
        os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")
        os.environ.setdefault("TEARDOWN_CUPTI", "0")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _write_json(path: str | Path, data: Any) -> None:
    """Write atomically: a reader (the parent, after a timeout kill) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)
