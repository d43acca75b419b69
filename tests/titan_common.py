"""torchtitan's own training pieces under graphstep, for the tests of docs/frameworks.md's recipe.

Everything comes from torchtitan's train spec, in the order of its trainer (`torchtitan/train.py`):
model on the meta device, `parallelize_fn` (tensor parallel, activation checkpointing, per-block
`torch.compile`, FSDP2, as the job config asks), `to_empty`, `init_weights`, `build_optimizers_fn`,
`build_lr_schedulers_fn`, `build_loss_fn`. The step is the recipe, as written in the docs: forward, sum
loss over the global token count, backward, torchtitan's `clip_grad_norm_`, its optimizer container's
step; the lr schedulers step after each call. A run trains an eager twin built the same way and the
captured one on the same batches and compares every loss, gradient norm and parameter bitwise.

torchtitan is imported inside the functions only: this module is imported by tests that skip when
torchtitan is absent, and by `run_ranks` workers (tests/ranks.py: a worker lives in an importable module).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import graphstep

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


@dataclasses.dataclass
class Titan:
    model: torch.nn.Module
    optimizers: Any  # torchtitan's OptimizersContainer
    lr_schedulers: Any  # torchtitan's LRSchedulersContainer
    loss_fn: Callable
    job: Any
    args: Any
    dims: Any


@contextlib.contextmanager
def histc_on_cpu() -> Iterator[None]:
    """torchtitan's MoE router counts tokens per expert with `torch.histc` of int64 indices, which torch
    implements on CUDA only ("histogram_cpu" not implemented for 'Long'): on a CPU, counted in float32
    (exact for these small counts) while the context lasts."""
    histc = torch.histc

    def cpu_histc(x, *args, **kwargs):
        if x.device.type == "cpu" and not x.is_floating_point():
            return histc(x.float(), *args, **kwargs).to(x.dtype)
        return histc(x, *args, **kwargs)

    torch.histc = cpu_histc
    try:
        yield
    finally:
        torch.histc = histc


def parallel_dims(world_size: int = 1, dp_shard: int = 1, tp: int = 1):
    from torchtitan.distributed import ParallelDims

    return ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world_size
    )


def build(
    name: str,
    device: str,
    *,
    flavor: str = "debugmodel",
    seq_len: int = 32,
    n_layers: int | None = None,
    ac: str = "none",
    compile_blocks: bool = False,
    dims: Any = None,
    seed: int = 0,
    implementation: str = "fused",
) -> Titan:
    """torchtitan's model `name` (`llama3`, `deepseek_v3`), flavour `flavor`, built and parallelized by
    its train spec. `n_layers` cuts the debug model shorter (CPU tests); `ac`: torchtitan's activation
    checkpointing mode (`none`, `full`, `selective`); `compile_blocks`: torchtitan's per-block compile;
    `implementation`: its optimizers' (`fused`, its default; `foreach`, `for-loop`)."""
    from torchtitan.config import JobConfig
    from torchtitan.protocols.train_spec import get_train_spec

    if device == "cpu":  # torchtitan takes "cuda" when no accelerator is found; its meshes fail on CPU
        import torchtitan.distributed.parallel_dims as titan_dims

        titan_dims.device_type = "cpu"
    spec = get_train_spec(name)
    job = JobConfig()
    job.model.name, job.model.flavor = name, flavor
    job.training.seq_len, job.training.steps, job.training.max_norm = seq_len, 100, 1.0
    job.lr_scheduler.warmup_steps = 4  # the lr changes at every step of a test
    job.activation_checkpoint.mode = ac
    job.optimizer.implementation = implementation
    job.compile.enable, job.compile.components = compile_blocks, ["model"]
    args = copy.deepcopy(spec.model_args[flavor])
    if n_layers is not None:
        args.n_layers = n_layers
    args.update_from_config(job)
    moe = getattr(args, "moe_args", None)
    if moe is not None and device == "cpu":
        moe.use_grouped_mm = False  # torch._grouped_mm is CUDA-only: torchtitan's for-loop experts
    dims = dims if dims is not None else parallel_dims()
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, dims, job)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    model.train()
    optimizers = spec.build_optimizers_fn([model], job.optimizer, dims)
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, job.lr_scheduler, job.training.steps)
    return Titan(model, optimizers, lr_schedulers, spec.build_loss_fn(job), job, args, dims)


def train_step(t: Titan, device_type: str) -> Callable:
    """The recipe's step (docs/frameworks.md, "torchtitan"): torchtitan's `train_step` and
    `forward_backward_step` for one micro-batch, with its train context (loss parallel under TP) and its
    autocast (bf16 on one device without FSDP), without the scheduler step (after the call) and logging."""
    from torchtitan.distributed import utils as dist_utils

    model, optimizers, loss_fn, job, parallel_dims = t.model, t.optimizers, t.loss_fn, t.job, t.dims
    train_context = dist_utils.get_train_context(
        parallel_dims.tp_enabled and not job.parallelism.disable_loss_parallel
    )
    maybe_enable_amp = dist_utils.maybe_enable_amp(
        parallel_dims, job.training.mixed_precision_param, device_type
    )

    def step(inputs, labels, global_valid_tokens):
        optimizers.zero_grad()
        with train_context():
            with maybe_enable_amp:
                pred = model(inputs)
                loss = loss_fn(pred, labels) / global_valid_tokens
            del pred
            loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            list(model.parameters()),
            job.training.max_norm,
            foreach=True,
            pp_mesh=None,
            ep_enabled=parallel_dims.ep_enabled,
        )
        optimizers.step()
        loss = loss.detach()
        if isinstance(loss, DTensor):  # loss parallel (TP): a replicated DTensor, returned as a plain tensor
            loss = loss.full_tensor()
        return loss, grad_norm.detach()

    return step


