"""Per-rank bodies of the distributed tests (CPU over gloo, GPU over NCCL), run by `ranks.run_ranks`.

Each trains the demo GPT twice in the same process, from the same initial weights and data:
once eagerly, once through graphstep, and reports whether losses and parameters are bitwise
equal plus graphstep's counters, so the test process can compare ranks with each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

import graphstep
from graphstep.bench.parallel import parallelize, parallelize_2d
from graphstep.demo.gpt import GPT, GPTConfig, make_batches
from graphstep.errors import ClosedError, HostSyncError
from graphstep.optim.python_state import grad_references

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
LOSS_SCALES = [1.0 + 0.01 * k for k in range(16)]
SCALE_AT = 0
"""Which loss scale a step made with `scaled=True` reads (as a Python float): a counter its loop sets."""


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _build(
    kind: str | None, device: torch.device, mesh: Any = None, *, sgd: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The GPT under `kind` with AdamW (SGD: no host syncs on CPU, for the recording backend)."""
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    if kind == "fsdp_tp":
        model = parallelize_2d(model, mesh)
    elif kind is not None:
        model = parallelize(model, kind, mesh)
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphstep.optim.make_capturable(opt, device.type)  # what graphstep does to its own
    return model, opt


def _step_fn(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    device: torch.device,
    *,
    micro_batches: int = 1,
    sync_on: int | None = None,
    scaled: bool = False,
):
    """One optimizer step over `micro_batches` slices of the batch; under DDP, gradients are
    all-reduced only in the last one's backward (`no_sync` for the others). `scaled`: the loss is
    scaled by `LOSS_SCALES[SCALE_AT]`, a Python float baked into a graph."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = i == micro_batches - 1
            with model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = model(xs, ys) / micro_batches
                    if scaled:
                        loss = loss * LOSS_SCALES[SCALE_AT]
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if sync_on == dist.get_rank():
            float(total)  # a host sync on one rank only
        return total

    return step


def _data(
    kind: str | None, rank: int, n: int, device: torch.device, batch: int = 4, data_rank: int | None = None
) -> list:
    # Data-parallel ranks see different batches; tensor-parallel ranks the same ones.
    seed = 0 if kind == "tp" else (rank if data_rank is None else data_rank)
    return make_batches(CFG, batch_size=batch, n_batches=n, seed=seed, device=device.type)


def _report(eager_model, model, eager_losses, losses, step) -> dict:
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(eager_losses, losses, strict=True)),
        "params_equal": all(
            torch.equal(_local(a), _local(b))
            for a, b in zip(eager_model.parameters(), model.parameters(), strict=True)
        ),
        "stats": dataclasses.asdict(step.stats),
        "backend": step.backend_name,
    }


def train_pair(
    rank: int,
    size: int,
    *,
    kind: str,
    steps: int = 30,
    backend: str = "auto",
    mesh_shape: tuple | None = None,
    micro_batches: int = 1,
    segment: bool = False,
) -> dict:
    """`steps` steps of the GPT under `kind`, eager and through graphstep, compared bitwise. `segment`:
    graphstep's first block runs as an eager segment (its gradients reach DDP's hooks in the graph after
    its backward)."""
    device = _device(rank)
    torch.use_deterministic_algorithms(True)
    mesh = data_rank = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp", "tp"))
        data_rank = mesh["dp"].get_local_rank()
    data = _data(kind, rank, steps, device, data_rank=data_rank)
    eager_model, eager_opt = _build(kind, device, mesh)
    eager_step = _step_fn(eager_model, eager_opt, device, micro_batches=micro_batches)
    eager_losses = [eager_step(x, y) for x, y in data]
    model, opt = _build(kind, device, mesh)
    if segment:
        graphstep.eager_segment(getattr(model, "module", model).blocks[0])
    step = graphstep.capture(
        _step_fn(model, opt, device, micro_batches=micro_batches),
        model=model,
        optimizer=opt,
        config=graphstep.Config(backend=backend),
    )
    losses = [step(x, y) for x, y in data]
    report = _report(eager_model, model, eager_losses, losses, step)
    step.close()
    return report


def one_rank_changes(
    rank: int, size: int, *, change: str, steps: int = 12, max_recaptures: int = 4, max_graphs: int = 8
) -> dict:
    """After 6 steps, only rank 1 changes something: moves a parameter ("move"), calls with a new
    batch shape that must warm up first ("shape"), or advances a counter its step reads on every call
    until step 10 ("churn": two variants, then eager calls until it holds still). With `max_recaptures=0` a move puts
    both ranks past the limit: both run eagerly from then on; with `max_graphs=1` the new shape
    runs eagerly on rank 1 (and so on rank 0 too). Plain per-rank models, no collectives in the
    step, so the recording backend can stand in for graphs on CPU."""
    device = _device(rank)
    config = graphstep.Config(
        backend="recording" if device.type == "cpu" else "cuda",
        max_recaptures=max_recaptures,
        on_recapture_limit="eager",
        max_graphs=max_graphs,
        on_too_many_graphs="eager",
    )
    global SCALE_AT
    results = []
    for graphed in (False, True):
        model, opt = _build(None, device, sgd=device.type == "cpu")
        step = _step_fn(model, opt, device, scaled=change == "churn")
        if graphed:
            step = graphstep.capture(step, model=model, optimizer=opt, config=config)
        data = _data(None, rank, steps, device)
        small = _data(None, rank, steps, device, batch=2)
        losses = []
        for i, (x, y) in enumerate(data):
            if rank == 1 and i == 6 and change == "move":
                model.head.weight.data = model.head.weight.data.clone()
            if rank == 1 and i >= 6 and change == "shape":
                x, y = small[i]
            SCALE_AT = min(i, 10) - 5 if rank == 1 and i >= 6 and change == "churn" else 0
            losses.append(step(x, y))
        results.append((model, losses, step))
    (eager_model, eager_losses, _), (model, losses, step) = results
    report = _report(eager_model, model, eager_losses, losses, step)
    step.close()
    return report


def one_rank_syncs(rank: int, size: int) -> dict:
    """Only rank 1's step reads a value on the host: neither rank may capture."""
    device = _device(rank)
    config = graphstep.Config(backend="recording" if device.type == "cpu" else "cuda")
    model, opt = _build(None, device, sgd=device.type == "cpu")
    step = graphstep.capture(
        _step_fn(model, opt, device, sync_on=1), model=model, optimizer=opt, config=config
    )
    data = _data(None, rank, 6, device)
    errors = []
    for x, y in data:
        try:
            step(x, y)
        except HostSyncError as exc:
            errors.append(str(exc))
    report = {"errors": errors, "stats": dataclasses.asdict(step.stats)}
    step.close()
    return report


