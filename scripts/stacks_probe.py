"""Probe of the production training stacks under graphstep (issue 39, phase 1).

Runs one part per call, each a few training steps of the stack's own step, eagerly and under
`graphstep.capture`, and prints one `RESULT <part>: <PASS|FAIL|REFUSED|ERROR> <details>` line:

    python scripts/stacks_probe.py versions
    python scripts/stacks_probe.py titan-llama3 --device cpu      # recording backend on CPU
    python scripts/stacks_probe.py titan-dsv3 --device cuda       # CUDA graphs, deterministic mode
    python scripts/stacks_probe.py deepspeed --device cuda --zero 2 --dtype bf16

torchtitan parts use torchtitan's own train spec: model class and debug flavour, parallelize
function (1 rank: no sharding), weight init, optimizer and lr-scheduler builders, loss and its
gradient clipping, in the order of torchtitan's trainer. The DeepSpeed part builds an engine on a
small MLP and steps it as a DeepSpeed user does: `engine(x)`, `engine.backward(loss)`, `engine.step()`.
A capture that graphstep refuses is a REFUSED line with graphstep's message; the eager twin starts
from the same weights and the comparison is bitwise (torch.equal on every loss and parameter).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

import torch

import graphstep

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _backend(device: str) -> graphstep.Config:
    return graphstep.Config(backend="recording" if device == "cpu" else "auto")


@contextlib.contextmanager
def _deterministic(device: str, warn_only: bool = False):
    """torch's deterministic mode. `warn_only`: for torchtitan's MoE, whose router counts
    tokens with `torch.histc`, which has no deterministic CUDA kernel and raises otherwise (integer
    counts are exact whatever the order); torch then warns for every op without one, in the log.
    On CPU too: the DeepSeek-V3 debug model in fp32 differs eager against eager from step 2 without it
    (its scatter-adds), which made the phase-1 CPU probe report a mismatch after the `.tolist()` fix."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def _first_difference(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        p, q = getattr(p, "_local_tensor", p), getattr(q, "_local_tensor", q)
        if not torch.equal(p, q):
            return f"{name}: max |diff| {(p.float() - q.float()).abs().max().item():.3g}"
    return None


def _compare(part: str, losses: list, wanted: list, model, twin, stats) -> None:
    for i, (a, b) in enumerate(zip(losses, wanted, strict=True)):
        if not torch.equal(a, b):
            print(f"RESULT {part}: FAIL step {i} loss {a.item()!r} vs eager {b.item()!r} ({stats})")
            return
    diff = _first_difference(model, twin)
    if diff:
        print(f"RESULT {part}: FAIL parameters differ after {len(losses)} steps: {diff} ({stats})")
        return
    print(f"RESULT {part}: PASS {len(losses)} steps bitwise equal to eager ({stats})")


def _refused(part: str, err: BaseException) -> None:
    kind = "REFUSED" if isinstance(err, graphstep.GraphStepError) else "ERROR"
    where = traceback.extract_tb(err.__traceback__)[-1]
    text = " ".join(str(err).split())
    print(
        f"RESULT {part}: {kind} {type(err).__name__} at {where.filename}:{where.lineno}: {text[: int(os.environ.get('PROBE_TEXT', '1500'))]}"
    )


def _one_rank(device: str, port: str) -> None:
    """A process group of one rank, as torchtitan's trainer and DeepSpeed always make (torchtitan's MoE
    load-balancing hook asks for a device mesh even on one rank)."""
    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.distributed.init_process_group("gloo" if device == "cpu" else "nccl")


# ---------------------------------------------------------------- torchtitan


def _titan_step(model, opts, scheds, loss_fn, job, sched_inside: bool):
    from torchtitan.distributed import utils as dist_utils

    params = [p for p in model.parameters()]

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opts.zero_grad()
        pred = model(tokens)
        loss = loss_fn(pred, labels) / labels.numel()  # torchtitan: sum loss over the valid tokens
        loss.backward()
        dist_utils.clip_grad_norm_(
            params, job.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False
        )
        opts.step()
        if sched_inside:  # as torchtitan's trainer does; graphstep's recipe steps it after the call
            scheds.step()
        return loss.detach()

    return step


def titan(
    part: str, name: str, flavor: str, device: str, steps: int, sched_inside: bool, inner: bool
) -> None:
    from titan_common import histc_on_cpu

    _one_rank(device, "29531")
    with histc_on_cpu() if device == "cpu" and name == "deepseek_v3" else contextlib.nullcontext():
        _titan(part, name, flavor, device, steps, sched_inside, inner)


