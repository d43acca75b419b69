"""DeepSpeed engines trained under graphstep against an eager twin, for tests/test_integrations_deepspeed.py
(CPU: DeepSpeed's CPU accelerator, gloo, the recording backend) and tests/gpu/test_deepspeed_gpu.py (CUDA
graphs, NCCL). Each rank runs in its own process (tests/ranks.py): DeepSpeed keeps its communication
backend and accelerator in module globals, set once per process.

A case is one engine configuration: ZeRO stage, dtype ("fp32", "bf16", "fp16" with DeepSpeed's dynamic
loss scaler), `gradient_accumulation_steps`, gradient clipping, DeepSpeed's AdamW (`torch_adam`) and its
WarmupLR schedule. Both engines start from the same weights and see the same micro-batches; the report
says whether every loss, every parameter, the loss scale, the learning rate and DeepSpeed's counters
are equal (torch.equal, ==).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import graphstep

COUNTERS = ("global_steps", "micro_steps", "skipped_steps", "global_samples")


def ds_config(
    zero: int, dtype: str, accum: int, *, clip: float = 1.0, bucket: int = 4096, contiguous: bool = True
) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        # Small buckets: DeepSpeed's default (5e8 elements) is a 2 GB buffer the CPU would copy per step.
        "zero_optimization": {
            "stage": zero,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": False,
            "contiguous_gradients": contiguous,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        # 2**20 overflows fp16 gradients at first: the scaler skips steps and halves the scale, then
        # doubles it every 3 good steps: the scale changes most calls.
        config["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 3, "hysteresis": 1}
    return config


def _init(device: str) -> None:
    """DeepSpeed's process group, over the one tests/ranks.py made. On the CPU, without DeepSpeed's
    shared-memory all-reduce: a C++ op it compiles at the first `init_distributed` of a machine (about
    a minute on two cores) and uses only for `inference_all_reduce`; training reduces with
    torch.distributed."""
    import deepspeed
    import deepspeed.ops

    if device == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")


def _fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator offers fp16 only where oneDNN has fp16 kernels; torch's CPU half
    kernels are all these small models need."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        accelerator.is_fp16_supported = lambda: True


def make_engine(config: dict, *, seed: int = 0, on_capture_stream: bool = False) -> Any:
    import deepspeed

    from graphstep.integrations import deepspeed as gs_deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    init = gs_deepspeed.initialize if on_capture_stream else deepspeed.initialize
    engine, _, _, _ = init(model=model, config=config, model_parameters=model.parameters())
    return engine


def ds_step(engine: Any):
    dtype = next(engine.module.parameters()).dtype

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = engine(x.to(dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return train_step


def batches(rank: int, steps: int, device: str, sizes: list[int] | None = None) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    sizes = sizes or [4] * steps
    return [
        (torch.randn(n, 8, generator=g).to(device), torch.randn(n, 1, generator=g).to(device)) for n in sizes
    ]


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_grad(p: torch.Tensor, q: torch.Tensor) -> bool:
    """Bit for bit (an fp16 window that overflows holds NaN, which torch.equal calls different)."""
    if p.grad is None or q.grad is None:
        return p.grad is None and q.grad is None
    bits = _BITS[p.grad.element_size()]
    return p.grad.dtype == q.grad.dtype and torch.equal(p.grad.view(bits), q.grad.view(bits))


def _loss_scale(engine: Any) -> float | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return None if scaler is None else float(scaler.loss_scale)


def compare(case: dict, rank: int, device: str, config: graphstep.Config) -> dict:
    """Train a captured engine and its eager twin on the same micro-batches; report what differs."""
    from graphstep.integrations.deepspeed import capture_engine_step

    ds = ds_config(
        case["zero"],
        case["dtype"],
        case["accum"],
        clip=case.get("clip", 1.0),
        contiguous=case.get("contiguous", True),
    )
    engine = make_engine(ds, on_capture_stream=device == "cuda")
    twin = make_engine(ds)
    data = batches(rank, case["steps"], device, case.get("sizes"))
    step = capture_engine_step(engine, ds_step(engine), config=config)
    eager = ds_step(twin)
    losses, wanted, scales, bad_grads = [], [], [], []
    for i, (x, y) in enumerate(data):
        if i == case.get("regas", (None,))[0]:  # DeepSpeed's own way to change the accumulation steps
            for e in (engine, twin):
                e.set_train_batch_size(
                    e.train_micro_batch_size_per_gpu() * e.dp_world_size * case["regas"][1]
                )
        losses.append(step(x, y))
        wanted.append(eager(x, y))
        scales.append((_loss_scale(engine), _loss_scale(twin)))
        # `param.grad` as a user sees it after the call (inside an accumulation window: the window's so far)
        if not all(_same_grad(p, q) for p, q in zip(engine.module.parameters(), twin.module.parameters())):
            bad_grads.append(i)
    stats = step.stats
    step.close()
    bad_loss = [i for i, (a, b) in enumerate(zip(losses, wanted)) if not torch.equal(a, b)]
    bad_params = [
        name
        for (name, p), q in zip(engine.module.named_parameters(), twin.module.parameters())
        if not torch.equal(p, q)
    ]
    return {
        "case": case,
        "bad_loss_steps": bad_loss,
        "bad_params": bad_params,
        "bad_grad_steps": bad_grads,
        "scales_equal": all(a == b for a, b in scales),
        "scales": sorted({a for a, _ in scales if a is not None}),
        "lr": (engine.get_lr(), twin.get_lr()),
        "counters": {c: (getattr(engine, c), getattr(twin, c)) for c in COUNTERS},
        "stats": {k: getattr(stats, k) for k in ("warmup_calls", "captures", "replays", "eager_calls")},
        "losses": [float(v) for v in losses],
    }


def check(report: dict) -> None:
    """Assert a `compare` report is equal to eager in everything it compares, and that graphs ran."""
    case = report["case"]
    assert not report["bad_loss_steps"] and not report["bad_params"], report
    assert not report["bad_grad_steps"], report
    assert report["scales_equal"] and report["lr"][0] == report["lr"][1], report
    assert all(a == b for a, b in report["counters"].values()), report
    assert report["stats"]["replays"] > 0, report
    if case["dtype"] == "fp16":  # the scaler skipped steps and moved its scale while graphs replayed
        assert report["counters"]["skipped_steps"][0] > 0 and len(report["scales"]) > 2, report
    assert report["counters"]["micro_steps"][0] == case["steps"], report


def _environment(rank: int, size: int) -> None:
    """What DeepSpeed reads of a launcher's environment (tests/ranks.py made the process group)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))


