"""`graphstep demo`: train the tiny GPT twice, eagerly and with graphstep, and compare.

Both runs start from the same weights and see the same batches. The demo prints the two loss
curves, the median step time of each run, and checks the promise graphstep makes: every loss and
every final parameter is bitwise equal (`torch.equal`) to eager. The exit code is 1 when they are not.

The pieces a training step is made of (optimizer, step function, timing) live here too, so the
benchmark (`graphstep.bench`) times exactly the step the demo verifies.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import graphstep

from .gpt import GPT, TINY, make_batches

log = logging.getLogger("graphstep")

LR = 3e-4
CLIP_NORM = 1.0
DEFAULT_STEPS = 300
DEFAULT_STEPS_CPU = 200
"""Both runs of 200 steps together take about 20 s on 2 CPU cores (tiny GPT, batch 8): well under a minute."""
BATCH_SIZE = 8
WARMUP_STEPS = 3

StepFn = Callable[[Tensor, Tensor], Tensor]


# ---------------------------------------------------------------- the step (shared with the benchmark)


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with torch's default implementation choice (foreach on CUDA).

    On CUDA every run, eager ones included, gets the settings graphstep gives a captured optimizer
    (`graphstep.optim.make_capturable`: capturable=True, lr as a device tensor). They are a different
    code path from the defaults, so eager and graph runs must both use them to be bitwise comparable.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if device.type == "cuda":
        graphstep.optim.make_capturable(opt, device)
    return opt


def make_train_step(model: nn.Module, opt: torch.optim.Optimizer, *, amp: bool) -> StepFn:
    """One training step as users write it: forward, backward, clip, optimizer step, zero grads.

    `model` may be a `torch.compile`d module; its `.parameters()` are the original module's.
    `amp` turns on bf16 autocast (CUDA only).
    """
    params = list(model.parameters())

    def train_step(x: Tensor, y: Tensor) -> Tensor:  # x, y: (B, T) int64 token ids
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    train_step.__qualname__ = "train_step"  # how graphstep's log lines name it
    return train_step


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock read afterwards covers it. No-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: StepFn, x: Tensor, y: Tensor, *, device: torch.device) -> tuple[Tensor, float]:
    """Call `fn(x, y)` and return its result and wall-clock seconds, GPU work included.

    Synchronising before and after means the time is one step's latency: host dispatch plus the
    GPU finishing the step, with nothing of the previous step still queued.
    """
    synchronize(device)
    t0 = time.perf_counter()
    out = fn(x, y)
    synchronize(device)
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- the demo


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    name: str
    """"eager" or "graphstep"."""
    losses: Tensor
    """(steps,) float32 loss of every step, on the host."""
    step_s: list[float]
    """Wall-clock seconds of each steady-state step (warm-up and capture calls left out)."""
    state: dict[str, Tensor]
    """The model's final state_dict."""


def run_demo(steps: int | None = None, device: str | None = None) -> int:
    """Train eagerly and with graphstep, print the comparison, return 0 when bitwise equal, else 1."""
    # cuBLAS reads this when it creates its handle, i.e. before the first matmul: set it first.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(
            f"graphstep demo: --device {device} asked for CUDA, but torch sees no CUDA GPU.", file=sys.stderr
        )
        return 2
    if steps is None:
        steps = DEFAULT_STEPS if dev.type == "cuda" else DEFAULT_STEPS_CPU
    if steps < 1:
        print(f"graphstep demo: --steps must be >= 1, got {steps}.", file=sys.stderr)
        return 2

    # Eager is only run-to-run deterministic with deterministic kernels (no atomics in reductions);
    # without it a mismatch could be eager's own noise.
    with deterministic():
        return _compare(steps=steps, device=dev)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels while inside (what a bitwise comparison with eager needs); the
    process-global setting, warn-only included, is put back afterwards."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)


