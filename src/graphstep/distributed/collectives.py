"""Ranks that run a step eagerly or capture it go collective by collective, together.

A collective that one rank issues and another does not never completes: the first rank waits
forever, or pairs it with the other's next collective and mixes their data. Two ways that
happens, and what graphstep does about them while a distributed step runs eagerly (warm-up)
or is captured:

- *One rank fails.* Its step raised (an error in the step, out of memory, a host sync during
  capture) before issuing a collective the others are about to issue.
- *The ranks' collectives differ.* A branch on the rank, a module wrapped differently on one
  rank, a library that takes another path on one rank while capturing: one rank issues one more
  collective, or another operation, group, dtype or shape. Replaying such graphs hangs or
  corrupts, and a CUDA capture executes nothing, so only a check at capture can catch it.

`Together` sees every collective the step issues (a dispatch mode: DDP's all-reduce from C++,
FSDP2's all-gathers and reduce-scatters, tensor parallelism's functional collectives) and,
*before* each is issued, the ranks vote: all about to issue the same collective (a digest of
its operation, group shape, dtypes and shapes) -> go on; any rank's step already ended or
failed, or a digest differs -> every rank stops here with the same error, naming the failed
rank or the first difference. When the step ends, one more vote agrees that every rank's step
succeeded. The check assumes SPMD steps (every rank issues the same collectives in the same
order), as DDP, FSDP2 and tensor parallelism do. A point-to-point operation (send, recv: pipeline
parallelism) is voted on like a collective the first time, and that vote tells every rank to stop
voting collective by collective, in this call and every later one: ranks then compare, at the end of
each call, what each process group's members and each pair of ranks exchanged (`p2p.py`).

A Python dispatch mode makes torch.compile skip compiling unless the mode declares that it
ignores compile internals (torch >= 2.9). On older torch the collectives are not watched, only
the end of the step is agreed.
"""

from __future__ import annotations

import contextlib
import hashlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..diagnostics import _describe, is_host_sync, is_out_of_memory, log, user_frame_of
from ..errors import CaptureError, CollectiveMismatchError, GraphStepError, HostSyncError, RankFailedError
from .p2p import P2P_OPS, CommLog, mismatch

WATCHABLE = "ignore_compile_internals" in vars(TorchDispatchMode)
"""Whether this torch lets a dispatch mode watch a step without turning torch.compile off."""

_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"})
_UNEVEN = frozenset({"alltoall_", "alltoall_base_", "all_to_all_single", "gather_", "scatter_"})
"""Collectives whose tensors may differ in size between ranks: only their dtypes are compared."""

_DIGEST_BITS = 39
_DIGEST_MASK = (1 << _DIGEST_BITS) - 1
KINDS = 16
"""Failure codes travel as (size - rank) * KINDS + code, so that MAX picks the lowest failed rank."""
ERROR, HOST_SYNC, OUT_OF_MEMORY, INTERRUPTED = 1, 2, 3, 4


def failure_code(error: BaseException | None) -> int:
    if error is None:
        return 0
    if isinstance(error, HostSyncError) or (isinstance(error, Exception) and is_host_sync(error)):
        return HOST_SYNC
    if is_out_of_memory(error):
        return OUT_OF_MEMORY
    if not isinstance(error, Exception):
        return INTERRUPTED
    return ERROR


def mark_agreed(error: BaseException) -> None:
    """Every rank knows about `error` and raises in this call too: no need to report it again."""
    with contextlib.suppress(AttributeError):
        error.__graphstep_agreed__ = True  # type: ignore[attr-defined]


def raised_from(error: BaseException | None) -> Iterator[BaseException]:
    """`error` and the errors it was raised from or while handling, in this call: the walk stops at an
    error an earlier call raised (`mark_reported`), which the step's caller is handling while it calls
    again, the context of that call's errors, not their cause."""
    for _ in range(8):
        if error is None or getattr(error, "__graphstep_reported__", False):
            return
        yield error
        error = error.__cause__ or error.__context__


