"""Per-rank bodies of the distributed tests of failures under DDP: out of memory at capture on one rank,
a rank that exits mid-run (CPU over gloo with the eager backend; GPU over NCCL with graphs). Run by
`ranks.run_ranks`, like those of dist_workers.py, whose pieces they share."""

from __future__ import annotations

import dataclasses

import torch

import graphstep
from dist_workers import _ddp, _device, _finish, _mlp, _mlp_data, _plain_step


def _twins(device: torch.device) -> list:
    """Two identical MLPs with SGD, the eager one and graphstep's: under DDP on CUDA; on CPU plain, with
    no collective in the step (the recording backend stands in for graphs there, and replays no
    collective); the ranks still vote before every call and agree on every capture."""
    pairs = []
    for _ in range(2):
        model = _ddp(_mlp(device), device) if device.type == "cuda" else _mlp(device)
        pairs.append((model, torch.optim.SGD(model.parameters(), lr=0.05)))
    return pairs


def one_rank_out_of_memory_at_capture(rank: int, size: int, *, failing: int, captures: int = 1) -> dict:
    """Rank `failing` runs out of memory in the forward of its first `captures` captures (on CUDA for
    real: it allocates twice the device while its stream captures; on CPU, with the recording backend,
    torch's error is raised at the forward a capture makes). Every rank must run that call eagerly,
    together, and capture on the next (twice in a row: every rank raises a CaptureError in the same
    call). Compared with eager; `warmups` is how many warm-ups precede the first capture."""
    import itertools

    device = _device(rank)
    torch.use_deterministic_algorithms(True)
    (m_e, o_e), (m_g, o_g) = _twins(device)
    cuda = device.type == "cuda"
    warmups = distributed_warmups() if cuda else graphstep.Config().warmup_steps
    forwards = itertools.count()  # advanced by a call: not a Python write the capture would refuse
    capturing_forwards = itertools.count()
    # On CPU, the forwards the captures make: after the warm-ups, every other one (each failed
    # capture's eager step follows it).
    capture_forwards = {warmups + 2 * k for k in range(captures)}

    def too_big_while_capturing(module, inputs, output):
        n = next(forwards)
        if rank != failing:
            return
        if cuda:
            if torch.cuda.is_current_stream_capturing() and next(capturing_forwards) < captures:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.empty(2 * total, dtype=torch.uint8, device=device)
        elif n in capture_forwards:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")

    getattr(m_g, "module", m_g)[0].register_forward_hook(too_big_while_capturing)
    config = graphstep.Config(backend="cuda" if cuda else "recording")
    step = graphstep.capture(_plain_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    eager = _plain_step(m_e, o_e)
    losses_equal, errors, params_differ_from = True, [], None
    for i, (x, y) in enumerate(_mlp_data(warmups + 6, device)):
        want = eager(x, y)
        try:
            got = step(x, y)
        except Exception as exc:  # nothing of the call is left: the same batch again (it captures)
            errors.append({"call": i, "error": type(exc).__name__, "message": str(exc)})
            got = step(x, y)
        losses_equal = losses_equal and torch.equal(want, got)
        # A last-bit difference in a weight can vanish in the loss: the parameters after every call
        if params_differ_from is None and not _same_params(m_e, m_g):
            params_differ_from = i
    report = {
        "losses_equal": losses_equal,
        "params_equal": params_differ_from is None,
        "params_differ_from_call": params_differ_from,
        "errors": errors,
        "backend": step.backend_name,
        "warmups": warmups,
    }
    return _finish({**report, "stats": step.stats}, step)


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def distributed_warmups() -> int:
    return graphstep.distributed.DDP_WARMUP_STEPS


def one_rank_exits_mid_run(rank: int, size: int, *, leaving: int, at: str) -> dict:
    """Rank `leaving` ends its process (as one killed for memory would) in the middle of a warm-up's
    step (`at="warmup"`, before its backward: the others are about to all-reduce with it), of the
    capture's (`"capture"`), or between two replays (`"replay"`). The others must raise within seconds,
    not wait in a collective forever: `waited_s` is how long the failing call took."""
    import os
    import time

    device = _device(rank)
    model = _ddp(_mlp(device), device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    warmups = distributed_warmups()
    exit_run = {"warmup": 3, "capture": warmups + 1}.get(at)  # the step function's run (1-based)
    runs = iter(range(1, 1000))

    def leave() -> None:
        # The NCCL work of its earlier calls ends first (so the others' ends too); a capture began with
        # the device synchronised, and may not synchronise itself.
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(device)
        os._exit(3)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if rank == leaving and next(runs) == exit_run:
            leave()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    captured = graphstep.capture(step, model=model, optimizer=opt)
    report: dict = {"call": None, "error": None, "message": "", "waited_s": None}
    for i, (x, y) in enumerate(_mlp_data(warmups + 5, device)):
        if rank == leaving and at == "replay" and i == warmups + 3:
            leave()
        start = time.monotonic()
        try:
            captured(x, y)
        except Exception as exc:
            report.update(
                call=i, error=type(exc).__name__, message=str(exc), waited_s=time.monotonic() - start
            )
            break
    report["stats"] = dataclasses.asdict(captured.stats)
    # No close() nor destroy_process_group: NCCL's teardown waits for every rank, and one is gone.
    return report


def graphs_after_a_ddp_reset(rank: int, size: int, *, failing: int) -> dict:
    """Two signatures of one DDP step (batches of 4 and of 2 rows). The first is captured and replayed;
    then the second's capture raises on rank `failing` before its backward, so every rank stops that
    call and DDP is reset and rebuilds its gradient buckets. The first signature's graph copies gradients
    into the buckets DDP had before: the next call of it must capture again, not replay. Compared with
    an eager DDP twin on every call that did not raise (`params_equal`)."""
    device = _device(rank)
    warmups = distributed_warmups()  # DDP's, on every device
    (m_e, o_e), (m_g, o_g) = [
        (m := _ddp(_mlp(device), device), torch.optim.SGD(m.parameters(), lr=0.05)) for _ in range(2)
    ]
    small_runs = iter(range(1, 1000))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2 and next(small_runs) == warmups + 1 and rank == failing:
            raise RuntimeError(f"boom before backward on rank {rank}")
        loss = torch.nn.functional.mse_loss(m_g(x), y)
        loss.backward()
        o_g.step()
        o_g.zero_grad()
        return loss.detach()

    captured = graphstep.capture(step, model=m_g, optimizer=o_g)
    eager = _plain_step(m_e, o_e)
    big = _mlp_data(warmups + 3, device)
    small = [(x[:2], y[:2]) for x, y in _mlp_data(warmups + 4, device)]
    calls = big + small + big[:2]
    errors, losses_equal, captures_before_last = [], True, None
    for i, (x, y) in enumerate(calls):
        if i == len(calls) - 2:
            captures_before_last = captured.stats.captures
        try:
            got = captured(x, y)
        except Exception as exc:  # every rank stops this call: the twin skips its batch too
            errors.append({"call": i, "error": type(exc).__name__})
            continue
        losses_equal = losses_equal and torch.equal(got, eager(x, y))
    report = {
        "errors": errors,
        "losses_equal": losses_equal,
        "params_equal": _same_params(m_e, m_g),
        "captures_before_last": captures_before_last,
        "first_small_call": len(big),
        "warmups": warmups,
        "stats": captured.stats,
    }
    return _finish(report, captured)
