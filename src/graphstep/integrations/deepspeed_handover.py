"""What the captured part of a DeepSpeed step hands `engine.step()` in Python, for the integration
(`graphstep.integrations.deepspeed`): found by comparing DeepSpeed's state as the step began with its
state at `engine.step()`, and put back before the step's eager segment on every replay, where no Python
ran before it.

DeepSpeed's state is every attribute of the engine, its ZeRO optimizer and the DeepSpeed objects and
parameters they hold, and the contents of the lists and dicts among them, a few levels down (`places`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import effects

_DEPTH = 4
_PLAIN = (bool, int, float, str, type(None))


def places(roots: tuple) -> tuple[dict[tuple, tuple], set[int]]:
    """The Python state DeepSpeed keeps under `roots` (the engine, its ZeRO optimizer): every attribute
    of theirs and of DeepSpeed's objects they hold, and the contents of every list and dict among
    them, `_DEPTH` levels down. Returns {place: (holder, name or None, value or contents)} and the
    ids of the objects walked."""
    found: dict[tuple, tuple] = {}
    seen: set[int] = set()
    stack = [(root, 0) for root in roots]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj) is list:
            children = list(obj)
            found["items", id(obj)] = (obj, None, children)
        elif type(obj) is dict:
            contents = dict(obj)
            found["items", id(obj)] = (obj, None, contents)
            children = list(contents.values())
        else:
            attributes = vars(obj)
            for name, value in attributes.items():
                found["attr", id(obj), name] = (obj, name, value)
            children = list(attributes.values())
        if depth < _DEPTH:
            stack += [(c, depth + 1) for c in children if _walked(c)]
    return found, seen


def _walked(value: Any) -> bool:
    t = type(value)
    if t is list or t is dict or t is torch.nn.Parameter:  # a parameter: ZeRO's `grad_accum` on it
        return True
    return t.__module__.startswith("deepspeed.") and not isinstance(value, (torch.nn.Module, torch.Tensor))


def _same(a: Any, b: Any) -> bool:
    if type(a) in (list, dict) and type(b) is type(a):
        if len(a) != len(b):
            return False
        if type(a) is dict:
            return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
        return all(_same(x, y) for x, y in zip(a, b))
    return a is b or (type(a) is type(b) and type(a) in _PLAIN and a == b)


def put(holder: Any, name: str | None, value: Any) -> None:
    if name is not None:
        holder.__dict__[name] = value
    elif type(holder) is list:
        holder[:] = value
    else:
        holder.clear()
        holder.update(value)


class Handover:
    """The Python state the captured part of a step left for `engine.step()`: every place under the
    engine and its ZeRO optimizer it changed since the step began, and the contents of the containers
    it made. A replay runs no Python before the step's segment: the segment puts these back first."""

    def __init__(self, roots: tuple, before: tuple[dict[tuple, tuple], set[int]]) -> None:
        was, existed = before
        now, _ = places(roots)
        self.places = [(holder, name) for holder, name, _ in now.values()]
        """Every place under the engine and its ZeRO optimizer, changed or not."""
        changed = [key for key, entry in now.items() if key in was and not _same(was[key][2], entry[2])]
        # New places: an attribute added, the contents of a container the captured part made.
        made = [
            key
            for key, (holder, _, _) in now.items()
            if key not in was and (key[0] == "attr" or id(holder) not in existed)
        ]
        self.now = [
            (holder, name, _copied(value)) for holder, name, value in (now[k] for k in changed + made)
        ]
        """(holder, attribute or None, value or contents) as the captured part left them."""
        self.was = [was[key] for key in changed]
        """The same places as the step began (those that existed then)."""
        self.added = [now[key][:2] for key in made if key[0] == "attr"]
        self.removed = [was[key] for key in was if key not in now and key[0] == "attr"]
        """Attributes the captured part added or deleted."""
        # ZeRO moves gradients into its buckets and partitions with `grad.data = view`: the tensor stays,
        # its memory changes. A later capture may move the same tensor again; each replay's segment
        # finds every tensor of the hand-over (and the parameters' gradients) on the memory it had here.
        self.memory = [(t, t.detach()) for t in _tensors(now.values(), roots)]

    def roll_back(self) -> None:
        """Put the places the captured part changed back as they were when the step began."""
        for holder, name, value in self.was:
            put(holder, name, _copied(value))
        for holder, name in self.added:
            holder.__dict__.pop(name, None)
        for holder, name, value in self.removed:
            holder.__dict__[name] = value

    def redone(self) -> None:
        """Tell the capture's write watch that DeepSpeed's state is this hand-over's to judge: every place
        the captured part changed is set again before each replay's segment, and the others were left as
        they were. The watch traces the calling thread only; on a GPU autograd runs ZeRO's gradient hooks
        on its own thread, so it would see a place's last write without the first (`ready_for_gradients`
        set by a hook, cleared in the epilogue) and judge a change where there is none. The comparison
        of this hand-over (the state as the step began against the state now) sees every thread's."""
        for holder, name in self.places:
            effects.redone_on_replays(holder, name)
        for holder, name, _ in self.removed:
            effects.redone_on_replays(holder, name)

    def step(self, real: Callable, *args: Any) -> None:
        """`engine.step()` after putting back what the captured part left (a replay's segment)."""
        for holder, name, value in self.now:
            put(holder, name, _copied(value))
        for holder, name, _ in self.removed:
            holder.__dict__.pop(name, None)
        for t, memory in self.memory:
            if t.data_ptr() != memory.data_ptr() or t.shape != memory.shape or t.stride() != memory.stride():
                t.data = memory
        real(*args)


def _tensors(entries: Any, roots: tuple) -> list[torch.Tensor]:
    """The tensors among the places' values (and one level into lists and dicts), and the gradients
    of the engine's parameters, each once."""
    found: dict[int, torch.Tensor] = {}
    for _, _, value in entries:
        items = value if type(value) is list else value.values() if type(value) is dict else [value]
        for item in items:
            inner = item if type(item) is list else item.values() if type(item) is dict else [item]
            found.update((id(t), t) for t in inner if isinstance(t, torch.Tensor))
    for p in roots[0].parameters():
        if p.grad is not None:
            found[id(p.grad)] = p.grad
    return list(found.values())


def _copied(value: Any) -> Any:
    return list(value) if type(value) is list else dict(value) if type(value) is dict else value