def destroy_with_open_step(rank: int, size: int, *, kind: str = "ddp") -> dict:
    """`destroy_process_group` while a captured step is alive: graphstep closes it first."""
    device = _device(rank)
    logging.getLogger("graphstep").setLevel(logging.ERROR)
    model, opt = _build(kind, device)
    step = graphstep.capture(_step_fn(model, opt, device), model=model, optimizer=opt)
    for x, y in _data(kind, rank, 14, device):
        step(x, y)
    graphs = step.stats.graphs_alive
    dist.destroy_process_group()
    try:
        step(x, y)
        closed = False
    except ClosedError:
        closed = True
    return {"graphs_before": graphs, "closed_after": closed}


def leave_step_open(rank: int, size: int, *, kind: str = "ddp") -> dict:
    """Return with a live captured step and the process group still up: exit must not hang."""
    device = _device(rank)
    model, opt = _build(kind, device)
    step = graphstep.capture(_step_fn(model, opt, device), model=model, optimizer=opt)
    for x, y in _data(kind, rank, 14, device):
        step(x, y)
    leave_step_open.kept = step  # alive until the interpreter exits
    return {"graphs": step.stats.graphs_alive}


def dtensor_shard_replaced(rank: int, size: int) -> dict:
    """A tensor-parallel parameter whose local shard is replaced between calls: the guard reads
    through the DTensor to its shard and captures again."""
    device = _device(rank)
    model, opt = _build("tp", device)
    step = graphstep.capture(_step_fn(model, opt, device), model=model, optimizer=opt)
    data = _data("tp", rank, 8, device)
    for i, (x, y) in enumerate(data):
        if i == 5:
            weight = model.blocks[0].fc.weight
            weight._local_tensor = weight._local_tensor.clone()
        step(x, y)
    report = {"stats": dataclasses.asdict(step.stats)}
    step.close()
    return report


