"""`StateGuard`: one graph's guard over everything its replay silently depends on.

A CUDA graph remembers addresses and Python numbers. `StateGuard` records, when a graph is
captured, everything the replay silently depends on, and before every replay checks it still
holds:

- every state tensor (parameters, buffers, optimizer state, tensors the step reaches through
  the globals and closures of the code it ran) still has the same storage, shape, dtype and
  stride;
- every parameter's `requires_grad` is what it was (freezing and unfreezing layers);
- every `.grad` that outlives the step is still the same tensor (not replaced, not None);
- every module is in the mode (train/eval) it was captured in, and its Python attributes
  (`Dropout.p`, a temperature field, a flag; see `barriers.py`) hold the same values;
- optimizer param groups hold the same parameters and the same Python hyperparameters
  (a float lr, betas, eps, weight_decay, momentum, ...);
- globals and closure cells read by the user functions the step ran hold the same objects, and
  the same values where they are Python numbers, strings, tuples of those (see `reads.py`); the
  containers and data objects the step reads hold the same contents (see `contents.py`);
- no module had a parameter, buffer or submodule re-registered (`load_state_dict(assign=True)`,
  `model.fc = nn.Linear(...)`): a global registration hook bumps an epoch counter.

Cost per replay: module modes and attributes through a write barrier (free unless a watched
module was written), one pass over the tensors' data pointers and the parameters' `requires_grad`
(in C++ when the helper of `fastcheck.py` is built: ~10 us instead of ~120 us for 1,000
parameters), an identity test per optimizer group value (see `optimizer.py`) and a few reads per
global the step read. With the helper, a replay after no change checks all of it in one C++ pass
(`fastcheck.identity_check`: every object still the one seen; a replay's plan and guards take 3.9 us
instead of 7.5 for the tiny GPT on a 2-core CPU, benchmarks/results/cpu_2026-11-25_host-cost_*). Names and reasons are only worked out once something changed (`changes()`,
a list of `Change`).
Strong references are held, so memory a graph uses can never be freed under it.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn

from ..state import TrainingState, follow, storage_paths
from . import barriers, fastcheck
from .change import Change
from .module_inputs import ModuleInputs
from .optimizer import OptimizerWatch
from .read_guard import ReadGuard
from .reads import Reads
from .walk import is_unchanging

_data_ptr = torch.Tensor.data_ptr
_get_grad = operator.attrgetter("grad")
_get_requires_grad = operator.attrgetter("requires_grad")
_ptrs_equal_in_cpp = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_MAX_IDENTITY_BUILDS = 3
"""Identity passes built in a row, each after the Python path held, before a guard stops building them."""


def _same_data_ptrs(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:
    if _ptrs_equal_in_cpp is not None:
        return _ptrs_equal_in_cpp(tensors, ptrs, indices)
    return list(map(_data_ptr, tensors)) == ptrs


@dataclasses.dataclass
class _Tracked:
    name: str
    tensor: torch.Tensor
    """As the step sees it: a plain tensor, or a DTensor."""
    path: tuple[str, ...]
    """From `tensor` to the plain tensor holding the memory (see `storage_paths`)."""
    meta: tuple  # (data_ptr, shape, stride, dtype) of that plain tensor

    def storage(self) -> torch.Tensor:
        return follow(self.tensor, self.path)


def _meta(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def named_state_tensors(state: TrainingState, fn: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor that exists before the step and that the step can read or write, named."""
    names: dict[int, str] = {}
    for prefix, module in state.named_modules_roots():
        for name, p in module.named_parameters():
            names.setdefault(id(p), f"{prefix}.{name}")
            yield f"{prefix}.{name}", p
        for name, b in module.named_buffers():
            yield f"{prefix}.{name}", b
    for i, opt in enumerate(state.optimizers):
        label = "optimizer" if len(state.optimizers) == 1 else f"optimizer[{i}]"
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                param_name = names.get(id(p), f"param_groups[{gi}].params[{pi}]")
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        yield f"{label}.state[{param_name}].{key}", value
            for key, value in group.items():
                if isinstance(value, torch.Tensor):
                    yield f"{label}.param_groups[{gi}].{key}", value
                elif isinstance(value, (tuple, list)) and key != "params":
                    for j, v in enumerate(value):
                        if isinstance(v, torch.Tensor):
                            yield f"{label}.param_groups[{gi}].{key}[{j}]", v
    for label, _, value in bindings(fn):
        if isinstance(value, torch.Tensor):
            yield label, value


