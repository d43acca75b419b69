"""FSDP2 across the parts of a capture split by graph breaks.

FSDP2 runs its collectives on side streams of its own (all-gather copy-in, all-gather, reduce-scatter,
all-reduce) and orders them against the compute stream with CUDA events and stream waits. It makes its
side streams wait on the compute stream once, in the root's pre-forward, and from then on takes them to
be in step with it. A capture split by a graph break breaks both assumptions at the start of each later
part (seen on H100s, torch 2.11):

- an event FSDP2 recorded in an earlier part (an all-gather's, a reduce-scatter's, a reshard's) and waits
  on in this one belongs to another capture: CUDA refuses the wait ("invalid argument");
- a side stream not yet used in this part is not capturing: what FSDP2 issues on it runs outside the
  capture, and the compute stream's wait on it is refused ("dependency created on uncaptured work in
  another stream").

Replayed, the parts run one after another on one stream, each graph to its end, branches included, before
the eager segment between them and the next graph. So at the start of each later part every side stream
is made to wait on the capture stream (it joins this capture, as the root's pre-forward makes it join an
eager step), and every event FSDP2 holds is recorded again on the capture stream: each wait that follows is
legal in this capture and orders nothing the launch order does not order already. At the end of every part
each side stream that took part in it is joined back into the capture stream, since a capture cannot end
with work forked from it and not joined. FSDP2's buffers and bookkeeping stay as an eager step leaves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..backends.segments import Splitter
from .ranks import _param_groups, fsdp_modules

_DEPTH = 3
"""How far into FSDP2's holders (named tuples, dataclasses, lists, dicts) events are looked for."""


def fsdp_states(modules: list[nn.Module]) -> list[Any]:
    """The FSDP2 states of `modules` and their submodules (none without FSDP2)."""
    return [m._get_fsdp_state() for m in fsdp_modules(modules)]


def _holders(states: list[Any]) -> list[Any]:
    """The objects of FSDP2's per-step state: its contexts, parameter groups and parameters."""
    found = []
    for state in states:
        found += [getattr(state, "_state_ctx", None), getattr(state, "_comm_ctx", None)]
        for group in _param_groups(state):
            found.append(group)
            found += list(getattr(group, "fsdp_params", ()))
    return [h for h in found if h is not None]


def _contents(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    fields = getattr(obj, "__dict__", None)
    return list(fields.values()) if isinstance(fields, dict) else []


def held_events(states: list[Any]) -> list[Any]:
    """Every CUDA event FSDP2's state holds now (each once)."""
    events: dict[int, Any] = {}
    depths: dict[int, int] = {}
    """Each object looked into, at the least depth it was reached: an object reached deep first (a
    state's communication context through the list of every state) is looked into again from nearer."""

    def visit(obj: Any, depth: int) -> None:
        if depths.get(id(obj), _DEPTH + 1) <= depth:
            return
        if isinstance(obj, (torch.Tensor, nn.Module, torch.cuda.Stream, str, int, float)):
            return
        depths[id(obj)] = depth
        if isinstance(obj, (torch.cuda.Event, torch.Event)):
            events[id(obj)] = obj
            return
        if depth < _DEPTH:
            for value in _contents(obj):
                visit(value, depth + 1)

    for holder in _holders(states):
        visit(holder, 0)
    return list(events.values())


def side_streams(states: list[Any]) -> list[torch.cuda.Stream]:
    """FSDP2's side streams (each once), from its communication contexts."""
    streams: dict[int, torch.cuda.Stream] = {}
    for state in states:
        for value in _contents(getattr(state, "_comm_ctx", None)):
            if isinstance(value, torch.cuda.Stream):
                streams[value.cuda_stream] = value
    return list(streams.values())


def _capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def across_parts(
    splitter: Splitter, states: list[Any], stream: torch.cuda.Stream | None
) -> Iterator[Splitter]:
    """`splitter` whose parts keep FSDP2's side streams and events inside the capture (module docstring);
    on leaving, the side streams that took part in the last part are joined back. `stream`: the capture
    stream (None, or no FSDP2: `splitter` as it is). It writes no Python state of its own: graphstep's
    own code in a capture is judged by the write watch as any library's."""
    if not states or splitter.executes or stream is None:  # the recording backend captures nothing
        yield splitter
        return

    def join() -> None:
        for side in side_streams(states):
            if _capturing(side):
                stream.wait_stream(side)

    def end_part() -> None:
        join()
        splitter.end_part()

    def begin_part() -> None:
        splitter.begin_part()
        for side in side_streams(states):
            side.wait_stream(stream)
        for event in held_events(states):
            event.record(stream)

    yield dataclasses.replace(splitter, end_part=end_part, begin_part=begin_part)
    join()  # a capture split or not: joining a stream already joined orders nothing more
