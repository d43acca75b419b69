"""How the ranks of a distributed step exchange a few small numbers: the vote's transport.

Every exchange is one element-wise maximum over the ranks of a short vector of non-negative
integers (`Board.max`); `ranks.py` encodes in it what the ranks must agree on (the lowest
phase, which rank holds back, which rank failed, whether the next collective is the same
everywhere). Two transports give the same answers:

- `SharedMemoryBoard`, when every rank runs on one host: the ranks share a small segment in
  /dev/shm. Each rank writes its numbers into its own slot and reads everyone's until all slots
  carry this exchange's number; the maximum is then computed locally. A few microseconds, no
  system call on the fast path. Each 8-byte word carries the exchange's number in its top bits,
  so a word is either wholly this exchange's or not: no memory fences are needed (an aligned
  8-byte load or store is atomic on x86-64 and AArch64), and two sets of slots, used in turn,
  keep a fast rank from overwriting numbers a slow rank has not read yet (a rank writes
  exchange s+2 only after every rank has written s+1, which each does only after reading s).
- `GlooBoard` otherwise (ranks on several hosts): one gloo all-reduce of the vector.

A rank that never arrives is reported, not waited for forever: the shared-memory board checks
whether the missing ranks' processes still exist and gives up after the group's timeout, gloo
raises when a peer's connection closes. Either way a `RankFailedError` names the ranks.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
import uuid
from collections.abc import Sequence

import torch

from ..diagnostics import log
from ..errors import RankFailedError

WIDTH = 4
"""The longest vector one exchange carries."""
VALUE_BITS = 40
"""Each number must be below 2**VALUE_BITS."""
_VALUE_MASK = (1 << VALUE_BITS) - 1
_TAG_MASK = (1 << (63 - VALUE_BITS)) - 1  # the exchange's number, below the sign bit

_SPIN_S = 50e-6  # busy-wait this long: ranks of a step usually arrive within microseconds
_YIELD_S = 2e-3  # then give the core away (oversubscribed hosts), then sleep, at most _NAP_S
_NAP_S = 1e-3
_CHECK_S = 0.5  # how often a waiting rank checks that the missing ranks' processes still exist


def vote_timeout(group: object) -> float:
    """Seconds a rank waits for the others: GRAPHSTEP_VOTE_TIMEOUT, else the group's own timeout
    (gloo's default is 30 minutes), as a gloo all-reduce would."""
    if os.environ.get("GRAPHSTEP_VOTE_TIMEOUT"):
        return float(os.environ["GRAPHSTEP_VOTE_TIMEOUT"])
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # private API: torch versions differ
        return 1800.0


class GlooBoard:
    """One gloo all-reduce (MAX) per exchange: works across hosts; ~100-200 µs on one host."""

    name = "gloo"

    def __init__(self, group: object):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._buffers = [torch.zeros(n, dtype=torch.int64) for n in range(WIDTH + 1)]

    def max(self, values: Sequence[int]) -> list[int]:
        import torch.distributed as dist

        buffer = self._buffers[len(values)]
        for i, v in enumerate(values):
            buffer[i] = v
        try:
            dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:
            raise RankFailedError(
                f"rank {self.rank}: the vote with the other ranks over gloo failed ({exc}). Another rank "
                "probably exited or failed: its own error says why."
            ) from exc
        return buffer.tolist()

    def gather_text(self, text: str) -> list[str]:
        return gather_text(self.group, text)


class SharedMemoryBoard:
    """Ranks of one host vote through a shared segment: slots[parity][word][rank], int64."""

    name = "shared memory"

    def __init__(self, group: object, view: mmap.mmap, pids: list[int], check_pids: bool, timeout: float):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._mmap = view
        self._words = memoryview(view).cast("q")
        self._pids = pids
        self._check_pids = check_pids
        self.timeout = timeout
        self._seq = 0
        self._broken: str | None = None

    def max(self, values: Sequence[int]) -> list[int]:
        if self._broken is not None:
            raise RankFailedError(self._broken)
        self._seq += 1
        n, words, count = self.size, self._words, len(values)
        tag = (self._seq & _TAG_MASK) << VALUE_BITS
        base = (self._seq & 1) * WIDTH * n
        rows = range(base, base + count * n, n)
        for row, v in zip(rows, values):
            words[row + self.rank] = tag | v
        last = tag | _VALUE_MASK
        started = None
        while True:
            result = []
            for row in rows:
                seen = words[row : row + n].tolist()
                low = min(seen)
                if low < tag or low > last or max(seen) > last:
                    break  # some rank has not written this exchange yet
                result.append(max(seen) & _VALUE_MASK)
            else:
                return result
            now = time.perf_counter()
            if started is None:
                started = checked = now
            waited = now - started
            if waited < _SPIN_S:
                continue
            if waited < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(min(_NAP_S, waited / 16))
            if now - checked > _CHECK_S:
                checked = now
                self._check_missing(rows, tag, waited)

    def _missing(self, rows: range, tag: int) -> list[int]:
        words, n = self._words, self.size
        return [r for r in range(n) if any(words[row + r] >> VALUE_BITS != tag >> VALUE_BITS for row in rows)]

    def _check_missing(self, rows: range, tag: int, waited: float) -> None:
        missing = self._missing(rows, tag)
        dead = [r for r in missing if self._check_pids and not _alive(self._pids[r])]
        if dead:
            self._broken = (
                f"rank(s) {dead} of this step exited (process {', '.join(str(self._pids[r]) for r in dead)} "
                f"is gone) while rank {self.rank} waited for them in graphstep's vote. Their own error "
                "says why; every other rank stops here rather than wait for collectives that never come."
            )
            raise RankFailedError(self._broken)
        if waited > self.timeout:
            self._broken = (
                f"rank(s) {missing} did not reach graphstep's vote within {self.timeout:.0f} s while rank "
                f"{self.rank} waited for them: they are stuck (in a collective the other ranks did not "
                "issue?) or busy elsewhere. Set GRAPHSTEP_VOTE_TIMEOUT (seconds) to wait longer."
            )
            raise RankFailedError(self._broken)

    def gather_text(self, text: str) -> list[str]:
        return gather_text(self.group, text)


def gather_text(group: object, text: str) -> list[str]:
    """Every rank's `text` (rare: only to explain a failure or a mismatch all ranks agreed on)."""
    import torch.distributed as dist

    texts: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(texts, text[:2000], group=group)
    except RuntimeError:
        return ["(unknown: the ranks could not exchange their descriptions)"] * len(texts)
    return [str(t) for t in texts]


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _host() -> tuple[str, str, str]:
    """What identifies this host (and whether process ids can be compared): name, boot id, pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return socket.gethostname(), boot, pidns


def open_board(group: object) -> GlooBoard | SharedMemoryBoard:
    """Set up the vote for the ranks of `group` (a gloo group); a collective call of every rank.

    Shared memory when every rank is on this host and a segment in /dev/shm is shared by all
    (checked, not assumed: containers on one host may not share it), gloo otherwise.
    GRAPHSTEP_VOTE=gloo forces gloo.
    """
    import torch.distributed as dist

    if os.environ.get("GRAPHSTEP_VOTE", "").lower() == "gloo":
        return GlooBoard(group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = (2 * WIDTH * size) * 8 + size * 8  # the slots, then each rank's process id
    view = path = None
    if rank == 0:  # made before anyone looks for it
        path = f"/dev/shm/graphstep-vote-{uuid.uuid4().hex}"
        view = _attach(path, nbytes, create=True)
    infos: list = [None] * size
    try:
        dist.all_gather_object(infos, (_host(), os.getpid(), path), group=group)
        hosts = {info[0][:2] for info in infos}
        if len(hosts) > 1:
            log.info("graphstep: the ranks span %d hosts: they vote over gloo", len(hosts))
            return GlooBoard(group)
        path = infos[0][2]
        pids = [info[1] for info in infos]
        if rank != 0:
            view = _attach(path, nbytes, create=False)
        if view is not None:
            pid_words = memoryview(view).cast("q")
            pid_words[2 * WIDTH * size + rank] = os.getpid()
            del pid_words
        ok = torch.tensor([view is not None], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # everyone attached and wrote
        if ok.item() and view is not None:
            seen = memoryview(view).cast("q")[2 * WIDTH * size :].tolist()
            ok.fill_(seen == pids)
        else:
            ok.fill_(0)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # everyone sees everyone's writes
    finally:
        if rank == 0 and path is not None:
            _unlink(path)  # the mapping lives on; nothing is left behind if a process dies
    if not ok.item():
        log.info("graphstep: no shared memory common to every rank: they vote over gloo")
        return GlooBoard(group)
    same_pids = len({info[0][2] for info in infos}) == 1
    return SharedMemoryBoard(group, view, pids, same_pids, vote_timeout(group))


def _attach(path: str, nbytes: int, *, create: bool) -> mmap.mmap | None:
    try:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                return None
            return mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as exc:
        log.info("graphstep: cannot share %s for the vote (%s)", path, exc)
        return None


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
