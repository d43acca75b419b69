"""`graphstep.capture`: the public verb, and `CapturedStep`, the thin face that dispatches.

A call is keyed by its input signature (see `signature.py`); each signature has its own
`Lifecycle` (warm-up -> capture -> replay, variants, re-captures: `lifecycle.py`). Here: setting
up on the first call (backend, ranks, optimizers), picking the lifecycle, the ranks' vote, and
the fallback past `Config.max_graphs`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import distributed, teardown
from . import signature as sig
from .backends.base import Backend
from .backends.cuda import CudaGraphBackend
from .backends.eager import EagerBackend
from .backends.recording import RecordingBackend
from .config import Config
from .diagnostics import (
    StepStats,
    changing_argument_message,
    eager_fallback_message,
    log,
    too_many_graphs_message,
)
from .distributed.ranks import Agreement, Phase
from .errors import ChangingArgumentError, ClosedError, GraphStepError, TooManyGraphsError
from .guards.state_guard import bindings
from .lifecycle import Lifecycle
from .optim.adapter import OptimizerAdapter
from .signature import Signature
from .state import TrainingState, as_list
from .step_context import StepContext

_ALONE = Agreement(Phase.REPLAY, None, None)  # a replay with no other rank to agree with
_MAX_EAGER_KEYS = 1024  # signatures remembered (to warn once each) after an eager fallback
_CHURN_CALLS = 4  # calls in a row, each with a new value of one Python number argument, before saying so


def capture(
    fn: Callable | None = None,
    *,
    model: torch.nn.Module | list[torch.nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    generators: list[torch.Generator] | None = None,
    share_pool_with: CapturedStep | None = None,
    process_group: Any = None,
    config: Config | None = None,
) -> Any:
    """Capture a whole training step into CUDA graphs.

    Use as `@graphstep.capture`, `@graphstep.capture(model=m, optimizer=opt)`, or
    `graphstep.capture(step_fn, ...)`. `model` and `optimizer` tell graphstep which state the
    step trains; modules and optimizers in the step's closure or globals are found too.
    `generators`: CUDA `torch.Generator`s the step draws from (those in its closure or globals
    are found); the graph advances them on every replay as eager would. `share_pool_with`:
    another captured step (an evaluation step beside the training step) whose memory pool and
    capture stream this one uses; call that one first. `process_group`: the ranks that call
    this step together (default: every rank, once torch.distributed is initialised); they
    warm up, capture and re-capture together. Returns a `CapturedStep` that keeps `fn`'s
    signature.
    """
    options = dict(model=model, optimizer=optimizer, generators=generators)
    options.update(share_pool_with=share_pool_with, process_group=process_group, config=config)
    if fn is None:
        return functools.partial(capture, **options)
    return CapturedStep(fn, **options)


class CapturedStep:
    """A training step that runs as CUDA graph replays. Create it with `graphstep.capture`."""

    def __init__(
        self,
        fn: Callable,
        *,
        model: Any = None,
        optimizer: Any = None,
        generators: list[torch.Generator] | None = None,
        share_pool_with: CapturedStep | None = None,
        process_group: Any = None,
        config: Config | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"graphstep.capture needs a function to capture; got {type(fn).__qualname__}.")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a graphstep.Config; got {type(config).__qualname__}.")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.config = config or Config()
        self._state = TrainingState(
            modules=as_list(model, torch.nn.Module, "model"),
            optimizers=as_list(optimizer, torch.optim.Optimizer, "optimizer"),
        )
        self._lives: dict[Signature, Lifecycle] = {}
        self._eager_keys: set[Signature] = set()
        self._new_in_a_row: list[Signature] = []
        """Signatures of the last calls, while each call brought a new one (see `_check_churn`)."""
        self._churn_warned = False
        self._ctx: StepContext | None = None  # set up on the first call
        self._generators = list(generators or [])
        if share_pool_with is not None and not isinstance(share_pool_with, CapturedStep):
            raise TypeError(
                f"share_pool_with takes a CapturedStep; got {type(share_pool_with).__qualname__}."
            )
        self._share = share_pool_with
        self._process_group = process_group
        self._stats = StepStats()
        self._busy: int | None = None  # the thread running a call
        self._closed = False
        teardown.opened(self)

    # -- public surface ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ClosedError(f"{self._name} was closed; capture the function again to keep training.")
        if self._busy is not None:
            if self._busy != threading.get_ident():
                raise GraphStepError(
                    f"{self._name} was called from a second thread while a call is running in another; "
                    "a captured step is not thread-safe: call it from one thread."
                )
            raise GraphStepError(f"{self._name} was called from inside itself; a step cannot nest.")
        self._busy = threading.get_ident()
        try:
            return self._call(args, kwargs)
        except BaseException as exc:
            if self._ctx is not None and self._ctx.ranks is not None:
                self._ctx.ranks.note_failure(exc)  # the next vote tells the other ranks
            raise
        finally:
            self._busy = None

    @property
    def stats(self) -> StepStats:
        """A copy of the counters, with the graphs alive and the pool's size read now."""
        pool = self._ctx.backend.pool_bytes() if self._ctx is not None else 0
        return dataclasses.replace(self._stats, graphs_alive=self._graphs_alive(), pool_bytes=pool)

    @property
    def group(self) -> Any:
        """The process group whose ranks run this step together; None for one process (or
        before the first call)."""
        return self._ctx.ranks.group if self._ctx is not None and self._ctx.ranks is not None else None

    @property
    def backend_name(self) -> str | None:
        """ "cuda", "eager" or "recording" once the first call chose; None before."""
        return self._ctx.backend.name if self._ctx is not None else None

    def input_buffers(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """The static input buffers for calls shaped like `args, kwargs`, as `(args, kwargs)`.

        Write the next batch into them in place (`buf.copy_(batch)`, or a loader writing there)
        and pass them back: a call with the buffers themselves copies nothing.
        """
        signature, leaves = Signature.of(args, kwargs)
        self._context_for(leaves)
        life = self._lifecycle(signature)
        if life is None:
            raise TooManyGraphsError(self._too_many_message(signature))
        return sig.unflatten(signature.spec, life.inputs.like(leaves))

    def reset(self) -> None:
        """Drop every graph; the next call of each signature warms up again."""
        for life in self._lives.values():
            life.release()
        self._lives.clear()
        self._eager_keys.clear()
        if self._ctx is not None and not self._closed:
            self._ctx.renew_pool_if_unused()

    def close(self) -> None:
        """Release the graphs and the memory pool. Needed before `destroy_process_group`."""
        if self._closed:
            return
        self.reset()
        if self._ctx is not None:
            backend = self._ctx.backend
            backend.users -= 1
            if backend.users <= 0:  # the last step sharing it
                backend.close()
        self._closed = True
        teardown.closed(self)

    def __enter__(self) -> CapturedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<graphstep.CapturedStep {self._name} backend={self.backend_name} graphs={self._graphs_alive()}>"
        )

    # -- dispatch ------------------------------------------------------------------------------

    @property
    def _name(self) -> str:
        return getattr(self._fn, "__qualname__", repr(self._fn))

    def _call(self, args: tuple, kwargs: dict) -> Any:
        signature, leaves = Signature.of(args, kwargs)
        ctx = self._context_for(leaves)
        ctx.optim.before_call()  # a float lr a scheduler assigned goes into the graph's tensor
        life = self._lifecycle(signature)
        if life is None:
            if ctx.ranks is None:
                return self._run_eager_fallback(signature, args, kwargs)
            agreed = ctx.ranks.agree(Phase.EAGER, False, self._name)  # the others step eagerly too
            with ctx.ranks.together(self._name, agreed, self._state.modules):
                return self._run_eager_fallback(signature, args, kwargs)
        plan = life.plan()
        if ctx.ranks is None:
            if plan.phase is Phase.REPLAY:
                return life.act(plan, _ALONE, leaves, args, kwargs)
            agreed = Agreement(plan.phase, None, 0 if plan.limited else None)
            return life.act(plan, agreed, leaves, args, kwargs)
        agreed = ctx.ranks.agree(plan.phase, plan.limited, self._name)  # all act on the least advanced
        if agreed.phase is Phase.REPLAY:
            return life.act(plan, agreed, leaves, args, kwargs)
        with ctx.ranks.together(self._name, agreed, self._state.modules):  # collectives checked
            return life.act(plan, agreed, leaves, args, kwargs)

    def _run_eager_fallback(self, signature: Signature, args: tuple, kwargs: dict) -> Any:
        """Past `max_graphs` with `on_too_many_graphs="eager"`: warn once per signature."""
        if signature not in self._eager_keys and len(self._eager_keys) < _MAX_EAGER_KEYS:
            self._eager_keys.add(signature)
            message = eager_fallback_message(self._name, self.config.max_graphs, signature)
            warnings.warn(message, stacklevel=4)
            log.warning(message)
        return self._ctx.run_eager(args, kwargs)

    def _context_for(self, leaves: list[torch.Tensor]) -> StepContext:
        """Set up on the first call: ranks, the state found in the closure, backend, optimizers."""
        if self._ctx is not None:
            return self._ctx
        ranks = distributed.ranks_for(self._process_group)  # first: it may refuse
        # Modules and optimizers the step reaches through its closure or globals are state too.
        found = self._state.discover((label, value) for label, _, value in bindings(self._fn))
        self._generators += [g for g in found if not any(g is known for known in self._generators)]
        optim = OptimizerAdapter(self._state.optimizers, allow_eager=self.config.optimizer_mode != "graph")
        if self._share is not None:
            if self._share._ctx is None:
                raise GraphStepError(
                    f"{self._name} shares the pool of {self._share._name}, which has not run yet: "
                    "call that step once first."
                )
            backend = self._share._ctx.backend
        else:
            backend = choose_backend(self.config, leaves, self._state, self._name)
        backend.users += 1
        if ranks is not None and isinstance(backend, CudaGraphBackend):
            distributed.check_nccl_graph_registration(ranks.group)
        warmups = self.config.warmup_steps
        if distributed.prepare_ddp(self._state.modules):
            warmups = max(warmups, distributed.DDP_WARMUP_STEPS)
        if backend.static_buffers:  # graphs: capturable optimizers, lr as a tensor
            optim.prepare(getattr(backend, "device", "cpu"))
        self._ctx = StepContext(
            fn=self._fn,
            name=self._name,
            config=self.config,
            state=self._state,
            backend=backend,
            optim=optim,
            stats=self._stats,
            generators=self._generators,
            ranks=ranks,
            warmups_needed=warmups,
            graphs_alive=self._graphs_alive,
        )
        if self.config.optimizer_mode == "eager" and backend.static_buffers:
            self._ctx.move_to_eager(list(self._state.optimizers), 'Config(optimizer_mode="eager")')
        return self._ctx

    def _lifecycle(self, signature: Signature) -> Lifecycle | None:
        """The lifecycle of `signature`, made if there is room; None means: run eagerly."""
        life = self._lives.get(signature)
        if life is not None:
            if self._new_in_a_row:
                self._new_in_a_row.clear()
            return life
        self._check_churn(signature)
        if len(self._lives) >= self.config.max_graphs:
            if self.config.on_too_many_graphs == "raise":
                raise TooManyGraphsError(self._too_many_message(signature))
            return None
        life = self._lives[signature] = Lifecycle(self._ctx, signature)
        return life

    def _check_churn(self, signature: Signature) -> None:
        """A Python number argument with a new value on each of the last few calls (an iteration
        index) would warm up a graph per value and spend `max_graphs` without replaying once: say
        so after a few, naming the argument."""
        run = self._new_in_a_row
        run.append(signature)
        needed = max(2, min(_CHURN_CALLS, self.config.max_graphs + 1))
        del run[:-needed]
        found = sig.changing_number(run) if len(run) == needed else None
        if found is None:
            return
        message = changing_argument_message(self._name, *found)
        if self.config.on_too_many_graphs == "raise":
            run.clear()
            raise ChangingArgumentError(message)
        if not self._churn_warned:  # on_too_many_graphs="eager": the user accepts eager calls
            self._churn_warned = True
            log.warning(message)

    def _graphs_alive(self) -> int:
        return sum(life.graphs() for life in self._lives.values())

    def _too_many_message(self, signature: Signature) -> str:
        return too_many_graphs_message(self._name, self.config.max_graphs, list(self._lives), signature)


