"""Python effects of the step's code at capture: writes, host random draws, prints.

A replay runs the captured GPU work and no Python, so what the step's Python does besides computing
tensors happens in warm-up and at capture only. `writes.WriteWatch` refuses writes to Python state that
outlives the call (an attribute, a global, a list appended to) with the user's line, undoing them, and
warns once about `print`/`logging` inside the step. `watch_capture` is what a capture enters.
"""

from __future__ import annotations

from .writes import WriteWatch


def watch_capture(step_name: str, *, allow_writes: bool, graphs: bool) -> WriteWatch:
    """The watch over one capturing run of a step. `graphs`: the backend replays without running the
    step's Python (CUDA graphs, the recording stand-in); the eager backend runs it every call, so
    nothing is watched there."""
    return WriteWatch(step_name, allow=allow_writes, enabled=graphs)


__all__ = ["WriteWatch", "watch_capture"]
