"""`Ranks`: the ranks of a process group agree, call by call, on the phase they act on together.

A captured step holds collectives (DDP's all-reduce, FSDP2's all-gather and reduce-scatter,
tensor parallelism's all-reduce). If one rank replayed its graph while another ran the step
eagerly, or captured a different graph, their collectives would pair up wrongly and hang or
mix data. So before every call each rank says how far it is (`Phase`), and all ranks act on the
least advanced answer (`Ranks.agree`). The vote is one element-wise maximum of four integers
(`vote.py`): through shared memory when every rank is on one host, a gloo all-reduce otherwise;
on the host either way, so the GPU is never waited for.

The same vote carries "my previous call failed": a rank whose call raised (after the vote, in
a replay, or before it) makes every rank raise at its next call instead of some replaying into
collectives it will never join. Calls that run the step eagerly or capture it go collective by
collective together and agree at the end that every rank's step succeeded (`collectives.py`);
before any rank replays a new graph, all agree that every capture succeeded. When a capture stopped
because some rank ran out of memory, every rank (told so by that same vote) runs the call as an eager
step instead, together, and captures on the next, as one process does.

Also here: the NCCL setting that graphs with expandable segments need, the warm-up count DDP
needs, and closing steps before `destroy_process_group` (a live graph holding NCCL work makes
it hang).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ..errors import GraphStepError, RankFailedError
from . import vote
from .collectives import (
    ERROR,
    KINDS,
    OUT_OF_MEMORY,
    Together,
    describe_error,
    failure_code,
    is_agreed,
    mark_agreed,
    mark_reported,
    raised_from,
)

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
    """The ranks that run a step together: the vote before each call, and calls run together."""

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
        self.board = vote.open_board(self.vote_group)
        self._failure: tuple[int, str] | None = None
        """This rank's last failed call that the other ranks do not know of: (code, text)."""
        self._together: Together | None = None
        self._modules: Iterable[nn.Module] = ()
        """The modules of the call in `together` (its DDP modules are made usable again after a stop)."""
        self.ddp_rebuilding = 0
        """Eager calls still to come before a capture: after a reset, DDP rebuilds its buckets in the
        second call's forward (`recover_ddp`). The same on every rank: all reset in the same call."""
        self.ddp_resets = 0
        """How many times DDP was reset (`recover_ddp`): a graph captured before the last reset copies
        gradients into buckets DDP has since replaced (their memory free for other tensors), so it is
        captured again instead of replayed (lifecycle.py). The same on every rank."""
        self.pipelined = False
        """Some rank sent or received point to point in an earlier call: no collective-by-collective
        votes (`p2p.py`). The same on every rank (they learn it from the same vote)."""

    def agree(self, phase: Phase, limited: bool, name: str = "the step") -> Agreement:
        """Every rank calls this with its own answers; all get the same result, or all raise
        `RankFailedError` when some rank's previous call failed."""
        mine = self.rank + 1
        failure, self._failure = self._failure, None
        failed = (self.board.size - self.rank) * KINDS + failure[0] if failure else 0
        # One maximum carries it all: the lowest phase as (REPLAY - phase), a rank (rank + 1; 0
        # for none) holding back, one at its re-capture limit, and the lowest rank that failed.
        lowest, held, capped, failed = self.board.max(
            [Phase.REPLAY - phase, mine if phase < Phase.REPLAY else 0, mine if limited else 0, failed]
        )
        if failed:
            raise self._refusal(name, self.board.size - failed // KINDS, failure)
        return Agreement(Phase(Phase.REPLAY - lowest), *(r - 1 if r else None for r in (held, capped)))

    def _refusal(self, name: str, rank: int, failure: tuple[int, str] | None) -> RankFailedError:
        text = self.board.gather_text(failure[1] if failure else "")[rank]
        whose = "this rank's" if rank == self.rank else f"rank {rank}'s"
        error = RankFailedError(
            f"{whose} previous call of {name} failed ({text or 'see its log'}), while other ranks went on. "
            "Ranks step together, so every rank refuses this call instead of replaying into collectives "
            "that rank never joined. The ranks' training state may differ now: restore a checkpoint on "
            "every rank before going on."
        )
        mark_agreed(error)
        return error

    @contextlib.contextmanager
    def together(self, name: str, agreed: Agreement, modules: Iterable[nn.Module] = ()) -> Iterator[Together]:
        """Around a call that runs the step eagerly or captures it, on every rank (the agreement
        decides, so all ranks enter it in the same call): collectives checked before they are
        issued, and at the end, every rank's step agreed to have succeeded (else all raise, and
        the DDP modules among `modules` are made usable again)."""
        capturing = agreed.phase is Phase.CAPTURE and agreed.limited_by is None
        together = self._together = Together(self.board, name, capturing=capturing, pipelined=self.pipelined)
        self._modules = modules
        try:
            with together:
                yield together
        except BaseException as exc:
            together.end(exc)
            if is_agreed(exc):  # every rank stopped this call: every rank recovers, at once
                self._recover(modules, after_capture=together.capturing)
            raise
        finally:
            self._together, self._modules = None, ()
            self.pipelined = self.pipelined or together.switched
        error = together.end(None)
        self.pipelined = self.pipelined or together.switched  # (its end may have been told so)
        if error is not None:
            raise error
        self.ddp_rebuilding = max(0, self.ddp_rebuilding - 1)

    def capture_failure(self, name: str, error: BaseException | None) -> BaseException | None:
        """After a capture, before any replay: the error this rank raises because another rank's
        capture failed or captured other collectives; None when all succeeded (or when `error`,
        this rank's own, stands). A rank that replayed a graph while another had none, or a
        different one, would wait in a collective forever."""
        together = self._together or Together(self.board, name, capturing=True, watch=False)
        return together.end(error)

    def out_of_memory_at_capture(self) -> int | None:
        """After `capture_failure`: the rank whose running out of memory stopped this call's capture
        on every rank (the lowest rank that failed, as every rank was told), else None."""
        together = self._together
        failed = together.failed if together is not None else None
        return failed[0] if failed is not None and failed[1] == OUT_OF_MEMORY else None

    def step_eagerly_instead(self) -> None:
        """Every rank runs the call whose capture they stopped eagerly instead (`out_of_memory_at_capture`)."""
        capturing = self._together is not None and self._together.capturing
        if self._together is not None:
            self._together.again_eagerly()
        self._recover(self._modules, after_capture=capturing)

    def _recover(self, modules: Iterable[nn.Module], *, after_capture: bool) -> None:
        """A rank stopped inside its backward: DDP expects the rest of it; or inside a forward: FSDP2 too."""
        if recover_ddp(modules):
            self.ddp_rebuilding = 2
            self.ddp_resets += 1
        recover_fsdp(modules, after_capture=after_capture)

    def relayed(self, error: BaseException) -> bool:
        """Whether `error` is (or was raised from) the error this call's checked collectives raised because
        of another rank, rather than this rank's own. (Not `is_agreed`: this rank's own error is marked
        agreed too, once every rank knows of it.)"""
        stopped = self._together.error if self._together is not None else None
        return stopped is not None and any(e is stopped for e in raised_from(error))

    def gather_text(self, text: str) -> list[str]:
        """Every rank's `text`, by rank (every rank calls it in the same call; a rare path: explaining a
        failure, agreeing on graph breaks). Inside a call run together, not taken for the step's own."""
        together = self._together
        return together.gather_text(text) if together is not None else self.board.gather_text(text)

    def note_failure(self, error: BaseException) -> None:
        """A call raised `error` on this rank; unless every rank raised with it, the next vote
        tells the others."""
        if not is_agreed(error):
            self._failure = (failure_code(error) or ERROR, describe_error(error))
        mark_reported(error)


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
    ddp = ddp_modules(modules)
    for m in ddp:
        m._set_ddp_runtime_logging_sample_rate(2**31 - 1)
    return bool(ddp)


def fsdp_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules FSDP2 wraps (`fully_shard`) among `modules` and their submodules."""
    return [m for root in modules for m in root.modules() if hasattr(m, "_get_fsdp_state")]


def ddp_modules(modules: Iterable[nn.Module]) -> list[nn.parallel.DistributedDataParallel]:
    """The DDP modules among `modules` and their submodules."""
    ddp = nn.parallel.DistributedDataParallel
    return [m for root in modules for m in root.modules() if isinstance(m, ddp)]


def recover_ddp(modules: Iterable[nn.Module]) -> bool:
    """After the ranks stopped a call together: make DDP usable again on every rank; whether any
    DDP module was reset.

    A rank that stopped inside its backward (before a gradient all-reduce whose peer failed)
    leaves DDP's reducer expecting the rest of that backward: its next forward would fail
    ("Expected to have finished reduction in the prior iteration"). The reset is DDP's own, as
    when its process group changes: the buckets are rebuilt from the order in which the next
    backward readies the gradients, in the forward after it (a broadcast and a host read, which
    a capture cannot hold: `Ranks.ddp_rebuilding`). That order is the one eager DDP's first
    iteration saw; any other bucket layout sums each gradient over three or more ranks in
    another order (NCCL's ring splits a bucket by position), and differs in the last bits.
    """
    reset = False
    for m in ddp_modules(modules):
        try:
            m.reducer._reset_state()
        except (AttributeError, RuntimeError) as exc:  # private API of DDP's reducer
            log.warning("graphstep: could not reset DDP after the failed call (%s): recreate it", exc)
            continue
        m._has_rebuilt_buckets = False
        reset = True
    return reset


def recover_fsdp(modules: Iterable[nn.Module], *, after_capture: bool) -> None:
    """After the ranks stopped a call together: make FSDP2 usable again on every rank.

    A rank stopped inside a forward or a backward leaves FSDP2's per-iteration state half way: the
    forward root still claimed, parameter groups unsharded and in their forward state. The next forward
    would then skip the root's set-up and all-gathers, and use the sharded parameters ("mixed
    torch.Tensor and DTensor"). `FSDPModule.reset_iter_state` (torch >= 2.13) resets it, waiting on
    FSDP2's in-flight events; after a stopped CUDA capture those events were recorded in the capture
    (no stream outside it may wait on them, and the capture ran nothing), so the state is reset without
    waiting (`after_capture`), as on older torch.
    """
    roots = [m for m in fsdp_modules(modules) if getattr(m._get_fsdp_state(), "_is_root", False)]
    for root in roots:
        try:
            if hasattr(root, "reset_iter_state") and not after_capture:
                root.reset_iter_state()
            else:
                _reset_fsdp_without_waiting(root._get_fsdp_state())
        except (AttributeError, RuntimeError) as exc:  # private API of FSDP2 on older torch
            log.warning("graphstep: could not reset FSDP2 after the failed call (%s): recreate it", exc)


def _param_groups(state: object) -> list:
    """An FSDP2 state's parameter groups: a list on newer torch, one group or None up to torch 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _reset_fsdp_without_waiting(state: object) -> None:
    """FSDP2's per-iteration state back to idle, parameters sharded; nothing in flight is waited for."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    context, comm = state._state_ctx, state._comm_ctx
    comm.all_gather_state = None
    for attr in ("reduce_scatter_states", "post_forward_order", "_last_post_reduce_events"):
        getattr(comm, attr, []).clear()
    dropped = (
        "_all_gather_result",
        "_post_reduce_event",
        "_reshard_after_forward_event",
        "_all_reduce_state",
    )
    for s in getattr(context, "all_states", [state]):
        getattr(s, "_modules_to_run_forward", set()).clear()
        s._training_state = TrainingState.IDLE
        for group in _param_groups(s):
            for attr in (a for a in dropped if hasattr(group, a)):
                setattr(group, attr, None)
            getattr(group, "_post_forward_indices", []).clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    context.iter_forward_root = None
    context.post_backward_final_callback_queued = False


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
