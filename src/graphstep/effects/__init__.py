"""Python effects of the step's code at capture: writes, host random draws, prints.

A graph replays kernels, never the Python that launched them; whatever else that Python did at
capture happens once and never again. Modules here watch the capturing call for such effects and
refuse them with the user's line and what to write instead: `host_random` (host random draws),
`writes` (writes to Python state that outlives the call: an attribute, a global, a list appended
to; and one warning for `print`/`logging` inside the step). `watch_writes` is what a capture enters.
"""

from __future__ import annotations

from .writes import WriteWatch, redone_on_replays


def watch_writes(step_name: str, *, allow_writes: bool, graphs: bool) -> WriteWatch:
    """The watch over one capturing run of a step. `graphs`: the backend replays without running the
    step's Python (CUDA graphs, the recording stand-in); the eager backend runs it every call, so
    nothing is watched there."""
    return WriteWatch(step_name, allow=allow_writes, enabled=graphs)


__all__ = ["WriteWatch", "redone_on_replays", "watch_writes"]
