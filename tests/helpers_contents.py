"""A stand-in for a user's config module: numbers a loss reads *inside* containers, which
tests/test_guards_contents.py changes in place between calls (the binding stays the same object)."""

from __future__ import annotations

import collections
import dataclasses
import types

LOSS_WEIGHTS = [1.0, 0.5]
CFG = {"smoothing": 0.1, "loss": {"weight": 1.0, "terms": ["mse"]}}
NS = types.SimpleNamespace(loss=types.SimpleNamespace(weight=1.0))
ENABLED = {"mse"}
WINDOW = collections.deque([1.0, 1.0], maxlen=4)
PAIR = (2.0, [0.5])
BIG = [1.0] * 2_000  # past MAX_ENTRIES: not guarded, and named once at capture
RAW = bytearray(b"\x01")  # a type graphstep cannot see into
HISTORY: list[int] = []  # the step appends to it: written, not guarded


class LossSettings:
    """A plain object of the user's own class."""

    def __init__(self) -> None:
        self.weight = 1.0
        self.calls_seen = 0  # the training loop counts here; the step never reads it


SETTINGS = LossSettings()


@dataclasses.dataclass
class Stage:
    weight: float = 1.0


@dataclasses.dataclass
class Schedule:
    stages: list = dataclasses.field(default_factory=lambda: [Stage(), {"w": [1.0, 0.5]}])


SCHEDULE = Schedule()


class ArgConfig:
    """Passed to the step as an argument: hashed by identity, so it keys the same graph."""

    def __init__(self) -> None:
        self.scale = 1.0


def reset() -> None:
    """Every container back to its first contents, in place (the objects stay the same)."""
    LOSS_WEIGHTS[:] = [1.0, 0.5]
    CFG.clear()
    CFG.update({"smoothing": 0.1, "loss": {"weight": 1.0, "terms": ["mse"]}})
    NS.loss.weight = 1.0
    ENABLED.clear()
    ENABLED.add("mse")
    WINDOW.clear()
    WINDOW.extend([1.0, 1.0])
    PAIR[1][:] = [0.5]
    SETTINGS.weight, SETTINGS.calls_seen = 1.0, 0
    SCHEDULE.stages = [Stage(), {"w": [1.0, 0.5]}]
    HISTORY.clear()


# One factor per kind of read; the step multiplies its loss by it.
def list_factor() -> float:
    return LOSS_WEIGHTS[0] + LOSS_WEIGHTS[1]


def dict_factor() -> float:
    return 1.0 - CFG["smoothing"]


def nested_dict_factor() -> float:
    return CFG["loss"]["weight"] * len(CFG["loss"]["terms"])


def namespace_factor() -> float:
    return NS.loss.weight


def set_factor() -> float:
    return 2.0 if "l1" in ENABLED else 1.0


def deque_factor() -> float:
    return sum(WINDOW) / len(WINDOW)


def tuple_factor() -> float:
    return PAIR[0] * PAIR[1][0]


def object_factor() -> float:
    return SETTINGS.weight


def dataclass_factor() -> float:
    return SCHEDULE.stages[0].weight + SCHEDULE.stages[1]["w"][1]


def default_factor(weights=[1.0, 0.5]) -> float:  # noqa: B006 (the point: a mutable default)
    return weights[1]


def make_closure_factor():
    """A factor reading a dict in its closure, and the dict."""
    table = {"w": 1.0}

    def factor() -> float:
        return table["w"]

    return factor, table


def unguarded_factor() -> float:
    return BIG[0] * RAW[0]


def writing_factor() -> float:
    HISTORY.append(len(HISTORY))  # a write the replays do not repeat (issue 21, part 2)
    return LOSS_WEIGHTS[0]
