"""FSDP2 across the parts of a capture split by graph breaks.

FSDP2 orders its side streams with events: an all-gather records one that the next all-gather waits on
before reusing memory, a reduce-scatter one that the next post-backward (or the end of the backward)
waits on, a forward's reshard one that the backward waits on. With a graph break inside a module that
FSDP2 wraps, such an event is recorded in one part's capture and waited on in the next part's, and CUDA
refuses a wait on an event of another capture ("CUDA error: invalid argument", seen on H100s).

Replayed, the parts run one after another on one stream, each to its end, so every event recorded in an
earlier part has completed when a later part starts. At the start of each part after the first, the
events FSDP2 still holds are therefore recorded again on the capture stream: the waits that follow are
legal in the new capture and order nothing that the launch order does not already order. FSDP2 keeps its
buffers and its bookkeeping as eager has them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..backends.segments import Splitter

_STATE_EVENTS = ("post_optim_event",)
_COMM_HOLDERS = ("all_gather_state", "reduce_scatter_state")
_COMM_LISTS = ("reduce_scatter_states",)
_GROUP_EVENTS = ("_post_reduce_event", "_reshard_after_forward_event")
_GROUP_HOLDERS = ("_all_reduce_state", "_all_gather_result")


def fsdp_states(modules: list[nn.Module]) -> list[Any]:
    """The FSDP2 states of `modules` and their submodules (none without FSDP2)."""
    states = []
    for m in (m for root in modules for m in root.modules()):
        get = getattr(m, "_get_fsdp_state", None)
        if get is not None:
            states.append(get())
    return states


def _held_events(states: list[Any]) -> Iterator[Any]:
    for state in states:
        context, comm = getattr(state, "_state_ctx", None), getattr(state, "_comm_ctx", None)
        yield from (getattr(context, a, None) for a in _STATE_EVENTS)
        holders = [getattr(comm, a, None) for a in _COMM_HOLDERS]
        holders += [h for a in _COMM_LISTS for h in getattr(comm, a, None) or ()]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # up to torch 2.11: one group or none
            groups = [g] if (g := getattr(state, "_fsdp_param_group", None)) is not None else []
        for group in groups:
            yield from (getattr(group, a, None) for a in _GROUP_EVENTS)
            holders += [getattr(group, a, None) for a in _GROUP_HOLDERS]
        for holder in holders:  # named tuples and dataclasses that carry an event
            for name in ("event", "all_gather_event"):
                yield getattr(holder, name, None)


def events_again_in_each_part(splitter: Splitter, states: list[Any]) -> Splitter:
    """`splitter` whose every part after the first records FSDP2's held events again as it begins."""
    if not states or splitter.executes:  # the recording backend captures nothing: nothing to re-record
        return splitter

    def begin_part() -> None:
        splitter.begin_part()
        stream = torch.cuda.current_stream()
        seen: set[int] = set()
        for event in _held_events(states):
            if event is not None and id(event) not in seen and hasattr(event, "record"):
                seen.add(id(event))
                event.record(stream)

    return Splitter(splitter.end_part, begin_part, splitter.executes)