def nccl_graph_registration(rank: int, size: int) -> str | None:
    """What importing graphstep made of the environment the test gave this rank."""
    import os

    return os.environ.get("NCCL_GRAPH_REGISTER")


def dtensor_grad_references(rank: int, size: int) -> dict:
    """The optimizer watch's search for state that keeps a gradient by reference, on tensor-parallel
    parameters: a DTensor has no storage of its own (its local shard has)."""
    device = _device(rank)
    model, opt = _build("tp", device)
    x, y = _data("tp", rank, 1, device)[0]
    model(x, y).backward()
    opt.step()
    before = grad_references(opt)
    weight = model.blocks[0].fc.weight
    opt.state[weight]["last_grad"] = weight.grad  # what timm's Mars keeps
    return {"before": before, "after": grad_references(opt), "dtensor": type(weight.grad).__name__}


# -- failures and mismatches (CPU, 4 ranks): every rank raises, none hangs -----------------------


def _mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)


def _ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP, on CUDA constructed on graphstep's capture stream (see bench/parallel.py)."""
    if device.type != "cuda":
        return torch.nn.parallel.DistributedDataParallel(model)
    stream = graphstep.capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    torch.cuda.current_stream(device).wait_stream(stream)
    return ddp


def _mlp_data(n: int, device: torch.device) -> list:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [
        (torch.randn(4, 8, generator=g).to(device), torch.randn(4, 1, generator=g).to(device))
        for _ in range(n)
    ]


def _calls_until_error(step, data: list, before_call=None, *, go_on: bool = False) -> dict:
    """Call `step` on each batch until one raises; the errors of every rank are compared. With
    `go_on`, a rank catches its first error and calls on (as a loop skipping a batch after an
    out-of-memory would), to the end of the data or another error: `then` is what its next call
    did, `later` a later call's error."""
    report: dict = {"call": None, "error": None, "message": ""}
    for i, (x, y) in enumerate(data):
        if before_call is not None:
            before_call(i)
        try:
            step(x, y)
        except Exception as exc:
            if report["error"] is None:
                report.update(call=i, error=type(exc).__name__, message=str(exc))
                if go_on:
                    continue
                break
            error = {"call": i, "error": type(exc).__name__, "message": str(exc)}
            report["then" if "then" not in report else "later"] = error
            break
        if report["error"] is not None and "then" not in report:
            report["then"] = {"call": i, "error": None}
    report["stats"] = step.stats
    return report


def _finish(report: dict, step) -> dict:
    report["stats"] = dataclasses.asdict(report["stats"])
    step.close()
    return report


