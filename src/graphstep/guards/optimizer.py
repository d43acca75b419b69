"""The optimizer part of a graph's guard: the same param groups, the same parameters in them, and the
same Python hyperparameters (the numbers a graph bakes in; device tensors in a group are read live).

A replay checks each group's values by identity first: when every value object is still the one seen
last, nothing was assigned and nothing needs comparing. Only after an assignment (a scheduler's step)
are the values compared, and an equal one is adopted.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch

from ..optim.adapter import baked_hyperparameters
from . import fastcheck
from .change import Change


def hyperparameters(group: dict, ignored: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The Python values of a param group that a graph bakes in (device tensors are read live;
    see `optim.baked_hyperparameters`), less `ignored`: keys the optimizer's step does not read
    from its graph (a scheduler's bookkeeping, a value read only when state is created)."""
    baked = baked_hyperparameters(group)
    return {k: v for k, v in baked.items() if k not in ignored} if ignored else baked


_MISSING = object()
_IMMUTABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Tensor)


class _Seen:
    """The value objects of one param group, to tell by identity that none was assigned since.

    With the C++ helper the identities are compared there (`StateCheck` over the group as the one
    entry of a dict): from Python 3.12 it watches the group and walks it only after a write, so a
    replay after no assignment costs nothing.
    """

    __slots__ = ("fast", "group", "keys", "n", "values")

    def __init__(self, group: dict):
        self.group = group
        self.renew()

    def renew(self) -> None:
        group = self.group
        self.n = len(group)
        # A value that can change in place (a list) must be compared every time: no shortcut.
        immutable = all(
            isinstance(v, _IMMUTABLE) or (type(v) is tuple and all(isinstance(x, _IMMUTABLE) for x in v))
            for k, v in group.items()
            if k != "params"
        )
        self.keys = tuple(group) if immutable else None
        self.values = tuple(group.values()) if immutable else None
        check = getattr(fastcheck.helper(), "StateCheck", None) if immutable else None
        # The outer dict is ours and never written: only the group's own writes count.
        self.fast = check([{0: group}]) if check is not None and type(group) is dict else None

    def holds(self) -> bool:
        if self.fast is not None:
            return self.fast.holds()
        group = self.group
        return (
            self.keys is not None
            and len(group) == self.n
            and all(map(operator.is_, map(group.get, self.keys, itertools.repeat(_MISSING)), self.values))
        )


class _StateEntries:
    """An optimizer's per-parameter state as a graph captured it: which parameters have a state
    dict, which dict object each has, and which value objects are in it. A replay runs no Python,
    so a state reset (`optimizer.state[p] = {}`, `.pop(p)`) or a replaced moment tensor would
    otherwise go unseen: the graph keeps updating the old tensors.

    Checked by identity: in C++ when the helper of `fastcheck.py` is built (~13 us for 1,000
    parameters with one value each; from Python 3.12 it watches the dicts and walks them only after
    one changed: a replay after no change costs nothing), else in four passes of Python's C loops
    (~120 us). No tensor is hashed.
    """

    __slots__ = ("dicts", "fast", "keys", "sizes", "state", "values")

    def __init__(self, state: dict):
        self.state = state
        self.keys = list(state)
        self.dicts = list(state.values())
        self.sizes = [len(d) for d in self.dicts]
        self.values = list(itertools.chain.from_iterable(d.values() for d in self.dicts))
        check = getattr(fastcheck.helper(), "StateCheck", None)  # a helper built before it lacks it
        plain = all(type(d) is dict for d in self.dicts)
        self.fast = check([state]) if check is not None and plain else None

    def holds(self) -> bool:
        if self.fast is not None:
            return self.fast.holds()
        state, dicts = self.state, self.dicts
        return (
            len(state) == len(dicts)
            and all(map(operator.is_, state.values(), dicts))
            and all(map(operator.is_, state, self.keys))
            and list(map(len, dicts)) == self.sizes
            and all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, dicts)), self.values))
        )


class OptimizerWatch:
    """The param groups of the optimizers a graph runs: same lists, same parameters, and the same
    Python hyperparameters (tensors in a group are read live by the graph)."""

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        everyone: list[torch.optim.Optimizer],
        unbaked: Callable[[torch.optim.Optimizer, str], bool],
    ):
        named = {
            id(o): "optimizer" if len(everyone) == 1 else f"optimizer[{i}]" for i, o in enumerate(everyone)
        }
        self.labels = [named[id(opt)] for opt in optimizers]
        self.optimizers = [
            (
                opt,
                opt.state,
                opt.param_groups,
                [
                    (g, g["params"], len(g["params"]), ignored, hyperparameters(g, ignored))
                    for g in opt.param_groups
                    for ignored in [frozenset(k for k in g if k != "params" and unbaked(opt, k))]
                ],
                len(opt.param_groups),
            )
            for opt in optimizers
        ]
        self.entries = [_StateEntries(opt.state) for opt in optimizers]
        self.seen = [_Seen(g) for *_, groups, _ in self.optimizers for g, *_ in groups]
        """Per group, the value objects last found equal: when every one is still there, nothing
        was assigned and no value needs comparing (the common replay)."""

    def holds(self) -> bool:
        seen = iter(self.seen)
        for (opt, state, groups_list, groups, n_groups), entries in zip(self.optimizers, self.entries):
            if opt.state is not state or opt.param_groups is not groups_list or len(groups_list) != n_groups:
                return False
            if not entries.holds():
                return False
            for group, params, n_params, ignored, hyper in groups:
                if group["params"] is not params or len(params) != n_params:
                    return False
                unchanged = next(seen)
                if not unchanged.holds():
                    if hyperparameters(group, ignored) != hyper:
                        return False
                    unchanged.renew()  # assigned, but equal (a scheduler's constant phase)
        return True

    def changes(self) -> list[Change]:
        found = []
        for label, (opt, state, groups_list, groups, n_groups), entries in zip(
            self.labels, self.optimizers, self.entries
        ):
            if opt.state is not state:
                found.append(Change(f"{label}.state: replaced (optimizer.load_state_dict?)"))
            elif not entries.holds():
                found.append(
                    Change(
                        f"{label}.state: a parameter's state was reset, added or replaced (optimizer.state[p] "
                        "= ..., a moment tensor swapped); the graph would keep updating the old tensors"
                    )
                )
            if opt.param_groups is not groups_list or len(opt.param_groups) != n_groups:
                found.append(Change(f"{label}.param_groups: groups added or replaced"))
                continue
            for gi, (group, params, n_params, ignored, hyper) in enumerate(groups):
                if group["params"] is not params or len(params) != n_params:
                    found.append(Change(f"{label}.param_groups[{gi}]: parameters added or removed"))
                now = hyperparameters(group, ignored)
                for key in sorted(set(now) | set(hyper)):
                    if now.get(key) != hyper.get(key):
                        text = (
                            f"{label}.param_groups[{gi}]['{key}']: {hyper.get(key)!r} -> {now.get(key)!r} "
                            "(a Python number is baked into the graph)"
                        )
                        found.append(Change(text, variant=True, optimizer=opt, key=key))
        return found

    def without_state(self, p: torch.Tensor) -> bool:
        """`p` trains now, and an optimizer of the graph will create its state on the next step."""
        return p.requires_grad and any(
            not opt.state.get(p) and any(q is p for g in opt.param_groups for q in g["params"])
            for opt, *_ in self.optimizers
        )
