"""Variant churn: a value the step reads that changes on every call, and the eager calls that wait it out.

A Python number the step reads (a global `it` indexing a momentum schedule, a counter in a dict the
step reads) is baked into a graph; when it changes, the lifecycle captures another variant. A value
that changes on *every* call makes every call capture a graph that is never replayed: results stay
right, but each call pays a capture (0.8 s on an H100 where the eager step takes 1 ms), forever.

`VariantChurn` stops that, per signature. It sees churn two ways:

- before the first capture: the last two warm-ups run under a `ReadWatch`, and a `Probe` over what
  each read (globals, closure cells, the contents of containers, module attributes) tells whether any
  of it changed by the next call. Changed before the last warm-up and again before the capturing
  call: that call runs eagerly instead of capturing (a value changed once, just before the capture,
  is captured as it is);
- after it: `CALLS` captures in a row with no replay of this signature between them (a capturing
  call's own replay on CUDA does not count), and another variant to capture: that call runs eagerly;
  once a signature waited, also a variant that would drop another graph to stay within
  `Config.max_graphs` (a cycle of more values than fit would otherwise capture on most calls).

While it waits, every call runs the eager step (`StepContext.run_eager`), a variant captured before
whose guard holds again is replayed (which ends the wait), and the `Probe` compares the values at the
start of each call with those left at the end of the calls of this wait: a value that held still
since the last call, or came back to one seen in this wait, captures again (before the first capture:
after one more warm-up, if the values are then some seen in the wait). The step's own writes change values *during* a call, not between
calls, so they never keep it waiting. Each new wait of a signature asks for twice as many sightings as
the last (a value that holds still only briefly stops costing captures). A warning names each churning
value once, with the fix.

The lifecycle asks in its plan (`waits_before_capture`, `still_waiting`, `waits_on`,
`waits_for_variant`) and reports in its act (`captured`, `after_eager_call`), after the ranks agreed:
every rank acts on the least advanced phase, so a rank that waits makes the others step eagerly too.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from ..state import TrainingState
from . import fastcheck
from .barriers import MISSING, ModuleWatch
from .read_guard import ReadGuard
from .reads import Reads
from .state_guard import StateGuard, named_modules

log = logging.getLogger("graphstep")

_SEEN = 64
"""Value sets remembered per wait (one that comes back after more others than this counts as new)."""


class Probe:
    """The values a step read, as a reference, and how the values now differ from it:
    `fingerprint()` gives the value changes' texts ("where: was -> now"), sorted; () when none."""

    def __init__(self, reads: ReadGuard, modules: ModuleWatch | None):
        self.reads = reads
        self.modules = modules
        self._contents: Any = None
        """The contents' identity pass in C++ (see fastcheck.py), made on first use."""

    @classmethod
    def of_run(cls, reads: Reads, state: TrainingState, fn: Any) -> Probe:
        """From what a watched warm-up read (`ReadWatch(...).reads`)."""
        if not reads.complete:  # another profiler was active: the step function's own reads
            reads = Reads.of_function(fn)
        named = [nm for prefix, root in state.named_modules_roots() for nm in named_modules(prefix, root)]
        guard = ReadGuard(reads, {id(m): name for name, m in named})
        return cls(guard, ModuleWatch(named, scan=False, skip=reads.module_writes))

    @classmethod
    def of_guard(cls, guard: StateGuard) -> Probe:
        """From a captured graph's guard: the values it was captured for."""
        return cls(guard.reads, guard.modules)

    def fingerprint(self) -> tuple[str, ...]:
        found = []
        reads = self.reads
        if not reads.holds():  # a binding differs (a churning counter: cheap), or some contents
            found += [text for text, value in reads.binding_changes() if value]
            if not self._contents_hold():
                found += [text for text, value in reads.contents.changes() if value]
        if self.modules is not None and not self.modules.holds():
            found += [text for text, value in self.modules.changes() if value]
        return tuple(sorted(found))

    def _contents_hold(self) -> bool:
        """Every container read is, object for object, as the reference saw it: one C++ pass where
        the helper is built (a schedule list of 1,000 numbers: 0.4 us instead of 12 on a 2-core CPU)."""
        contents = self.reads.contents
        if not contents.roots:
            return True
        if self._contents is None:
            self._contents = fastcheck.identity_check(contents.identities(), MISSING) or contents
        return self._contents.holds()


def where(texts: tuple[str, ...] | list[str]) -> set[str]:
    """Where each change was read: "global 'it' in train.py" of "global 'it' in train.py: 3 -> 4"."""
    return {text.split(": ", 1)[0] for text in texts}