def is_agreed(error: BaseException) -> bool:
    """Whether every rank raised `error` (or an error it was raised from, in this call)."""
    return any(getattr(e, "__graphstep_agreed__", False) for e in raised_from(error))


def mark_reported(error: BaseException) -> None:
    """`error` left a call of the step: the errors of later calls raised while it is handled are theirs."""
    with contextlib.suppress(AttributeError):
        error.__graphstep_reported__ = True  # type: ignore[attr-defined]


def describe_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) < 600 else text[:600] + " ..."


class _Watch(TorchDispatchMode):
    """Hands every collective to `Together.before_collective` before it is issued."""

    supports_higher_order_operators = True

    def __init__(self, together: Together):
        super().__init__()
        self.together = together

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # torch.compile compiles as if we were not here
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) in _NAMESPACES and func._opname not in _NOT_COLLECTIVES:
            if func._opname in P2P_OPS:
                self.together.before_p2p(func, args, kwargs)
            else:
                self.together.before_collective(func, args, kwargs)
        return func(*args, **kwargs)


class Together:
    """One call of a distributed step that runs the step eagerly or captures it (see above)."""

    def __init__(
        self, board: Any, name: str, *, capturing: bool, watch: bool = True, pipelined: bool = False
    ):
        self.board = board
        self.name = name
        self.capturing = capturing
        self.count = 0
        """Collectives every rank has agreed on and issued so far."""
        self.ended = False
        self.error: BaseException | None = None
        """Once ended: the error this rank raises because of another rank (None: all went well)."""
        self.failed: tuple[int, int] | None = None
        """Once ended by a failure: (the lowest rank that failed, its failure code), the same on every rank."""
        self.lockstep = not pipelined
        """Collective by collective (SPMD); False once some rank issued a point-to-point operation."""
        self.switched = False
        """This call's votes told every rank to stop voting collective by collective (`p2p.py`)."""
        self.log = CommLog(board.rank)
        """Without lockstep: what this rank communicated, compared at the end."""
        self._mode = _Watch(self) if watch and WATCHABLE else None
        self._exchanging = False

    def __enter__(self) -> Together:
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)

    # -- the votes ------------------------------------------------------------------------------

    def before_collective(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._exchanging:  # the vote's own collectives (gloo) are not the step's
            return
        if self.ended:  # the ranks already stopped; a step that caught our error is stopped again
            if self.error is not None:
                raise self.error
            return
        key, shown = describe(func, args, kwargs)
        if self.lockstep:
            digest = _digest(key)
            self._decide(self._exchange([0, digest, _DIGEST_MASK - digest, 0]), None, shown)
            if self.error is not None:
                raise self.error
        if not self.lockstep:
            self.log.collective(_group_of(func, args, kwargs), key)
        self.count += 1

    def before_p2p(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A send or receive: ranks stop going collective by collective (the first one says so)."""
        if self._exchanging:
            return
        if self.ended:
            if self.error is not None:
                raise self.error
            return
        if self.lockstep:
            self._decide(self._exchange([0, 1, _DIGEST_MASK - 1, 1]), None, None)
            if self.error is not None:
                raise self.error
        self.log.p2p(func, args, kwargs)

    def end(self, error: BaseException | None) -> BaseException | None:
        """The step ended on this rank (`error`: how it failed, or None). Returns the error this
        rank must raise because of another rank, or None (all succeeded, or its own error stands)."""
        known = not self.ended or self.error is not None  # do the others know this call failed?
        if not self.ended:
            code = failure_code(error)
            failed = (self.board.size - self.board.rank) * KINDS + code if code else 0
            try:
                self._decide(self._exchange([failed, 0, _DIGEST_MASK, 0]), error, None)
                if not self.ended:  # the others stopped voting collective by collective: they end later
                    self._decide(self._exchange([failed, 0, _DIGEST_MASK, 0]), error, None)
            except RankFailedError:
                if error is None or self.lockstep:
                    raise
                # A pipelined step failed here mid-call: the others may wait in a receive for what this
                # rank never sent (gloo blocks the host there) and never vote. Its own error stands.
                log.warning(
                    "graphstep: %s failed on this rank in the middle of a pipelined call, and the other "
                    "ranks did not end theirs (waiting for what this rank would have sent?): its own "
                    "error stands.",
                    self.name,
                )
                self.ended = True
                return None
            if error is None and self.error is None and not self.lockstep:
                self._compare_logs()
        if error is not None:
            if known:  # else it failed after the ranks agreed it succeeded: the next vote tells them
                mark_agreed(error)
            return None
        return self.error

    def again_eagerly(self) -> None:
        """The ranks stopped this call's capture together and now run the step eagerly instead, in the
        same call (every rank decided so from the same vote): its collectives are checked afresh."""
        self.capturing, self.count, self.ended, self.error, self.failed = False, 0, False, None, None
        self.log = CommLog(self.board.rank)

    def _exchange(self, values: list[int]) -> list[int]:
        self._exchanging = True
        try:
            return self.board.max(values)
        finally:
            self._exchanging = False

    def gather_text(self, text: str) -> list[str]:
        """Every rank's `text` (each rank calls it in the same call): the vote's exchange, not the step's."""
        self._exchanging = True
        try:
            return self.board.gather_text(text)
        finally:
            self._exchanging = False

    def _decide(self, top: list[int], failure: BaseException | None, collective: str | None) -> None:
        """The same decision on every rank, from the same maxima."""
        failed, high, inverse, p2p = top
        low = _DIGEST_MASK - inverse
        if failed:
            rank, code = self.board.size - failed // KINDS, failed % KINDS
            self.failed = (rank, code)
            texts = self.gather_text(describe_error(failure) if failure is not None else "")
            self._stop(self._failure_error(rank, code, texts[rank]))
        elif p2p:  # some rank sends or receives: no more votes until the end (`p2p.py`)
            self.lockstep, self.switched = False, True
        elif high != low:
            here = f"collective #{self.count + 1}: {collective}" if collective else None
            texts = self.gather_text(here or f"none: the step ended after {self.count} collectives")
            self._stop(CollectiveMismatchError(self._mismatch_message(texts)))
        elif high == 0:  # every rank's step ended, and none failed
            self.ended = True

    def _compare_logs(self) -> None:
        """Every rank's step succeeded without lockstep: compare what the ranks exchanged."""
        texts = self.gather_text(self.log.summary())
        found = mismatch(texts)
        if found is None:
            return
        doing = "capturing" if self.capturing else "running"
        consequence = (
            "Nothing of this call was kept on any rank."
            if self.capturing
            else "Every rank has taken this step: restore a checkpoint on every rank before going on."
        )
        self._stop(
            CollectiveMismatchError(
                f"the ranks communicated inconsistently while {doing} {self.name}: {found}\nReplaying "
                "would hang or mix data between ranks. Look for a branch on the rank or on a value that "
                f"differs between ranks (a pipeline stage that sends or receives differently). {consequence}"
            )
        )

    def _stop(self, error: BaseException) -> None:
        self.ended = True
        self.error = error
        mark_agreed(error)

    # -- what every rank is told ---------------------------------------------------------------

    def _failure_error(self, rank: int, code: int, text: str) -> GraphStepError:
        what = {HOST_SYNC: "synchronises with the host", OUT_OF_MEMORY: "ran out of memory"}.get(
            code, "failed"
        )
        cause = f" ({text})" if text else ""
        where = f"after {self.count} collectives of the step"
        if self.capturing:
            cls = HostSyncError if code == HOST_SYNC else CaptureError
            return cls(
                f"capturing {self.name} failed on rank {rank}: its step {what}{cause}, {where}. Ranks "
                "capture together, so this rank stopped its capture too (its own error on rank "
                f"{rank} says where). Nothing was lost: the model, optimizer and inputs are as they were "
                "before this call."
            )
        return RankFailedError(
            f"{self.name} failed on rank {rank}: its step {what}{cause}, {where}. Every rank stops "
            f"here instead of waiting for collectives rank {rank} will never issue. Ranks that had "
            "finished their step have taken it, so the ranks' training state may now differ: "
            "restore a checkpoint on every rank before going on."
        )

    def _mismatch_message(self, texts: list[str]) -> str:
        by_text: dict[str, list[int]] = {}
        for rank, text in enumerate(texts):
            by_text.setdefault(text, []).append(rank)
        lines = "\n".join(f"  - {_ranks(ranks)}: {text}" for text, ranks in by_text.items())
        doing = "capturing" if self.capturing else "running"
        consequence = (
            "Nothing of this call was kept on any rank."
            if self.capturing
            else "Ranks whose step ended have taken it: restore a checkpoint on every rank before going on."
        )
        return (
            f"the ranks issued different collectives while {doing} {self.name}; the first difference "
            f"is at collective #{self.count + 1}:\n{lines}\nReplaying or running on would hang or mix "
            "data between ranks. Make every rank issue the same collectives in the same order: look "
            "for a branch on the rank, or a module wrapped (DDP, FSDP, tensor parallel) differently on "
            f"some ranks. {consequence}"
        )


def _group_of(func: Any, args: tuple, kwargs: dict) -> list[int] | None:
    for argument, value in _arguments(func, args, kwargs):
        group = _group_ranks(argument, value)
        if group is not None:
            return group
    return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _digest(key: str) -> int:
    value = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return value % _DIGEST_MASK + 1  # never 0: that is "the step ended"


# -- describing a collective ----------------------------------------------------------------------


def describe(func: Any, args: tuple, kwargs: dict) -> tuple[str, str]:
    """(what must be equal on every rank, what a person reads) for one collective call.

    Groups are compared by shape, not identity: rank 0's data-parallel group {0, 2} and rank 1's
    {1, 3} are the same group of a mesh. A person reads the ranks themselves."""
    name = func._opname
    sizes = name not in _UNEVEN
    keys, shown = [f"{func.namespace}.{name}"], []
    for argument, value in _arguments(func, args, kwargs):
        group = _group_ranks(argument, value)
        if group is not None:
            keys.append(f"group{tuple(r - group[0] for r in group)}")
            shown.append(f"group of {len(group)} ranks {_short(group)}")
        elif isinstance(value, torch.Tensor) or _tensors(value):
            text = _tensor_text(value, sizes)
            keys.append(text)
            shown.append(text)
        elif isinstance(value, str):
            keys.append(value)
    frame = user_frame_of(traceback.extract_stack()[:-1])
    site = f" at {_describe(frame)}" if frame is not None else ""
    return "|".join(keys), f"{func.namespace}.{name} of {', '.join(shown)}{site}"


def _arguments(func: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    names = [a.name for a in func._schema.arguments]
    pairs = list(zip(names, args))
    pairs += [(k, v) for k, v in kwargs.items()]
    return pairs


def _group_ranks(argument: str, value: Any) -> list[int] | None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if argument not in ("process_group", "group_name", "group"):
        return None
    try:
        if isinstance(value, str):
            value = c10d._resolve_process_group(value)
        elif not isinstance(value, dist.ProcessGroup):
            value = dist.ProcessGroup.unbox(value)
        return dist.get_process_group_ranks(value)
    except Exception:  # an unregistered group: compare what we can
        log.debug("graphstep: cannot tell the ranks of group %r", value)
        return [-1]


def _tensors(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) or _tensors(v) for v in value)


def _tensor_text(value: Any, sizes: bool) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}{list(value.shape)}" if sizes else dtype
    return "[" + ", ".join(_tensor_text(v, sizes) for v in value) + "]"


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