def valid_tokens(labels: torch.Tensor, t: Titan) -> torch.Tensor:
    """The global token count, as torchtitan's trainer computes it (summed over the batch mesh, read on
    the host), handed to the step as a 0-d tensor: a replay reads its value."""
    from torchtitan.distributed import utils as dist_utils

    parallel_dims = t.dims
    local = (labels != IGNORE_INDEX).sum()
    tokens = (
        dist_utils.dist_sum(local, parallel_dims.get_mesh("batch")) if parallel_dims.dp_enabled else local
    )
    return torch.as_tensor(tokens, dtype=torch.float32, device=labels.device)


def batches(vocab: int, n: int, seq_len: int, device: str, *, batch: int = 2, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        d = torch.randint(0, vocab, (batch, seq_len + 1), generator=g).to(device)
        out.append((d[:, :-1].contiguous(), d[:, 1:].contiguous()))
    return out


def local(p: torch.Tensor) -> torch.Tensor:
    return getattr(p, "_local_tensor", p)


def run_pair(
    name: str,
    device: str,
    *,
    steps: int,
    config: graphstep.Config,
    dims_of: Callable[[], Any] | None = None,
    data_seed: int = 1,
    **build_kwargs: Any,
) -> dict:
    """`steps` steps of torchtitan's model, eager and through graphstep, compared bitwise."""
    dims = dims_of() if dims_of else None  # one set of meshes for both twins
    made = [build(name, device, dims=dims, **build_kwargs) for _ in range(2)]
    eager, graphed = made
    for t in made:  # the eager twin gets graphstep's optimizer settings too (docs/optimizers.md)
        for o in t.optimizers.optimizers:
            graphstep.optim.make_capturable(o, device)
    data = batches(eager.args.vocab_size, steps, eager.job.training.seq_len, device, seed=data_seed)
    eager_step = train_step(eager, device)
    wanted = []
    for x, y in data:
        wanted.append(eager_step(x, y, valid_tokens(y, eager)))
        eager.lr_schedulers.step()
    step = graphstep.capture(
        train_step(graphed, device),
        model=graphed.model,
        optimizer=graphed.optimizers.optimizers,  # the torch optimizers inside torchtitan's container
        config=config,
    )
    got = []
    for x, y in data:
        got.append(step(x, y, valid_tokens(y, graphed)))
        graphed.lr_schedulers.step()
    first_bad = next(
        (
            i
            for i, (a, b) in enumerate(zip(got, wanted))
            if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
        ),
        None,
    )
    params = [
        n
        for (n, p), q in zip(graphed.model.named_parameters(), eager.model.parameters(), strict=True)
        if not torch.equal(local(p), local(q))
    ]
    report = {
        "losses": [float(a[0]) for a in got],
        "eager_losses": [float(b[0]) for b in wanted],
        "first_bad_step": first_bad,
        "params_differ": params,
        "lr": float(graphed.lr_schedulers.schedulers[0].get_last_lr()[0]),  # a live tensor, perhaps
        "stats": dataclasses.asdict(step.stats),
        # eager segments between the graph's parts (an optimizer step moved out, a graph break)
        "segments": [
            getattr(s, "name", type(s).__name__)
            for life in step._lives.values()
            for s in getattr(life.current.recording, "segments", ())
        ],
        "backend": step.backend_name,
        "pool_bytes": step.stats.pool_bytes,
    }
    step.close()
    return report


def fsdp_tp_pair(
    rank: int,
    size: int,
    *,
    steps: int = 6,
    dp_shard: int = 2,
    tp: int = 2,
    device: str = "cuda",
    graph_backend: str = "cuda",
) -> dict:
    """A `run_ranks` worker: torchtitan's `parallelize_llama` on a dp_shard × tp mesh (FSDP2 × TP) of the
    Llama 3 debug model, eager twin and graphstep each parallelized the same way, in deterministic mode.
    (`device="cpu", graph_backend="eager"`: the same code path on gloo, without graphs, to check the worker.)"""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.use_deterministic_algorithms(True)
    return run_pair(
        "llama3",
        device,
        steps=steps,
        config=graphstep.Config(backend=graph_backend),
        dims_of=lambda: parallel_dims(world_size=size, dp_shard=dp_shard, tp=tp),
        # each data-parallel rank reads its own batches, as torchtitan's dataloader gives them
        data_seed=1 + rank // tp,
        seq_len=64,
    )
