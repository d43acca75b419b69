"""`graphstep.capture`: the public verb, and `CapturedStep`, the thin face that dispatches.

A call goes down, never back up: its input signature (`signature.py`) picks a `Lifecycle`
(`lifecycle.py`: plan, the ranks' agreement, then warm-up, capture or replay), or an `Overflow`
(here: every call eager) past `Config.max_graphs`; what all signatures share is set up once, on the first call, by
`StepContext.open` (`step_context.py`). Here: the public surface, and that dispatch.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import signature as sig
from . import teardown
from .config import Config
from .diagnostics import (
    StepStats,
    changing_argument_message,
    eager_fallback_message,
    log,
    too_many_graphs_message,
)
from .distributed.ranks import Phase
from .errors import ChangingArgumentError, ClosedError, GraphStepError, TooManyGraphsError
from .guards import fastcheck
from .integrations import transformer_engine
from .lifecycle import Lifecycle
from .signature import Signature
from .state import TrainingState, as_list
from .step_context import StepContext, shared_backend_of

_MAX_OVERFLOWS = 1024  # signatures past max_graphs remembered, to warn once each
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
        self._overflows: dict[Signature, Overflow] = {}
        self._new_in_a_row: list[Signature] = []
        """Signatures of the last calls, while each call brought a new one (see `_check_churn`)."""
        self._churn_warned = False
        call_key = getattr(fastcheck.helper(), "CallKey", None)
        self._last_key = call_key(torch.Tensor) if call_key is not None else None
        """The last call's tensor arguments (C++), to pick its lifecycle again without a Signature."""
        self._last_life: Lifecycle | Overflow | None = None
        self._ctx: StepContext | None = None  # set up on the first call
        self._generators = list(generators or [])
        if share_pool_with is not None and not isinstance(share_pool_with, CapturedStep):
            raise TypeError(
                f"share_pool_with takes a CapturedStep; got {type(share_pool_with).__qualname__}."
            )
        self._share = share_pool_with
        self._process_group = process_group
        self._stats = StepStats()
        self._library_state: Callable[[], Any] | None = None  # read at each call's start and end (below)
        self._library_state_seen: Any = None
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
            if self._library_state is not None:
                self._library_state_seen = self._library_state()

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
        signature = self._context_for(leaves).loose.rekey(signature)
        life = self._lifecycle(signature)
        if isinstance(life, Overflow):
            raise TooManyGraphsError(self._too_many_message(signature))
        return sig.unflatten(signature.spec, life.inputs.like(leaves))

    def reset(self) -> None:
        """Drop every graph; the next call of each signature warms up again."""
        for life in self._lives.values():
            life.release()
        self._lives.clear()
        self._overflows.clear()
        self._last_life = None
        if self._ctx is not None and not self._closed:
            self._ctx.renew_pool_if_unused()

    def close(self) -> None:
        """Release the graphs and the memory pool. Needed before `destroy_process_group`."""
        if self._closed:
            return
        self.reset()
        if self._ctx is not None:
            self._ctx.breaks.close()
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
        if self._library_state is not None and self._library_state() != self._library_state_seen:
            self._library_state_changed()
        life = self._last_life
        if life is not None and self._last_key.matches(args, kwargs):  # the same signature as the last call
            if self._new_in_a_row:
                self._new_in_a_row.clear()
            self._ctx.optim.before_call()
            return life.call(list(args), args, kwargs)
        signature, leaves = Signature.of(args, kwargs)
        ctx = self._ctx if self._ctx is not None else self._context_for(leaves)
        signature = ctx.loose.rekey(signature)  # arguments used only in eager segments: not keyed by shape
        ctx.optim.before_call()  # a float lr a scheduler assigned goes into the graph's tensor
        life = self._lifecycle(signature)
        if (
            self._last_key is not None
            and signature.spec is sig.flat_spec(len(args))
            and signature.aliases is None
        ):
            self._last_key.remember(args)  # plain tensor arguments only (a Parameter never matches)
            self._last_life = life
        else:
            self._last_life = None
        return life.call(leaves, args, kwargs)

    def _library_state_changed(self) -> None:
        """TE's FP8 amax buffers changed between calls (a module joined, or a reset): a graph's reduction
        covers the modules registered at its capture (`integrations/transformer_engine.py`). Capture again."""
        if self._lives:
            log.info(
                "%s: Transformer Engine's FP8 amax buffers changed since the last call (a module was added to "
                "them, or they were reset): the step is warmed up and captured again, its amax reductions "
                "covering every registered module as eager's do.",
                self._name,
            )
            self.reset()

    def _context_for(self, leaves: list[torch.Tensor]) -> StepContext:
        if self._ctx is None:
            if transformer_engine.te_imported():
                self._library_state = transformer_engine.amax_membership
            shared = None
            if self._share is not None:
                shared = shared_backend_of(self._name, self._share._name, self._share._ctx)
            self._ctx = StepContext.open(
                self._fn,
                self._name,
                self.config,
                self._state,
                leaves=leaves,
                generators=self._generators,
                shared_backend=shared,
                process_group=self._process_group,
                stats=self._stats,
                graphs_alive=self._graphs_alive,
            )
        return self._ctx

    def _lifecycle(self, signature: Signature) -> Lifecycle | Overflow:
        """The lifecycle of `signature`, made if there is room under `max_graphs`; past it, an
        `Overflow` that runs the signature eagerly (or `TooManyGraphsError`)."""
        life = self._lives.get(signature) or self._overflows.get(signature)
        if life is not None:
            if self._new_in_a_row:
                self._new_in_a_row.clear()
            return life
        self._check_churn(signature)
        if len(self._lives) < self.config.max_graphs:
            life = self._lives[signature] = Lifecycle(self._ctx, signature)
            return life
        if self.config.on_too_many_graphs == "raise":
            raise TooManyGraphsError(self._too_many_message(signature))
        # Remembered (to warn once each) up to a bound: a step called with ever new signatures
        # must not grow without end.
        remember = len(self._overflows) < _MAX_OVERFLOWS
        overflow = Overflow(self._ctx, signature, warn=remember, stacklevel=5)  # the user's call
        if remember:
            self._overflows[signature] = overflow
        return overflow

    def _graphs_alive(self) -> int:
        return sum(life.graphs() for life in self._lives.values())

    def _check_churn(self, signature: Signature) -> None:
        """A Python number argument with a new value on each of the last few calls (an iteration
        index) would warm up a graph per value and spend `max_graphs` without replaying once: say
        so after a few, naming the argument, before this call runs."""
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

    def _too_many_message(self, signature: Signature) -> str:
        return too_many_graphs_message(self._name, self.config.max_graphs, list(self._lives), signature)


class Overflow:
    """A signature past `Config.max_graphs` with `on_too_many_graphs="eager"`: every call runs
    eagerly, and the other ranks step eagerly with it. Warns once, when made with `warn=True`."""

    def __init__(self, ctx: StepContext, signature: Signature, *, warn: bool, stacklevel: int):
        self.ctx = ctx
        if warn:
            message = eager_fallback_message(ctx.name, ctx.config.max_graphs, signature)
            warnings.warn(message, stacklevel=stacklevel)
            log.warning(message)

    def call(self, leaves: list, args: tuple, kwargs: dict) -> Any:
        ranks = self.ctx.ranks
        if ranks is None:
            return self.ctx.run_eager(args, kwargs)
        agreed = ranks.agree(Phase.EAGER, False, self.ctx.name)
        with ranks.together(self.ctx.name, agreed, self.ctx.state.modules):
            return self.ctx.run_eager(args, kwargs)