def _compare(*, steps: int, device: torch.device) -> int:
    amp = device.type == "cuda"
    torch.manual_seed(0)
    with device:
        model = GPT(TINY)
    twin = copy.deepcopy(model)  # same initial weights, bit for bit
    batches = make_batches(TINY, batch_size=BATCH_SIZE, n_batches=steps, device=device)
    n_params = sum(p.numel() for p in model.parameters())

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"graphstep demo: tiny GPT ({n_params / 1e6:.2f}M parameters), batch {BATCH_SIZE} x {TINY.seq_len} "
        f"tokens, {steps} steps, AdamW(lr={LR}) + clip_grad_norm_({CLIP_NORM})"
        f"{', bf16 autocast' if amp else ''}, on {where}."
    )
    if device.type != "cuda":
        why = "--device is the CPU" if torch.cuda.is_available() else "CUDA is not available"
        print(
            f"{why}, so graphstep runs its eager backend: no CUDA graphs, both runs execute the same "
            "eager code and the speed-up is about 1x. The bitwise-equality check still runs."
        )

    eager = _train(
        "eager", make_train_step(model, make_optimizer(model, device), amp=amp), model, batches, device
    )

    twin_opt = make_optimizer(twin, device)
    config = graphstep.Config(warmup_steps=WARMUP_STEPS, outputs="clone")
    step = graphstep.capture(
        make_train_step(twin, twin_opt, amp=amp), model=twin, optimizer=twin_opt, config=config
    )
    try:
        graphed = _train("graphstep", step, twin, batches, device)
        stats, backend = step.stats, step.backend_name  # stats is a snapshot: taken before close()
    finally:
        step.close()

    _print_losses(eager, graphed)
    _print_speed(eager, graphed, device)
    fallback = f", {stats.eager_calls} eager fallback calls" if stats.eager_calls else ""
    pool = f", memory pool {stats.pool_bytes / 2**20:.1f} MiB" if backend == "cuda" else ""
    print(
        f"graphstep ({backend} backend): {stats.warmup_calls} warm-up calls ({stats.warmup_s:.2f} s), "
        f"{stats.captures} capture(s) ({stats.capture_s:.2f} s), {stats.replays} replays{fallback}{pool}."
    )
    if stats.captures > 1:
        print("  (more than one capture: the timed steps above include re-captures)")
    return _print_equality(eager, graphed)


def _train(
    name: str, step: StepFn, model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: torch.device
) -> RunResult:
    losses: list[Tensor] = []
    step_s: list[float] = []
    bar, logs_around_bar = _progress(total=len(batches), desc=f"{name:<9}")
    with logs_around_bar:
        for i, (x, y) in enumerate(batches):
            loss, dt = timed(step, x, y, device=device)
            # Steady state only: graphstep's warm-up calls and its capturing call are not what a
            # step costs. Eager skips as many first calls (allocator, cuBLAS, autotuning warm-up).
            if i > WARMUP_STEPS:
                step_s.append(dt)
            losses.append(loss.detach())
            bar.update(1)
            if i % 10 == 0 or i == len(batches) - 1:
                bar.set_postfix_str(f"loss {loss.item():.4f}")  # syncs, but outside the timed call
        bar.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return RunResult(name=name, losses=torch.stack(losses).float().cpu(), step_s=step_s, state=state)


# ---------------------------------------------------------------- the summary


def _print_losses(*runs: RunResult) -> None:
    lo = min(float(r.losses.min()) for r in runs)
    hi = max(float(r.losses.max()) for r in runs)
    print(f"\n{'loss':<11}{'first':>8}{'last':>8}{'min':>8}   curve (common scale {lo:.2f}..{hi:.2f})")
    for r in runs:
        first, last, low = float(r.losses[0]), float(r.losses[-1]), float(r.losses.min())
        print(f"{r.name:<11}{first:8.4f}{last:8.4f}{low:8.4f}   {sparkline(r.losses, lo=lo, hi=hi)}")


