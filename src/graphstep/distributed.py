"""Distributed steps: the ranks of a process group warm up, capture and re-capture together.

A captured step holds collectives (DDP's all-reduce, FSDP2's all-gather and reduce-scatter,
tensor parallelism's all-reduce). If one rank replayed its graph while another ran the step
eagerly, or captured a different graph, their collectives would pair up wrongly and hang or
mix data. So before every call each rank says how far it is (`Phase`), and all ranks act on the least
advanced answer: one small all-reduce over a gloo group (on the host, so the GPU is never
waited for). After a capture, before any rank replays it, the ranks agree that every capture
succeeded.

Also here: the NCCL setting that graphs with expandable segments need, the warm-up count DDP
needs, and closing steps before `destroy_process_group` (a live graph holding NCCL work makes
it hang).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .errors import GraphStepError

log = logging.getLogger("graphstep")

DDP_WARMUP_STEPS = 11
"""PyTorch's CUDA graph notes ask for 11 eager DDP iterations before a capture: DDP records
timing events during its first 10 iterations, which a graph must not contain."""


class Phase(enum.IntEnum):
    """How far a rank is with the signature it was called with. Ranks act on the lowest."""

    EAGER = 0
    """This call runs eagerly somewhere: a warm-up, a signature without a graph, a fallback."""
    CAPTURE = 1
    """Ready to capture, or to re-capture because state the graph depends on changed."""
    REPLAY = 2


@dataclasses.dataclass(frozen=True)
class Agreement:
    phase: Phase
    """The lowest phase of any rank: what every rank does with this call."""
    held_back_by: int | None
    """A rank whose own phase is that lowest one (for messages), None when all replay."""
    limited_by: int | None
    """A rank whose re-capture would pass `Config.max_recaptures`: no rank captures; each runs
    this signature eagerly from then on (or raises `StaleGraphError`)."""


class Ranks:
    """The ranks that run a step together, and the vote before each call."""

    def __init__(self, group: object):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        if dist.get_backend(group) == "gloo":
            self.vote_group = group
        else:  # NCCL: vote over gloo among the same ranks, so no GPU stream is involved
            self.vote_group = dist.new_group(
                dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True
            )
        self._ballot = torch.zeros(3, dtype=torch.int64)

    def agree(self, phase: Phase, limited: bool) -> Agreement:
        """Every rank calls this with its own answers; all get the same result."""
        import torch.distributed as dist

        mine = self.rank + 1
        # One MAX-reduction carries it all: the lowest phase as (REPLAY - phase), and a rank
        # (rank + 1; 0 for none) holding back, and one at its re-capture limit.
        ballot = self._ballot
        ballot[0] = Phase.REPLAY - phase
        ballot[1] = mine if phase < Phase.REPLAY else 0
        ballot[2] = mine if limited else 0
        dist.all_reduce(ballot, op=dist.ReduceOp.MAX, group=self.vote_group)
        lowest, *ranks = ballot.tolist()
        return Agreement(Phase(Phase.REPLAY - lowest), *(r - 1 if r else None for r in ranks))

    def first_failure(self, failure: int) -> tuple[int, int] | None:
        """After a capture, before any replay: `(rank, failure)` of the lowest rank whose capture
        failed, or None. `failure`: 0 for success, else a small positive code of the error's kind.
        A rank that replayed a graph while another had none would wait in a collective forever."""
        import torch.distributed as dist

        size = dist.get_world_size(self.vote_group)
        flag = torch.tensor([(size - self.rank) * _KINDS + failure if failure else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.vote_group)
        worst = int(flag)
        return (size - worst // _KINDS, worst % _KINDS) if worst else None


_KINDS = 16  # failure codes carried by `Ranks.first_failure`, below this


def ranks_for(process_group: object | None) -> Ranks | None:
    """The ranks a step runs with: `process_group`, else every rank once torch.distributed is
    initialised with more than one; None for a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise GraphStepError(
                "capture(process_group=...) was given but torch.distributed is not initialised: "
                "call torch.distributed.init_process_group first."
            )
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) <= 1:
        return None
    return Ranks(group)


def prepare_ddp(modules: Iterable[nn.Module]) -> bool:
    """Whether any module is wrapped in DDP; if so, stop its periodic timing samples.

    Besides its first 10 iterations (covered by DDP_WARMUP_STEPS), DDP samples timings every
    100th iteration, and a re-capture could land on one: sample every 2**31 instead.
    """
    ddp = [
        m for root in modules for m in root.modules() if isinstance(m, nn.parallel.DistributedDataParallel)
    ]
    for m in ddp:
        m._set_ddp_runtime_logging_sample_rate(2**31 - 1)
    return bool(ddp)


# -- NCCL with expandable segments ---------------------------------------------------------------


def expandable_segments() -> bool:
    """Whether the CUDA allocator was configured with expandable segments."""
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    settings = dict(item.split(":", 1) for item in conf.replace(" ", "").split(",") if ":" in item)
    return settings.get("expandable_segments", "").lower() == "true"


def set_nccl_graph_registration() -> None:
    """Called at import: with expandable segments, NCCL's registration of graph buffers
    causes illegal memory accesses (pytorch/pytorch#158029). NCCL reads the variable when it
    first needs it, so setting it before any communicator exists turns it off."""
    if expandable_segments() and "NCCL_GRAPH_REGISTER" not in os.environ:
        os.environ["NCCL_GRAPH_REGISTER"] = "0"
        log.info("graphstep: expandable_segments is on, so NCCL_GRAPH_REGISTER=0 (pytorch/pytorch#158029)")


def check_nccl_graph_registration(group: object) -> None:
    """Before capturing NCCL collectives: refuse the combination that corrupts memory."""
    import torch.distributed as dist

    if "nccl" not in str(dist.get_backend(group)) or not expandable_segments():
        return
    if os.environ.get("NCCL_GRAPH_REGISTER") != "0":
        raise GraphStepError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True and NCCL_GRAPH_REGISTER is "
            f"{os.environ.get('NCCL_GRAPH_REGISTER')!r}: NCCL collectives captured in a CUDA graph then "
            "access freed memory (pytorch/pytorch#158029). Set NCCL_GRAPH_REGISTER=0 in the environment "
            "before the process starts, or turn expandable segments off."
        )


# -- teardown -------------------------------------------------------------------------------------


def close_before_destroy(close_steps: Callable[[object | None], None]) -> None:
    """Make `torch.distributed.destroy_process_group` close graphstep's steps on that group first.

    A CUDA graph holding NCCL work keeps the communicator busy: destroying the group while
    such a graph is alive hangs. `close_steps(group)` releases the graphs of the steps that
    run on `group` (every distributed step when `group` is None, the whole world).
    """
    if not torch.distributed.is_available():
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    if getattr(original, "_graphstep_closes_steps", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: object | None = None) -> None:
        close_steps(group)
        original(group)

    destroy_process_group._graphstep_closes_steps = True  # type: ignore[attr-defined]
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
