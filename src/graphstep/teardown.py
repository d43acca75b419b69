"""Teardown: closing captured steps that their user left open: at interpreter exit, and before
`torch.distributed.destroy_process_group`. Graphs alive then can hang or crash teardown
(NCCL waits for graphs holding its work; the allocator frees pools under them)."""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Protocol

from . import distributed
from .diagnostics import log


class _Closable(Protocol):
    group: Any
    """The process group the step's ranks vote in; None for a single-process step."""

    def close(self) -> None: ...


_live: weakref.WeakSet = weakref.WeakSet()


def opened(step: _Closable) -> None:
    _live.add(step)


def closed(step: _Closable) -> None:
    _live.discard(step)


def _close_steps_on(group: Any) -> None:
    """Before `destroy_process_group(group)`: close the steps whose graphs may hold its collectives
    (every step, for the whole world: a step's graph can hold any group's collectives)."""
    import torch.distributed as dist

    whole_world = group is None or group is dist.group.WORLD
    for step in list(_live):
        if whole_world or step.group is group:
            step.close()


@atexit.register
def _close_all() -> None:
    for step in list(_live):
        try:
            step.close()
        except Exception as exc:  # exit must go on
            log.warning("graphstep: closing %r at exit failed: %s", step, exc)


distributed.close_before_destroy(_close_steps_on)
distributed.set_nccl_graph_registration()