def trainable(state: TrainingState) -> list[bool]:
    """Which parameters require grad. The lifecycle compares it between the last warm-up and the
    capture: a parameter that starts training gets its optimizer state on its first step, and a
    capture of that step would replay the creation (momentum = grad) forever."""
    return [p.requires_grad for p in state.parameters()]


def bindings(fn: Callable) -> list[tuple[str, Callable[[], Any], Any]]:
    """Closure cells and globals of the step that hold tensors, modules, optimizers or generators.

    Each as `(label, read, object)`: `read()` gives what the name refers to now.
    """
    kinds = (torch.Tensor, nn.Module, torch.optim.Optimizer, torch.Generator)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not assigned yet
            continue
        if isinstance(value, kinds):
            found.append((f"closure variable {name!r}", lambda c=cell: c.cell_contents, value))
    module_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        value = module_globals.get(name)
        if isinstance(value, kinds):
            found.append((f"global {name!r}", lambda g=module_globals, n=name: g.get(n), value))
    return found


def _labelled_parameters(state: TrainingState, extra: list[tuple[str, nn.Module]]) -> dict[int, str]:
    names: dict[int, str] = {}
    for prefix, root in state.named_modules_roots() + extra:
        for name, p in root.named_parameters():
            names.setdefault(id(p), f"{prefix}.{name}")
    return names