def _titan(
    part: str, name: str, flavor: str, device: str, steps: int, sched_inside: bool, inner: bool
) -> None:
    from titan_common import build  # tests/titan_common.py: the model built by torchtitan's train spec

    seq_len = 64
    knobs = {
        "ac": os.environ.get("PROBE_AC", "none"),
        "implementation": os.environ.get("PROBE_OPT_IMPL", "fused"),
    }
    made, twin_made = (build(name, device, flavor=flavor, seq_len=seq_len, **knobs) for _ in range(2))
    model, opts, scheds, loss_fn, job, args = (
        made.model,
        made.optimizers,
        made.lr_schedulers,
        made.loss_fn,
        made.job,
        made.args,
    )
    twin, t_opts, t_scheds, t_loss_fn = (
        twin_made.model,
        twin_made.optimizers,
        twin_made.lr_schedulers,
        twin_made.loss_fn,
    )
    if _first_difference(model, twin):
        print(f"RESULT {part}: ERROR the two builds differ before training")
        return
    print(
        f"{part}: {type(model).__name__} {flavor}, {sum(p.numel() for p in model.parameters())} parameters, "
        f"optimizer {type(opts).__name__}[{', '.join(type(o).__name__ for o in opts.optimizers)}]"
    )
    for o in (*opts.optimizers, *t_opts.optimizers):  # the eager twin gets graphstep's settings too
        graphstep.optim.make_capturable(o, device)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab_size, (2, seq_len + 1), generator=g).to(device) for _ in range(steps)]
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    eager = _titan_step(twin, t_opts, t_scheds, t_loss_fn, job, sched_inside)
    # graphstep prepares the optimizer it is given; torchtitan's OptimizersContainer holds the real ones
    given = opts.optimizers[0] if inner else opts
    with _deterministic(device, warn_only=getattr(args, "moe_args", None) is not None):
        wanted = []
        for x, y in batches:
            wanted.append(eager(x, y))
            if not sched_inside:
                t_scheds.step()
        step = graphstep.capture(
            _titan_step(model, opts, scheds, loss_fn, job, sched_inside),
            model=model,
            optimizer=given,
            config=_backend(device),
        )
        losses = []
        try:
            for x, y in batches:
                losses.append(step(x, y))
                if not sched_inside:
                    scheds.step()
        except Exception as err:
            _refused(part, err)
            return
    _compare(part, losses, wanted, model, twin, step.stats)


# ---------------------------------------------------------------- DeepSpeed


def _ds_engine(device: str, zero: int, dtype: str, seed: int, accum: int):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(os.environ.get("PROBE_DS_CLIP", "1.0")),
        # PROBE_DS_OVERLAP_COMM=0: ZeRO's overlap_comm off, which drops the accelerator.synchronize() calls
        # its gradient reduction makes inside the backward (stage_1_and_2.py: `if self.overlap_comm:`)
        "zero_optimization": {
            "stage": zero,
            "overlap_comm": os.environ.get("PROBE_DS_OVERLAP_COMM", "1") != "0",
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        # PROBE_DS_NO_OVERFLOW_CHECK=1: DeepSpeed's bf16 option that drops its per-step host read
        config["bf16"] = {
            "enabled": True,
            "check_grad_overflow": not os.environ.get("PROBE_DS_NO_OVERFLOW_CHECK"),
        }
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    # PROBE_DS_CAPTURE_STREAM=1 (CUDA): the engine built on graphstep's capture stream, as DDP must be: ZeRO's
    # gradient hooks and accumulators are made at initialize, and autograd runs them on that stream
    on_capture_stream = device == "cuda" and os.environ.get("PROBE_DS_CAPTURE_STREAM") == "1"
    with torch.cuda.stream(graphstep.capture_stream()) if on_capture_stream else contextlib.nullcontext():
        engine, opt, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=model.parameters()
        )
    return engine, opt