def choose_backend(config: Config, leaves: list[torch.Tensor], state: TrainingState, name: str) -> Backend:
    """The backend a step runs on, from the config and where its tensors live."""
    if config.backend == "eager":
        return EagerBackend()
    if config.backend == "recording":
        return RecordingBackend()
    devices = {t.device for t in leaves} | state.devices()
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if len({d.index for d in cuda}) > 1:
        raise GraphStepError(
            f"{name}'s tensors are on several CUDA devices ({', '.join(map(str, cuda))}); one captured step "
            "runs on one device. Use one process per GPU (DDP, FSDP) instead."
        )
    if cuda and torch.cuda.is_available():
        return CudaGraphBackend(cuda[0])
    if config.backend == "cuda":
        raise GraphStepError(
            f'Config(backend="cuda") but {name} has no CUDA tensors (inputs, model= or optimizer=) '
            f"or CUDA is not available (torch.cuda.is_available() = {torch.cuda.is_available()})."
        )
    reason = "CUDA is not available" if not torch.cuda.is_available() else "the step's tensors are on the CPU"
    if not devices:
        reason = "graphstep sees no tensors (pass model=, optimizer= or tensor arguments)"
    log.info("graphstep: %s, so %s runs eagerly (same API and checks, no graphs).", reason, name)
    return EagerBackend()
