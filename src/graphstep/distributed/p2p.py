"""Steps whose ranks do not issue the same collectives: pipeline parallelism, checked at the end.

In a pipelined step (`torch.distributed.pipelining`: GPipe, 1F1B, interleaved schedules) each rank
runs its own stage: it receives activations from the previous stage and gradients from the next
(point-to-point `send` / `recv`), and each stage's data-parallel group (DDP, FSDP2) issues its own
collectives at its own times. Going collective by collective together (`collectives.py`) cannot work
there: a rank would wait in graphstep's vote for a peer that waits in a receive for it. So once any
rank issues a point-to-point operation, the ranks stop voting collective by collective for the rest of
that call and of every later call of the step (every rank learns it from the same vote), and each rank
keeps a `CommLog` instead: per process group, the sequence of its collectives; per pair of ranks, the
sequence of tensors sent from one to the other, as the sender and as the receiver saw it. At the end of
a call that ran the step eagerly or captured it, the ranks compare their logs (one gather of a short
text): every member of a group must have issued the same collectives, every receive must match its
send (order, dtype, number of elements). A difference raises `CollectiveMismatchError` on every rank naming the
group or the pair, before any rank replays a graph that would hang or mix data.

What this gives up against the collective-by-collective check: a stage that fails in the middle of a
call is reported to the others at the end of their own step, not at the collective or receive where
they would wait for it (with NCCL the host does not wait for a receive, so they get there; with gloo
a receive blocks until the failed rank's process ends or the group's timeout).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch

P2P_OPS = frozenset({"send", "recv_", "recv_any_source_"})
"""c10d operations of one rank towards one other (their peer is in the arguments)."""


class CommLog:
    """What one rank communicated in one call of a pipelined step, by group and by peer."""

    def __init__(self, rank: int):
        self.rank = rank
        self._sequences: dict[str, list[str]] = {}

    def collective(self, group: list[int] | None, key: str) -> None:
        name = "group " + (",".join(map(str, group)) if group else "?")
        self._sequences.setdefault(name, []).append(key)

    def p2p(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A send (`self.rank` to its peer) or a receive (peer to `self.rank`), by global ranks."""
        tensors, group, peer = _p2p_arguments(func, args, kwargs)
        # By dtype and size, not shape: a 0-d tensor sent into a one-element buffer is the same data
        # (pipelining's first call does so on NCCL: seen on two H100s)
        text = " ".join(f"{str(t.dtype).removeprefix('torch.')}x{t.numel()}" for t in tensors)
        if func._opname == "send":
            name = f"{self.rank}>{_global(group, peer)}"
        elif func._opname == "recv_":
            name = f"{_global(group, peer)}>{self.rank}"
        else:  # any source: no pair to compare
            return
        self._sequences.setdefault(name, []).append(text)

    def empty(self) -> bool:
        return not self._sequences

    def summary(self) -> str:
        """A short text of each sequence: its length, a digest, and its first item (for messages)."""
        return json.dumps(
            {name: [len(items), _digest(items), items[0][:80]] for name, items in self._sequences.items()},
            separators=(",", ":"),
        )


def mismatch(texts: list[str]) -> str | None:
    """From every rank's `CommLog.summary()`: the first difference, as lines a person reads; None if
    every group's members issued the same collectives and every pair's receives match its sends."""
    logs = [json.loads(t) if t.startswith("{") else {} for t in texts]
    names = sorted({name for log in logs for name in log})
    for name in names:
        if name.startswith("group "):
            members = [int(r) for r in name[6:].split(",") if r.lstrip("-").isdigit()]
            seen = {r: logs[r].get(name) for r in members if 0 <= r < len(logs)}
            if len({json.dumps(v) for v in seen.values()}) > 1:
                lines = [f"  - rank {r}: {_told(v, 'collectives')}" for r, v in seen.items()]
                return f"the collectives on the {name} differ:\n" + "\n".join(lines)
        else:
            src, dst = (int(r) for r in name.split(">"))
            sent = logs[src].get(name) if src < len(logs) else None
            got = logs[dst].get(name) if dst < len(logs) else None
            if sent != got:
                return (
                    f"what rank {src} sent to rank {dst} is not what rank {dst} received from rank {src}:\n"
                    f"  - rank {src} sent {_told(sent, 'tensors')}\n"
                    f"  - rank {dst} received {_told(got, 'tensors')}"
                )
    return None


def _told(entry: list | None, what: str) -> str:
    if entry is None:
        return f"no {what}"
    count, digest, first = entry
    noun = what if count != 1 else what[:-1]
    return f"{count} {noun} (first: {first}; digest {digest})"


def _digest(items: list[str]) -> str:
    return hashlib.blake2b("\n".join(items).encode(), digest_size=6).hexdigest()


def _p2p_arguments(func: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any, int]:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    tensors = bound.get("tensors") or []
    peer = bound.get("dst", bound.get("src", -1))
    return list(tensors), bound.get("process_group"), int(peer)


def _global(group: Any, peer: int) -> int:
    """The global rank of `peer`, a rank of `group` (a boxed ProcessGroup)."""
    import torch.distributed as dist

    try:
        if not isinstance(group, dist.ProcessGroup):
            group = dist.ProcessGroup.unbox(group)
        return dist.get_process_group_ranks(group)[peer]
    except Exception:  # an unregistered group: the group's own rank (compared as such on both sides)
        return peer


# -- the schedules a step drives ---------------------------------------------------------------------


def pipeline_schedules(fn: Any) -> list:
    """The `torch.distributed.pipelining` schedules in `fn`'s closure, its globals, or the attributes of
    the object it is a method of (found once, when the step is first called)."""
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    if schedules is None:  # never imported: no step of this process drives one
        return []
    kind = schedules._PipelineSchedule
    found: list = []
    self = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    values = []
    if code is not None:
        values += [c.cell_contents for c in fn.__closure__ or () if _assigned(c)]
        values += [getattr(fn, "__globals__", {}).get(name) for name in code.co_names]
    if self is not None:
        values += list(getattr(self, "__dict__", {}).values())
    for value in values:
        if isinstance(value, kind) and not any(value is s for s in found):
            found.append(value)
    return found


def initialises(schedule: Any) -> bool:
    """Whether `schedule.step()` will initialise its stages in its next call (its first, or the first
    after `schedule.eval()`): shape inference, a host exchange of metadata that no graph can hold."""
    forward = getattr(schedule, "_stage_forward_initialized", None)
    backward = getattr(schedule, "_stage_backward_initialized", None)
    if forward is None:  # a schedule of several stages per rank
        forward = getattr(schedule, "_stages_forward_initialized", True)
        backward = getattr(schedule, "_stages_backward_initialized", True)
    has_backward = getattr(schedule, "_has_backward", False)
    if not forward or (has_backward and not backward):
        return True
    # torch 2.11 keeps the stages initialised across `schedule.eval()` but leaves each stage's own
    # has_backward False after it; the next step sets it back (a write a capture would refuse).
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return any(getattr(stage, "has_backward", has_backward) != has_backward for stage in stages if stage)


def _assigned(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True