class StateGuard:
    """What one captured graph depends on, and the check that it still holds.

    `reads`: what the step's Python read, from a `ReadWatch` around a run of the step (default:
    the step function's own globals and closure, from its bytecode). `eager_optimizers`:
    optimizers that run eagerly between graph replays; their hyperparameters and state are not
    the graph's business.
    """

    def __init__(
        self,
        state: TrainingState,
        fn: Callable,
        *,
        strict: bool,
        grads_before: list[tuple[torch.Tensor, torch.Tensor | None]],
        reads: Reads | None = None,
        eager_optimizers: Collection[torch.optim.Optimizer] = (),
        unbaked: Callable[[torch.optim.Optimizer, str], bool] = lambda opt, key: False,
        inputs: ModuleInputs | None = None,
    ):
        barriers.install()
        self.inputs = inputs
        """Input-like attributes of modules (a BlockMask): they fit the graph, or it does not hold."""
        self.epoch = barriers.structure_epoch
        self.strict = strict
        if reads is None or not reads.complete:
            reads = Reads.of_function(fn)
        owners = {
            id(m): name
            for prefix, root in state.named_modules_roots()
            for name, m in named_modules(prefix, root)
        }
        self.reads = ReadGuard(reads, owners)
        graph_state = dataclasses.replace(
            state, optimizers=[o for o in state.optimizers if not any(o is e for e in eager_optimizers)]
        )
        known = {id(m) for root in state.modules for m in root.modules()}
        extra = []
        for label, v in self.reads.reached():
            # An unchanging module (`graphstep.unchanging`: a DeepSpeed engine) is compared by identity
            # only: its Python attributes are not guarded (its parameters are its model's, given).
            if isinstance(v, nn.Module) and id(v) not in known and not is_unchanging(v):
                known.update(id(m) for m in v.modules())
                extra.append((label, v))
        named = list(named_state_tensors(graph_state, fn))
        named += [
            (f"{label}.{n}", t)
            for label, m in extra
            for n, t in itertools.chain(m.named_parameters(), m.named_buffers())
        ]
        named += [(label, v) for label, v in self.reads.reached() if isinstance(v, torch.Tensor)]
        seen: set[int] = set()
        named = [
            (n, t) for n, t in named if isinstance(t, torch.Tensor) and not (id(t) in seen or seen.add(id(t)))
        ]
        self.tracked = [
            _Tracked(n, t, path, _meta(follow(t, path))) for n, t in named for path in storage_paths(t)
        ]
        # Optimizer state is replaced wholesale (load_state_dict swaps `optimizer.state`, an O(1)
        # check); its thousands of tensors get a pointer check of their own only when strict.
        checked = [t for t in self.tracked if strict or ".state[" not in t.name]
        checked.sort(key=lambda t: bool(t.path))  # plain tensors first, then DTensors' shards
        self.tensors = [t.tensor for t in checked if not t.path]
        self.wrapped = [(t.tensor, t.path) for t in checked if t.path]
        """Read again on every check: a DTensor's local shard can be swapped under it."""
        self.metas = [t.meta for t in checked]
        self.ptrs = [t.meta[0] for t in checked if not t.path]
        self.wrapped_ptrs = [t.meta[0] for t in checked if t.path]
        self.indices = list(range(len(self.tensors)))
        self.param_names = _labelled_parameters(state, extra)
        self.param_names.update(
            (id(t.tensor), t.name) for t in self.tracked if id(t.tensor) not in self.param_names
        )
        # A graph reads a parameter's grad only if the grad existed before the step and the step
        # accumulated into it (still the same tensor after). If the grad did not exist, the graph
        # writes a fresh one: replaying it is right only while the grad is None before the call.
        grad_reads = [(p, g) for p, g in grads_before if g is not None and p.grad is g]
        self.grad_params = [p for p, _ in grad_reads]
        self.grads = [g for _, g in grad_reads]
        self.fresh_grad_params = [p for p, g in grads_before if g is None and p.grad is not None]
        parameters = state.parameters()
        parameters += [p for _, m in extra for p in m.parameters() if not any(p is q for q in parameters)]
        self.requires_grad = [p for p in parameters if p.requires_grad]
        self.frozen = [p for p in parameters if not p.requires_grad]
        helper = fastcheck.helper()
        self.fast = helper.TensorCheck(self.tensors, self.requires_grad, self.frozen) if helper else None
        """The same reads as `_tensors_hold()`, in C++, when the helper is built (see fastcheck.py)."""
        roots = state.named_modules_roots() + extra
        self.modules = barriers.ModuleWatch(
            [nm for prefix, root in roots for nm in named_modules(prefix, root, graphed_only=True)],
            scan=strict,
            skip=reads.module_writes,
        )
        for name, attrs in zip(self.modules.names, self.modules.attrs):
            for key, (value, by_value) in attrs.items():
                if not by_value:  # a config dataclass kept as `self.config`, say
                    self.reads.watch_fields(f"{name}.{key}", value)
        self.optimizers = OptimizerWatch(graph_state.optimizers, state.optimizers, unbaked)
        self.parameter_ids = [id(p) for p in state.parameters()]
        self.roots = [root for _, root in roots]
        self.module_ids = self._module_ids()
        self.state = state
        self._identity: Any = None
        self._identity_builds = 0

    # -- the check on every replay ---------------------------------------------------------

    def holds(self) -> bool:
        """True when a replay would do what eager would. Cheap; no messages. Grads the user set to
        None between calls are re-attached (zeroed) here rather than reported, last, once all else
        holds: probing the guard of a graph that does not fit has no side effect.

        The common replay, where every object the guard compares is the one it saw, is one C++
        pass (`identity_check`); anything else takes the Python path, which adopts equal values.
        After it held, the pass is made again over the objects now seen, unless that happened
        `_MAX_IDENTITY_BUILDS` times in a row (a loop that rebinds an equal value every call)."""
        if self.inputs is not None and not self.inputs.fit():
            return False
        identity = self._identity
        if identity is not None and identity.holds():
            self._identity_builds = 0
            return True
        held = self._holds()
        if held and self._identity_builds < _MAX_IDENTITY_BUILDS:
            self._identity_builds += 1
            self._identity = fastcheck.identity_check(identities(self), barriers.MISSING)
        elif self._identity_builds >= _MAX_IDENTITY_BUILDS:
            self._identity = None
        return held

    def _holds(self) -> bool:
        if self.epoch != barriers.structure_epoch:
            return False
        if not self.modules.holds() or not self.reads.holds() or not self.optimizers.holds():
            return False
        if self.fresh_grad_params and any(g is not None for g in map(_get_grad, self.fresh_grad_params)):
            return False
        if self.fast is not None:
            if not self.fast.holds():  # data pointers and requires_grad, in C++
                return False
        elif not self._tensors_hold():
            return False
        if self.wrapped and [_data_ptr(follow(t, path)) for t, path in self.wrapped] != self.wrapped_ptrs:
            return False
        if self.strict:
            tensors = self.tensors + [follow(t, path) for t, path in self.wrapped]
            if [_meta(t) for t in tensors] != self.metas:
                return False
        grads_kept = not self.grads or all(map(operator.is_, map(_get_grad, self.grad_params), self.grads))
        return grads_kept or self._restore_cleared_grads()

    def _tensors_hold(self) -> bool:
        """The pure-Python path: one read per parameter and per plain tensor."""
        if not all(map(_get_requires_grad, self.requires_grad)) or any(map(_get_requires_grad, self.frozen)):
            return False
        return not self.tensors or _same_data_ptrs(self.tensors, self.ptrs, self.indices)

    def _restore_cleared_grads(self) -> bool:
        """Grads set to None between calls (`zero_grad()` outside the step): eager would start
        from zero, so zero the graph's grad buffers in place and attach them again. Any other
        replacement cannot be absorbed: False."""
        cleared = []
        for p, g in zip(self.grad_params, self.grads):
            if p.grad is None:
                cleared.append((p, g))
            elif p.grad is not g:
                return False
        with torch.no_grad():
            torch._foreach_zero_([g for _, g in cleared])
        for p, g in cleared:
            p.grad = g
        return True

    # -- the slow path: what changed, by name ------------------------------------------------

    def changes(self) -> list[Change]:
        """Why the guard fails, by qualified name; empty when nothing this graph depends on changed."""
        found = self._tensor_changes()
        requiring = {id(p) for p in self.requires_grad}
        for p in self.requires_grad + self.frozen:
            was = id(p) in requiring
            if p.requires_grad != was:
                name = self.param_names.get(id(p), "a parameter")
                text = f"{name}: requires_grad {was} -> {p.requires_grad}"
                found.append(Change(text, variant=True, warm_up=self.optimizers.without_state(p)))
        found += [Change(text, variant) for text, variant in self.modules.changes()]
        found += self.inputs.changes() if self.inputs is not None else []
        found += self.optimizers.changes()
        found += [Change(text, variant) for text, variant in self.reads.changes()]
        if self.epoch != barriers.structure_epoch:
            if [id(p) for p in self.state.parameters()] != self.parameter_ids:
                found.append(
                    Change(
                        "a module's parameters were replaced or re-registered (setattr, load_state_dict(assign=True))"
                    )
                )
            elif self._module_ids() != self.module_ids:
                found.append(
                    Change("a submodule was replaced, added or removed (model.drop = nn.Dropout(...))")
                )
            elif not found:
                # Something was registered somewhere in the process, but not in this step's modules.
                self.epoch = barriers.structure_epoch
        return found

    def _module_ids(self) -> list[int]:
        return [id(m) for root in self.roots for m in root.modules()]

    def _tensor_changes(self) -> list[Change]:
        found = []
        for item in self.tracked:
            t = item.storage()
            ptr, shape, stride, dtype = item.meta
            if t.data_ptr() != ptr:
                found.append(
                    Change(
                        f"{item.name}: storage moved (param.data reassigned, or load_state_dict replaced it)"
                    )
                )
            elif (tuple(t.shape), t.stride(), t.dtype) != (shape, stride, dtype):
                found.append(
                    Change(
                        f"{item.name}: shape/stride/dtype changed from {list(shape)} {dtype} to {list(t.shape)} {t.dtype}"
                    )
                )
        for p, grad in zip(self.grad_params, self.grads):
            if p.grad is not None and p.grad is not grad:
                found.append(
                    Change(
                        f"{self.param_names.get(id(p), 'a parameter')}.grad: replaced by another tensor (the graph "
                        "accumulates into the old one)"
                    )
                )
        for p in self.fresh_grad_params:
            if p.grad is not None:
                found.append(
                    Change(
                        f"{self.param_names.get(id(p), 'a parameter')}.grad: exists now, but the graph was captured "
                        "without one and would overwrite it instead of accumulating"
                    )
                )
        return found