class VariantChurn:
    """One signature's captures with no replay between them, and its waits (see the module).
    `replays` arguments: the signature's replay count now."""

    CALLS = 2
    """Captures in a row with no replay between them after which another variant is not captured.
    Two: a capture costs as much as hundreds of eager steps, and a value that cycles through a few
    values loses nothing: a cycle of up to CALLS + 1 values is captured without any eager call, and a
    longer one after a few, since a wait replays the variants it has and captures a value that comes
    back."""

    def __init__(self, step_name: str):
        self.step_name = step_name
        self.run: list[set[str]] = []
        """Per capture since the last replay: where its changes were."""
        self._mark: int | None = None
        """The replay count after the last capture (its own replay included)."""
        self.resumed = False
        """A wait ended by capturing, and nothing was replayed since: the next variant waits at once."""
        self.probe: Probe | None = None
        """Before the first capture: what the last warm-up read. While waiting: the reference."""
        self.waiting = False
        self.resuming = False
        """Before the first capture, a wait ended: the probe and what the wait saw are kept."""
        self.waits = 0
        """Waits begun (each asks for twice the sightings of the last)."""
        self._begun_at = 0
        """The replay count when this wait began: a replay since ends it."""
        self._seen: collections.OrderedDict[tuple[str, ...], int] = collections.OrderedDict()
        """Value sets (fingerprints) left at the end of the calls of this wait, and how often."""
        self._changed = False
        """Before the first capture: the values changed between the last two warm-ups."""
        self._unsaid = False
        self._said: set[str] = set()
        self.texts: tuple[str, ...] = ()
        """The latest changes that kept it waiting (for messages)."""

    # -- asked in the plan -----------------------------------------------------------------------

    def probing(self) -> bool:
        """Whether the last warm-up before a capture makes a new probe (not while one is in use)."""
        return not (self.waiting or self.resuming)

    def before_watched_warmup(self) -> None:
        """A warm-up is about to run under a `ReadWatch`: did the values change since the last one?"""
        self._changed = self.probe is not None and bool(self.probe.fingerprint())

    def waits_before_capture(self, replays: int) -> bool:
        """At a call that would capture the first graph: True to run it eagerly instead, because what
        the warm-ups read changed before the last one and again since (after a wait: to values not
        seen in it)."""
        now = self.probe.fingerprint() if self.probe is not None else ()
        if self.resuming:
            capture = self._seen.get(now, 0) >= 2 ** (self.waits - 1)
        else:
            capture = not (now and self._changed)
        self.resuming = False
        if capture:
            self.probe = None  # its guard takes over
            return False
        self._begin(replays, self.probe, seen=((), 1))  # the last warm-up left the reference
        self.texts, self._unsaid = now, True  # said if it waits on (a flag that flips comes back at once)
        return True

    def still_waiting(self, replays: int) -> bool:
        """Whether a wait goes on (a replay since it began ended it)."""
        if self.waiting and replays != self._begun_at:
            self.waiting = False
        return self.waiting

    def waits_on(self) -> bool:
        """While waiting, when no captured variant fits: True to run this call eagerly too; False when
        the values held still since a call of this wait ended (or came back to such values)."""
        now = self.probe.fingerprint()
        if self._seen.get(now, 0) >= 2 ** (self.waits - 1):
            return False
        if now:
            self.texts = now
        if self._unsaid:  # before the first capture: changed on four calls in a row now
            self._unsaid = False
            self._warn(where(self.texts), self.texts, before_capture=True)
        return True

    def end_wait(self) -> None:
        """The values held still before the first capture: a warm-up follows (the capture needs what
        it leaves), then a capture if the values are then some seen in this wait."""
        self.waiting, self.resuming = False, True

    def waits_for_variant(
        self, replays: int, texts: tuple[str, ...], guard: StateGuard, *, evicts: bool = False
    ) -> bool:
        """At a call that would capture another variant for `texts`: True to run it eagerly instead.
        `evicts`: the capture would drop a graph (max_graphs): once this signature waited, that is
        done only for values seen to hold still or come back, not on speculation."""
        if self.waiting:  # the wait saw the values hold still: capture
            return False
        if replays != self._mark:
            self.run.clear()
            self.resumed = False
        limit = 0 if evicts and self.waits else self.CALLS
        if len(self.run) < limit and not (self.resumed and self.run):
            return False
        self._begin(replays, Probe.of_guard(guard), seen=None)
        self.texts = texts
        self._warn(set.intersection(*self.run, where(texts)) or where(texts), texts, before_capture=False)
        return True

    # -- told in the act ------------------------------------------------------------------------

    def captured(self, replays_before: int, replays_after: int, texts: tuple[str, ...]) -> None:
        """A graph was captured (`replays_before`/`_after`: the replay count around it)."""
        if replays_before != self._mark:
            self.run.clear()
        self.run.append(where(texts))
        self._mark = replays_after
        self.probe = None
        if self.waiting:
            self.waiting, self.resumed = False, True
            log.info("graphstep: %s: the values held still; captured again", self.step_name)

    def after_eager_call(self) -> None:
        """A call ran eagerly: while waiting, note the values it left."""
        if self.waiting:
            now = self.probe.fingerprint()
            self._seen[now] = self._seen.pop(now, 0) + 1
            if len(self._seen) > _SEEN:
                self._seen.popitem(last=False)

    # -- the wait ---------------------------------------------------------------------------------

    def _begin(self, replays: int, probe: Probe, seen: tuple | None) -> None:
        self.waiting, self.probe, self._begun_at, self._unsaid = True, probe, replays, False
        self.waits += 1
        self._seen.clear()
        if seen is not None:
            self._seen[seen[0]] = seen[1]

    def _warn(self, places: set[str], texts: tuple[str, ...], *, before_capture: bool) -> None:
        new = places - self._said
        if not new:
            return
        self._said |= new
        how = (
            "on each call since its last warm-ups, before its first capture"
            if before_capture
            else "call after call, each time capturing another variant of the graph that was not replayed"
        )
        log.warning(
            "graphstep: %s: a value the step reads changed %s:\n%s\nEvery such call would capture a "
            "graph (a capture costs as much as hundreds of eager steps) and none would be replayed, so "
            "these calls run eagerly instead (the same step, bitwise equal to eager), and the step "
            "captures again once the value holds still (or comes back to a value captured before). "
            "Where it was read:\n%s\nIf the step computes with it, pass it to the step as a 0-d tensor "
            "argument on the step's device, or keep it in a 0-d device tensor updated in place between "
            "calls (`t.fill_(value)`): a replay then reads the current value, and one graph serves every "
            "call. If the step does not use it, keep it out of what the step reads (a dict or list the "
            "step reads is compared whole).",
            self.step_name,
            how,
            _listed(texts),
            _listed(sorted(new)),
        )


def _listed(items: Any) -> str:
    return "\n".join(f"  - {item}" for item in items)
