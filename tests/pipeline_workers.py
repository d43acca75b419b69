"""Per-rank bodies of the pipeline-parallel tests (CPU over gloo, GPU over NCCL), run by `ranks.run_ranks`."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import graphstep

WIDTH = 16


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _stage_module(index: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(100 + index)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()).to(device)


def _wrap(module: torch.nn.Module, dp: str | None, mesh, device) -> torch.nn.Module:
    if dp == "ddp":
        kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
        if device.type == "cuda":
            stream = graphstep.capture_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                wrapped = torch.nn.parallel.DistributedDataParallel(
                    module, process_group=mesh["dp"].get_group(), **kwargs
                )
            torch.cuda.current_stream(device).wait_stream(stream)
            return wrapped
        return torch.nn.parallel.DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    if dp == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module, mesh=mesh["dp"])
    if dp == "replicate":  # DDP's semantics on FSDP2's machinery: what torchtitan pairs with pipelining
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(module, mesh=mesh["dp"])
    return module


def _build(schedule: str, rank: int, size: int, device, micro: int, dp: str | None = None, mesh=None):
    group = None
    if mesh is not None:
        group, rank, size = mesh["pp"].get_group(), mesh["pp"].get_local_rank(), mesh["pp"].size()
    per_rank = 2 if schedule == "interleaved" else 1
    n_stages = size * per_rank
    indices = [rank + k * size for k in range(per_rank)]
    mods = [_wrap(_stage_module(i, device), dp, mesh, device) for i in indices]
    stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(mods, indices)]
    loss_fn = torch.nn.functional.mse_loss
    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], micro, loss_fn=loss_fn)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], micro, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    first = 0 in indices
    last = n_stages - 1 in indices
    return mods, sched, opt, first, last


def _step_fn(sched, opt, first, last, device):
    def step(x, y):
        losses = []
        if first and last:
            sched.step(x, target=y, losses=losses)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).sum() if last else torch.zeros((), device=device)

    return step


def _data(n: int, device, batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, WIDTH, generator=g).to(device), torch.randn(batch, WIDTH, generator=g).to(device))
        for _ in range(n)
    ]


def train_pipeline(
    rank: int,
    size: int,
    *,
    schedule: str,
    steps: int = 8,
    micro: int = 4,
    graphs: str = "auto",
    dp: str | None = None,
) -> dict:
    device = _device(rank)
    torch.use_deterministic_algorithms(True)
    mesh = None
    if dp is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (2, size // 2), mesh_dim_names=("dp", "pp"))
    data = _data(steps, device, seed=0 if mesh is None else mesh["dp"].get_local_rank())
    runs = []
    for graphed in (False, True):
        mods, sched, opt, first, last = _build(schedule, rank, size, device, micro, dp, mesh)
        graphstep.optim.make_capturable(opt, device.type)  # what graphstep does to its own
        step = _step_fn(sched, opt, first, last, device)
        if graphed:
            step = graphstep.capture(step, model=mods, optimizer=opt, config=graphstep.Config(backend=graphs))
        losses = [step(x, y) for x, y in data]
        runs.append((mods, losses, step))
    return _compared(runs)


def outer_losses_list(rank: int, size: int, *, steps: int = 5, graphs: str = "recording") -> dict:
    """The schedule fills a `losses` list the caller made outside the step: refused at capture (a replay
    would leave the capture's tensors in it), every rank told in the same call."""
    device = _device(rank)
    mods, sched, opt, first, _ = _build("gpipe", rank, size, device, 4)
    kept: list = []

    def step(x, y):
        if first:
            sched.step(x)
        else:
            sched.step(target=y, losses=kept)
        opt.step()
        opt.zero_grad()

    captured = graphstep.capture(step, model=mods, optimizer=opt, config=graphstep.Config(backend=graphs))
    report: dict = {"error": None, "message": "", "call": None}
    for i, (x, y) in enumerate(_data(steps, device)):
        try:
            captured(x, y)
        except Exception as exc:
            report.update(error=type(exc).__name__, message=str(exc), call=i)
            break
    report["stats"] = dataclasses.asdict(captured.stats)
    captured.close()
    return report


def train_gpt_pipeline(
    rank: int,
    size: int,
    *,
    schedule: str,
    steps: int = 8,
    micro: int = 4,
    graphs: str = "auto",
    dp: str | None = None,
    amp: bool = False,
) -> dict:
    """The demo GPT split into stages (graphstep.bench.pipeline, as the benchmark runs it), eager and
    through graphstep, compared bitwise. `dp`: FSDP2 ("fsdp") or replicate on each stage over a 2-D
    (dp, pp) mesh of `size` ranks."""
    from graphstep.bench.pipeline import pipelined_gpt
    from graphstep.demo.gpt import GPT, GPTConfig, make_batches

    cfg = GPTConfig(vocab_size=128, seq_len=16, n_layer=2 * size, n_head=2, n_embd=32)  # a block per stage
    device = _device(rank)
    torch.use_deterministic_algorithms(True)
    mesh, group, pp_rank, pp_size, seed = None, None, rank, size, 0
    if dp is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (2, size // 2), mesh_dim_names=("dp", "pp"))
        group, pp_rank, pp_size = mesh["pp"].get_group(), mesh["pp"].get_local_rank(), mesh["pp"].size()
        seed = mesh["dp"].get_local_rank()
    data = make_batches(cfg, batch_size=8, n_batches=steps, seed=seed, device=device.type)
    torch.manual_seed(0)
    base = GPT(cfg)
    runs = []
    for graphed in (False, True):
        part = pipelined_gpt(
            base,
            schedule,
            pp_rank,
            pp_size,
            device,
            micro_batches=micro,
            group=group,
            wrap=(lambda m: _wrap(m, dp, mesh, device)) if dp is not None else None,
            amp=amp,
            # SGD on CPU: AdamW's step reads the host there, which the recording backend refuses
            optimizer=(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
            if device.type == "cpu"
            else None,
        )
        graphstep.optim.make_capturable(part.optimizer, device.type)
        step = part.step
        if graphed:
            config = graphstep.Config(backend=graphs)
            step = graphstep.capture(step, model=part.modules, optimizer=part.optimizer, config=config)
        losses = [step(x, y) for x, y in data]
        runs.append((part.modules, losses, step))
    return _compared(runs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def eval_between_steps(
    rank: int, size: int, *, steps: int = 8, at: int = 5, move_at: int | None = None
) -> dict:
    """`schedule.eval(...)` between two training calls (after the capture): the schedule initialises its
    stages again in the next training call (a host exchange of shapes)."""
    device = _device(rank)
    results = []
    for graphed in (False, True):
        mods, sched, opt, first, last = _build("gpipe", rank, size, device, 4)
        graphstep.optim.make_capturable(opt, device.type)
        step = _step_fn(sched, opt, first, last, device)
        if graphed:
            config = graphstep.Config(backend="cuda" if device.type == "cuda" else "recording")
            step = graphstep.capture(step, model=mods, optimizer=opt, config=config)
        losses, errors = [], []
        for i, (x, y) in enumerate(_data(steps, device)):
            if i == move_at:  # a parameter moved: the next call captures again
                weight = mods[0][0].weight
                weight.data = weight.data.clone()
            if i == at:
                with torch.no_grad():
                    sched.eval(*((x,) if first else ()), **({"target": y, "losses": []} if last else {}))
            try:
                losses.append(step(x, y))
            except Exception as exc:
                errors.append(f"{i}: {type(exc).__name__}: {exc}"[:1500])
                break
        results.append((mods, losses, step, errors))
    (em, el, _, _), (gm, gl, step, errors) = results
    report = {
        "errors": errors,
        "losses_equal": len(el) == len(gl) and all(torch.equal(a, b) for a, b in zip(el, gl)),
        "params_equal": all(
            torch.equal(a, b) for ma, mb in zip(em, gm) for a, b in zip(ma.parameters(), mb.parameters())
        ),
        "stats": dataclasses.asdict(step.stats),
    }
    step.close()
    return report


def p2p_differs_at_capture(rank: int, size: int) -> dict:
    """Rank 0 sends four float32 numbers to rank 1 on every call; while capturing, rank 1 receives them
    as int32 (a branch only it takes, same bytes: nothing fails on the wire). The ranks compare at the
    end of the capture and every rank refuses it."""
    device = _device(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = graphstep.Config(backend="cuda" if device.type == "cuda" else "recording")
    runs = iter(range(1, 1000))

    def step(x: torch.Tensor) -> torch.Tensor:
        capturing = next(runs) == config.warmup_steps + 1
        out = model(x)
        if rank == 0:
            dist.send(out.detach().sum(0), dst=1)
        else:
            got = torch.empty(4, device=device, dtype=torch.int32 if capturing else torch.float32)
            dist.recv(got, src=0)
            out = out + got.float().sum() * 0
        loss = out.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    captured = graphstep.capture(step, model=model, optimizer=opt, config=config)
    report: dict = {"error": None, "message": "", "call": None}
    for i in range(config.warmup_steps + 3):
        try:
            captured(torch.ones(2, 4, device=device) * i)
        except Exception as exc:
            report.update(error=type(exc).__name__, message=str(exc), call=i)
            break
    report["stats"] = dataclasses.asdict(captured.stats)
    captured.close()
    return report


def stage_fails_mid_step(rank: int, size: int, *, failing: int = 0, call: int = 1) -> dict:
    """Stage `failing` raises in its `call`-th step before sending its activations (0-based)."""
    import time

    device = _device(rank)
    mods, sched, opt, first, last = _build("gpipe", rank, size, device, 4)
    inner = _step_fn(sched, opt, first, last, device)
    runs = iter(range(1000))

    def step(x, y):
        if rank == failing and next(runs) == call:
            raise RuntimeError(f"boom on stage {rank}")
        return inner(x, y)

    config = graphstep.Config(backend="cuda" if device.type == "cuda" else "recording")
    captured = graphstep.capture(step, model=mods, optimizer=opt, config=config)
    report: dict = {"error": None, "message": "", "call": None}
    start = time.monotonic()
    for i, (x, y) in enumerate(_data(call + 2, device)):
        try:
            captured(x, y)
        except Exception as exc:
            report.update(error=type(exc).__name__, message=str(exc)[:600], call=i)
            break
    report["waited_s"] = round(time.monotonic() - start, 1)
    return report


def _compared(runs: list) -> dict:
    """The eager run against the captured one (each: modules, losses, step): losses and parameters
    bitwise, the captured step's counters; the captured step closed."""
    (em, el, _), (gm, gl, step) = runs
    report = {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(el, gl, strict=True)),
        "params_equal": all(
            torch.equal(_local(a), _local(b))
            for ma, mb in zip(em, gm)
            for a, b in zip(ma.parameters(), mb.parameters(), strict=True)
        ),
        "stats": dataclasses.asdict(step.stats),
        "backend": step.backend_name,
    }
    step.close()
    return report