def identities(guard: StateGuard) -> list | None:
    """`guard._holds()`'s common case as `fastcheck` entries (None: a part only Python checks)."""
    if guard.wrapped or guard.strict or guard.fast is None:
        return None  # (a pass holding `guard._tensors_hold` would keep the guard alive in a cycle)
    reads = guard.reads.identities()
    if reads is None:
        return None
    return [
        (fastcheck.ITEM, vars(barriers), "structure_epoch", guard.epoch),
        (fastcheck.TRUE, guard.modules.holds, None, None),
        *reads,
        (fastcheck.TRUE, guard.optimizers.holds, None, None),
        *[(fastcheck.ATTR, p, "grad", None) for p in guard.fresh_grad_params],
        (fastcheck.TRUE, guard.fast.holds, None, None),
        *[(fastcheck.ATTR, p, "grad", g) for p, g in zip(guard.grad_params, guard.grads)],
    ]


def holds_parts(guard: StateGuard) -> dict[str, Callable[[], Any]]:
    """The parts of `guard.holds()`, one callable each, to time them (benchmarks/guard_cost.py).
    Keep in step with `holds()`."""
    parts = {
        "structure_epoch": lambda: guard.epoch == barriers.structure_epoch,
        "modules_modes_attributes": guard.modules.holds,
        "reads": guard.reads.holds,
        "optimizers": guard.optimizers.holds,
        "grads": lambda: (
            all(map(operator.is_, map(_get_grad, guard.grad_params), guard.grads))
            and not any(g is not None for g in map(_get_grad, guard.fresh_grad_params))
        ),
        "requires_grad": lambda: (
            all(map(_get_requires_grad, guard.requires_grad))
            and not any(map(_get_requires_grad, guard.frozen))
        ),
        "pointers": lambda: _same_data_ptrs(guard.tensors, guard.ptrs, guard.indices),
    }
    if guard.fast is not None:
        parts["pointers_and_requires_grad_cpp"] = guard.fast.holds
    if guard._identity is not None:  # all of the above in one pass, as a replay after no change runs them
        parts["identity_pass_cpp"] = guard._identity.holds
    return parts


def named_modules(
    prefix: str, root: nn.Module, *, graphed_only: bool = False
) -> Iterator[tuple[str, nn.Module]]:
    """`root` and its submodules, named from `prefix` (`model`, `model.encoder.0`, ...). `graphed_only`:
    without the eager segments among them and their submodules (`graphstep.eager_segment`, graph
    breaks): their forward runs eagerly on every replay and reads its attributes and mode itself."""
    segments: list[str] = []
    for name, m in root.named_modules():
        if graphed_only and any(not s or name == s or name.startswith(s + ".") for s in segments):
            continue
        if graphed_only and hasattr(m.__dict__.get("forward"), SEGMENT_MARK):
            segments.append(name)
            continue
        yield (f"{prefix}.{name}" if name else prefix), m


SEGMENT_MARK = "_graphstep_segment_of"
"""The attribute the `forward` of a module marked as an eager segment carries (its original forward)."""