def one_rank_raises(
    rank: int, size: int, *, failing: int, call: int, where: str, go_on: str = "failing", twin: bool = False
) -> dict:
    """A DDP step whose `call`-th run of the step function (1-based: warm-ups, then the capture,
    then replays) raises on rank `failing`, `where` = "before" its backward (the others are about
    to all-reduce gradients with it) or "after" it (the others finish their step). After its
    error, the failing rank calls once more (`go_on="failing"`), or every rank calls on ("all").
    With `twin`, an eager DDP twin trains on every batch whose call did not raise: `params_equal`."""
    device = _device(rank)
    model = _ddp(_mlp(device), device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    runs = iter(range(1, 1000))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fails = rank == failing and next(runs) == call
        if fails and where == "before":
            raise RuntimeError(f"boom before backward on rank {rank}")
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if fails and where == "after":
            raise RuntimeError(f"boom after backward on rank {rank}")
        opt.step()
        opt.zero_grad()
        return loss.detach()

    captured = graphstep.capture(step, model=model, optimizer=opt)
    data = _mlp_data(call + 3, device)
    going_on = go_on == "all" or rank == failing
    if not twin:
        return _finish(_calls_until_error(captured, data, go_on=going_on), captured)
    eager_model = _ddp(_mlp(device), device)
    eager = _plain_step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.05))

    class Both:
        stats = property(lambda self: captured.stats)

        def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            captured(x, y)  # raises on every rank in the same call, or on none: the twin skips it too
            eager(x, y)

    report = _calls_until_error(Both(), data, go_on=going_on)
    report["params_equal"] = all(
        torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters(), strict=True)
    )
    return _finish(report, captured)


def one_more_collective(rank: int, size: int, *, extra_on: int, when: str, graphs: str) -> dict:
    """Gradients all-reduced by hand; rank `extra_on` all-reduces one tensor more, on every call
    (`when="always"`: found at the first warm-up) or only while capturing ("capture"). `graphs`:
    the backend: "recording" or "eager" on CPU, "cuda"."""
    device = _device(rank)
    model = _mlp(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = graphstep.Config(backend=graphs)
    runs = iter(range(1, 1000))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        capturing = next(runs) == config.warmup_steps + 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if rank == extra_on and (when == "always" or capturing):
            dist.all_reduce(torch.ones(1, device=device))  # the branch only one rank takes
        opt.step()
        opt.zero_grad()
        return loss.detach()

    captured = graphstep.capture(step, model=model, optimizer=opt, config=config)
    data = _mlp_data(6, device)
    return _finish(_calls_until_error(captured, data), captured)


def one_rank_exits(rank: int, size: int, *, leaving: int, after: int) -> dict:
    """Rank `leaving` ends its process after `after` calls; the others must not wait for it."""
    import os

    def before_call(i: int) -> None:
        if rank == leaving and i == after:
            os._exit(3)  # gone, as a process killed for memory would be

    return _mlp_calls(rank, after + 3, before_call)


def one_rank_is_late(rank: int, size: int, *, late: int, after: int, sleep: float) -> dict:
    """Rank `late` sleeps `sleep` seconds before call `after`: past GRAPHSTEP_VOTE_TIMEOUT the
    others stop waiting; then the late one finds them gone."""
    import time

    def before_call(i: int) -> None:
        if rank == late and i == after:
            time.sleep(sleep)

    return _mlp_calls(rank, after + 3, before_call)


def _mlp_calls(rank: int, calls: int, before_call) -> dict:
    """The plain MLP step on the recording backend, `calls` times, `before_call(i)` before each."""
    device = _device(rank)
    model = _mlp(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = graphstep.capture(
        _plain_step(model, opt), model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    return _finish(_calls_until_error(step, _mlp_data(calls, device), before_call), step)


def _plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def agree_at_random(rank: int, size: int, *, calls: int = 300) -> list:
    """Each rank votes a random phase and limit (all ranks can compute everyone's from the seed):
    what `Ranks.agree` returned, with what it should have."""
    import random

    from graphstep.distributed.ranks import Agreement, Phase, Ranks

    ranks = Ranks(dist.group.WORLD)
    wrong = []
    for call in range(calls):
        votes = [
            random.Random(call * 1000 + r).choice([(p, lim) for p in Phase for lim in (0, 1)])
            for r in range(size)
        ]
        lowest = min(p for p, _ in votes)
        held = max((r for r, (p, _) in enumerate(votes) if p < Phase.REPLAY), default=None)
        capped = max((r for r, (_, lim) in enumerate(votes) if lim), default=None)
        expected = Agreement(lowest, held, capped)
        got = ranks.agree(votes[rank][0], bool(votes[rank][1]))
        if got != expected:
            wrong.append((call, got, expected))
    return [ranks.board.name, wrong[:3]]