def _ds_step(engine):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = engine(x.to(next(engine.module.parameters()).dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def deepspeed_part(part: str, device: str, steps: int, zero: int, dtype: str, accum: int, given: str) -> None:
    import deepspeed

    dev = "cpu" if device == "cpu" else "cuda"
    _one_rank(dev, "29533")
    deepspeed.init_distributed(dist_backend="gloo" if dev == "cpu" else "nccl")
    engine, opt = _ds_engine(dev, zero, dtype, seed=0, accum=accum)
    twin, _ = _ds_engine(dev, zero, dtype, seed=0, accum=accum)
    print(
        f"{part}: deepspeed {deepspeed.__version__}, engine optimizer {type(opt).__name__}, "
        f"accelerator {deepspeed.get_accelerator().device_name()}"
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 32, generator=g).to(dev), torch.randn(4, 1, generator=g).to(dev))
        for _ in range(steps)
    ]
    with _deterministic(device):
        wanted = [_ds_step(twin)(x, y) for x, y in batches]
        # DeepSpeed's ZeRO optimizer wraps a torch optimizer (`.optimizer`) without being one
        optimizer = {"zero": opt, "inner": getattr(opt, "optimizer", None), "none": None}[given]
        step = graphstep.capture(
            _ds_step(engine), model=engine.module, optimizer=optimizer, config=_backend(device)
        )
        try:
            losses = [step(x, y) for x, y in batches]
        except Exception as err:
            _refused(part, err)
            return
    _compare(part, losses, wanted, engine.module, twin.module, step.stats)


# ---------------------------------------------------------------- .tolist()


def tolist_part(part: str, device: str, steps: int) -> None:
    """A step that sizes a slice with `.tolist()`, as torchtitan's for-loop MoE experts split tokens:
    graphstep must refuse it or run it eagerly; a replay with the captured size is a silent error."""
    w = torch.nn.Parameter(torch.randn(4, device=device))
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        n = (x > 0).sum().tolist()
        return (x[:n].sum() + w.sum() * 0).detach()

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, generator=g).to(device) for _ in range(steps)]
    captured = graphstep.capture(step, optimizer=opt, config=_backend(device))
    try:
        got = [captured(x) for x in xs]
    except Exception as err:
        _refused(part, err)
        return
    wanted = [step(x) for x in xs]
    bad = [i for i, (a, b) in enumerate(zip(got, wanted)) if not torch.equal(a, b)]
    verdict = f"FAIL silent: steps {bad} differ from eager" if bad else "PASS equal to eager"
    print(f"RESULT {part}: {verdict} ({captured.stats})")


# ---------------------------------------------------------------- main


def versions() -> None:
    import importlib

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"gpu {torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}"
    )
    for name in (
        "torchtitan",
        "deepspeed",
        "transformer_engine",
        "datasets",
        "torchdata",
        "tyro",
        "pydantic",
        "triton",
    ):
        try:
            mod = importlib.import_module(name)
            print(f"  {name} {getattr(mod, '__version__', '?')} from {os.path.dirname(mod.__file__)}")
        except Exception as err:  # a missing stack is a line of the report, not a crash
            print(f"  {name}: not importable: {type(err).__name__}: {err}")
    from graphstep.guards.user_code import is_user_file

    for name in ("torchtitan", "deepspeed"):
        with contextlib.suppress(Exception):
            mod = importlib.import_module(name)
            print(f"  graphstep counts {name} as {'USER' if is_user_file(mod.__file__) else 'library'} code")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["versions", "titan-llama3", "titan-dsv3", "deepspeed", "tolist"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--sched", default="outside", choices=["inside", "outside"], help="lr scheduler step")
    p.add_argument(
        "--optimizer",
        default="inner",
        choices=["inner", "container", "zero", "none"],
        help="what capture is given: torchtitan inner|container, DeepSpeed zero|inner|none",
    )
    a = p.parse_args()
    part = a.part
    if a.part == "deepspeed":
        part = f"deepspeed-zero{a.zero}-{a.dtype}-accum{a.accum}-opt_{a.optimizer}"
    if a.part.startswith("titan"):
        part = f"{part}-sched_{a.sched}-opt_{a.optimizer}"
    part = f"{part}@{a.device}"
    flags = {"sched_inside": a.sched == "inside", "inner": a.optimizer == "inner"}
    try:
        if a.part == "versions":
            versions()
        elif a.part == "titan-llama3":
            titan(part, "llama3", "debugmodel", a.device, a.steps, **flags)
        elif a.part == "tolist":
            tolist_part(part, a.device, a.steps)
        elif a.part == "titan-dsv3":
            titan(part, "deepseek_v3", "debugmodel", a.device, a.steps, **flags)
        else:
            deepspeed_part(part, a.device, a.steps, a.zero, a.dtype, a.accum, a.optimizer)
    except Exception as err:
        traceback.print_exc()
        _refused(part, err)


if __name__ == "__main__":
    main()