def train_cases(
    rank: int, size: int, cases: list[dict], device: str = "cpu", warmup_steps: int = 2
) -> list[dict]:
    """A worker of tests/ranks.py: every case on this rank, in one process."""
    _environment(rank, size)
    _init(device)
    _fp16_on_cpu()
    if device == "cuda":  # bitwise: eager is run-to-run deterministic only so (CUBLAS_WORKSPACE_CONFIG set)
        torch.use_deterministic_algorithms(True)
    backend = "recording" if device == "cpu" else "cuda"
    config = graphstep.Config(backend=backend, warmup_steps=warmup_steps)
    reports = []
    for case in cases:
        reports.append(compare(case, rank, device, config))
    return reports


def refusals(rank: int, size: int) -> dict:
    """What `capture_engine_step` refuses, and what a plain `graphstep.capture` of the engine's step says."""
    from graphstep.integrations.deepspeed import UnsupportedEngineError, capture_engine_step

    _environment(rank, size)
    _init("cpu")
    found = {}
    for name, change in {
        "zero3": {"zero_optimization": {"stage": 3}},
        "wall_clock": {"wall_clock_breakdown": True},
    }.items():
        engine = make_engine({**ds_config(2, "fp32", 1), **change})
        try:
            capture_engine_step(engine, ds_step(engine))
            found[name] = None
        except UnsupportedEngineError as err:
            found[name] = str(err)
    engine = make_engine(ds_config(2, "fp32", 1))

    def norm_after_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ds_step(engine)(x, y)
        return engine.get_global_grad_norm()

    try:
        capture_engine_step(engine, norm_after_step)(*batches(rank, 1, "cpu")[0])
        found["read_after_step"] = None
    except graphstep.GraphStepError as err:
        found["read_after_step"] = f"{type(err).__name__}: {err}"
    found["norm_between_calls"] = float(engine.get_global_grad_norm())  # outside a call: DeepSpeed's own
    step = graphstep.capture(
        ds_step(engine), model=engine.module, config=graphstep.Config(backend="recording")
    )
    x, y = batches(rank, 1, "cpu")[0]
    try:
        for _ in range(4):
            step(x, y)
        found["plain"] = None
    except graphstep.GraphStepError as err:
        found["plain"] = f"{type(err).__name__}: {err}"
    step.close()
    found["counters_after_refusal"] = {c: getattr(engine, c) for c in COUNTERS}
    return found