def _print_speed(eager: RunResult, graphed: RunResult, device: torch.device) -> None:
    if not eager.step_s or not graphed.step_s:
        print(f"\nstep time: too few steps to time (the first {WARMUP_STEPS + 1} are warm-up and capture).")
        return
    e_ms = statistics.median(eager.step_s) * 1e3
    g_ms = statistics.median(graphed.step_s) * 1e3
    clock = "CUDA-synchronised wall clock" if device.type == "cuda" else "wall clock"
    print(f"\nstep time, median over the steady-state steps ({clock}, warm-up and capture excluded):")
    print(f"  eager      {e_ms:8.2f} ms  ({len(eager.step_s)} steps)")
    print(f"  graphstep  {g_ms:8.2f} ms  ({len(graphed.step_s)} steps)  ->  {e_ms / g_ms:.2f}x")


def _print_equality(eager: RunResult, graphed: RunResult) -> int:
    a, b = eager.losses, graphed.losses
    losses_equal = torch.equal(a, b)
    bad_params = [k for k, v in eager.state.items() if not torch.equal(v, graphed.state[k])]
    n_equal = len(eager.state) - len(bad_params)
    print(
        f"\nbitwise equal to eager (torch.equal): losses {'yes' if losses_equal else 'NO'} ({len(a)} steps), "
        f"final parameters {'yes' if not bad_params else 'NO'} ({n_equal}/{len(eager.state)} tensors equal)."
    )
    if not losses_equal:
        first = int((a != b).nonzero()[0, 0])
        print(
            f"  losses first differ at step {first + 1} (counting from 1): eager {a[first].item()!r} vs "
            f"graphstep {b[first].item()!r}; largest difference {(a - b).abs().max().item():.3g}."
        )
    if bad_params:
        print(f"  parameters that differ: {', '.join(bad_params[:8])}{' ...' if len(bad_params) > 8 else ''}")
    if losses_equal and not bad_params:
        return 0
    print("FAILED: graphstep's training diverged from eager. Please report this with the output above.")
    return 1


def sparkline(values: Tensor, *, lo: float, hi: float, width: int = 48) -> str:
    """A one-line picture of a curve: `values` averaged into `width` buckets, one glyph per bucket."""
    ramp = "▁▂▃▄▅▆▇█"
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        ramp.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        ramp = "_.-=+*#@"  # a terminal that cannot show block glyphs still gets a curve
    chunks = values.float().tensor_split(min(width, len(values)))
    span = (hi - lo) or 1.0
    return "".join(ramp[min(len(ramp) - 1, int((float(c.mean()) - lo) / span * len(ramp)))] for c in chunks)


class _TextBar:
    """The part of tqdm's interface the demo uses, for when tqdm is not installed."""

    def __init__(self, *, total: int, desc: str):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.tty = sys.stderr.isatty()
        self.last_draw = 0.0

    def update(self, n: int) -> None:
        self.n += n
        if self.tty and (time.monotonic() - self.last_draw > 0.1 or self.n == self.total):
            self._draw(end="\r")

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        self._draw(end="\n")

    def _draw(self, *, end: str) -> None:
        filled = 30 * self.n // max(self.total, 1)
        bar = "#" * filled + "-" * (30 - filled)
        sys.stderr.write(f"{self.desc} [{bar}] {self.n}/{self.total} {self.postfix}{end}")
        sys.stderr.flush()
        self.last_draw = time.monotonic()


def _progress(*, total: int, desc: str) -> tuple[Any, contextlib.AbstractContextManager]:
    """A progress bar, and a context that routes graphstep's log lines around it, not through it."""
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        return _TextBar(total=total, desc=desc), contextlib.nullcontext()
    bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
    # Only where someone (the CLI) gave graphstep's logger a handler: the redirect would add one.
    redirect = logging_redirect_tqdm(loggers=[log]) if log.handlers else contextlib.nullcontext()
    return bar, redirect
