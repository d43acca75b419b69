"""`graphstep.capture`: the public verb, and `CapturedStep`, the state machine behind it.

Per input signature (see `signature.py`) a step goes WARM-UP -> CAPTURED. Warm-up calls are
real eager steps; the call after the last warm-up captures, and, since a CUDA capture executes
nothing, replays once, so that every call performs exactly one step. Later calls with the
same signature copy their tensors into the graph's static input buffers and replay.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import distributed, lifecycle
from . import signature as sig
from .backends import Backend, CudaGraphBackend, Recording, choose_backend
from .config import Config
from .diagnostics import (
    HostSyncWatch,
    StepStats,
    capture_error,
    eager_fallback_message,
    host_sync_error,
    log,
    stale_message,
    too_many_graphs_message,
)
from .distributed import Agreement, Phase, Ranks
from .errors import ClosedError, GraphStepError, StaleGraphError, TooManyGraphsError
from .guards import StateGuard, bindings, trainable
from .optim import OptimizerAdapter
from .reads import ReadWatch
from .signature import Signature
from .state import Snapshot, TrainingState, as_list
from .verify import verify

_MAX_EAGER_KEYS = 1024  # signatures remembered (to warn once each) after an eager fallback


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


@dataclasses.dataclass(eq=False)
class _Entry:
    """One input signature: its warm-up count, then its graph and static buffers."""

    signature: Signature
    warmups: int = 0
    buffers: list[torch.Tensor] | None = None
    host_staged: bool = False
    """Some buffers are pinned host memory (CPU inputs of a CUDA step): loading them must wait."""
    recording: Recording | None = None
    output_spec: Any = None
    output_tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)
    guard: StateGuard | None = None
    recaptures: int = 0
    stale: bool = False
    """Past `max_recaptures` with `on_recapture_limit="eager"`: this signature runs eagerly."""
    optimizer_layout: tuple = ()
    """`OptimizerAdapter.state_layout()` at capture: which parameters had which optimizer state."""
    sync_sites: list[str] = dataclasses.field(default_factory=list)
    """Where the last warm-up synchronised with the host; capture is refused while non-empty."""
    trainable: list[bool] | None = None
    """`guards.trainable` after the last warm-up: capture only while it is still so."""


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
        self._entries: dict[Signature, _Entry] = {}
        self._eager_keys: set[Signature] = set()
        self._backend: Backend | None = None
        self._generators = list(generators or [])
        if share_pool_with is not None and not isinstance(share_pool_with, CapturedStep):
            raise TypeError(
                f"share_pool_with takes a CapturedStep; got {type(share_pool_with).__qualname__}."
            )
        self._share = share_pool_with
        self._process_group = process_group
        self._ranks: Ranks | None = None  # set on the first call, with the backend
        self._warmups_needed = self.config.warmup_steps  # more for DDP, decided on the first call
        self._optim = OptimizerAdapter([])  # replaced once the first call found the optimizers
        self._stats = StepStats()
        self._busy = False
        self._closed = False
        lifecycle.opened(self)

    # -- public surface ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ClosedError(f"{self._name} was closed; capture the function again to keep training.")
        if self._busy:
            raise GraphStepError(f"{self._name} was called from inside itself; a step cannot nest.")
        self._busy = True
        try:
            return self._call(args, kwargs)
        finally:
            self._busy = False

    @property
    def stats(self) -> StepStats:
        """A copy of the counters, with the graphs alive and the pool's size read now."""
        graphs = sum(e.recording is not None for e in self._entries.values())
        pool = self._backend.pool_bytes() if self._backend is not None else 0
        return dataclasses.replace(self._stats, graphs_alive=graphs, pool_bytes=pool)

    @property
    def group(self) -> Any:
        """The process group whose ranks run this step together; None for one process (or
        before the first call)."""
        return self._ranks.group if self._ranks is not None else None

    @property
    def backend_name(self) -> str | None:
        """ "cuda", "eager" or "recording" once the first call chose; None before."""
        return self._backend.name if self._backend is not None else None

    def input_buffers(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """The static input buffers for calls shaped like `args, kwargs`, as `(args, kwargs)`.

        Write the next batch into them in place (`buf.copy_(batch)`, or a loader writing there)
        and pass them back: a call with the buffers themselves copies nothing.
        """
        signature, leaves = Signature.of(args, kwargs)
        entry = self._entry(signature, self._backend_for(leaves))
        if entry is None:
            raise TooManyGraphsError(self._too_many_message(signature))
        return sig.unflatten(signature.spec, self._buffers(entry, leaves))

    def reset(self) -> None:
        """Drop every graph; the next call of each signature warms up again."""
        for entry in self._entries.values():
            if entry.recording is not None:
                entry.recording.release()
        self._entries.clear()
        self._eager_keys.clear()
        self._renew_pool_if_unused()

    def close(self) -> None:
        """Release the graphs and the memory pool. Needed before `destroy_process_group`."""
        if self._closed:
            return
        self.reset()
        if self._backend is not None:
            self._backend.users -= 1
            if self._backend.users <= 0:  # the last step sharing it
                self._backend.close()
        self._closed = True
        lifecycle.closed(self)

    def __enter__(self) -> CapturedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        graphs = sum(e.recording is not None for e in self._entries.values())
        return f"<graphstep.CapturedStep {self._name} backend={self.backend_name} graphs={graphs}>"

    # -- the state machine --------------------------------------------------------------------

    @property
    def _name(self) -> str:
        return getattr(self._fn, "__qualname__", repr(self._fn))

    def _call(self, args: tuple, kwargs: dict) -> Any:
        signature, leaves = Signature.of(args, kwargs)
        backend = self._backend_for(leaves)
        self._optim.before_call()  # a float lr a scheduler assigned goes into the graph's tensor
        entry = self._entry(signature, backend)
        phase, changes = self._phase(entry)
        refuse = phase is Phase.CAPTURE and entry.recording is None and bool(entry.sync_sites)
        limited = bool(changes) and entry.recaptures >= self.config.max_recaptures
        if self._ranks is not None:  # every rank acts on the least advanced rank's phase
            agreed = self._ranks.agree(phase, refuse, limited)
        else:
            agreed = Agreement(phase, None, 0 if refuse else None, 0 if limited else None)
        if agreed.refused_by is not None and agreed.phase is Phase.CAPTURE:
            raise self._refuse_capture(entry, agreed.refused_by)
        if entry is None or entry.stale:
            return self._run_eager(signature, args, kwargs)
        if agreed.phase is Phase.REPLAY:
            return self._replay(entry, leaves, args, kwargs)
        if agreed.phase is Phase.CAPTURE:
            if entry.recording is None and agreed.limited_by is None:
                return self._capture(entry, backend, leaves, args, kwargs)
            if entry.recording is None:  # another rank stops capturing: step eagerly with it
                return self._run_eager(signature, args, kwargs, quiet=True)
            return self._recapture(entry, backend, changes, leaves, args, kwargs, agreed)
        # Phase.EAGER: some rank (maybe this one) runs this call eagerly.
        if entry.recording is not None:
            if not changes:  # another rank warms up: keep this graph, step eagerly with it
                return self._run_eager(signature, args, kwargs, quiet=True)
            return self._rewarm(entry, backend, changes, args, kwargs)
        return self._warm_up(entry, backend, args, kwargs)

    def _phase(self, entry: _Entry | None) -> tuple[Phase, list[str]]:
        """How far this rank is with `entry`, and what changed under its graph, if anything."""
        if entry is None or entry.stale:
            return Phase.EAGER, []
        if entry.recording is None:
            ready = entry.warmups >= self._warmups_needed and trainable(self._state) == entry.trainable
            return (Phase.CAPTURE if ready else Phase.EAGER), []
        if entry.guard is None or entry.guard.holds():
            return Phase.REPLAY, []
        changes = entry.guard.changes()
        if not changes:  # an unrelated module elsewhere in the process was re-registered
            return Phase.REPLAY, []
        if self._optim.state_layout() != entry.optimizer_layout or any(c.warm_up for c in changes):
            # Optimizer state was replaced by one of another layout (loaded empty, say): a capture
            # now would record the lazy first step forever. Warm up once more first.
            return Phase.EAGER, changes
        return Phase.CAPTURE, changes

    def _warm_up(self, entry: _Entry, backend: Backend, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter()
        if entry.warmups == self._warmups_needed - 1 and backend.static_buffers:
            # The last warm-up looks for host syncs (earlier ones may lazily create state with
            # syncs of their own). The step completes; the capture that follows is refused.
            with HostSyncWatch(cuda=isinstance(backend, CudaGraphBackend)) as watch:
                outputs = backend.warmup(self._fn, args, kwargs, in_pool=self._pool_is_free())
            entry.sync_sites = watch.sites
        else:
            outputs = backend.warmup(self._fn, args, kwargs, in_pool=self._pool_is_free())
        entry.warmups += 1
        entry.trainable = trainable(self._state)
        self._stats.warmup_calls += 1
        self._stats.warmup_s += time.perf_counter() - start
        return sig.detached(outputs)

    def _capture(self, entry: _Entry, backend: Backend, leaves: list, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter()
        if backend.static_buffers:
            args, kwargs = sig.unflatten(entry.signature.spec, self._buffers(entry, leaves))
            self._load(entry, leaves)
        snapshot = Snapshot.take(self._state, backend.cuda_devices)

        def checked_step(*a: Any, **k: Any) -> Any:
            # Inside the capture, so that a refused output also undoes what the step did.
            outputs = self._fn(*a, **k)
            entry.output_spec, entry.output_tensors = sig.replayable_outputs(
                outputs, self._name, device_only=isinstance(backend, CudaGraphBackend)
            )
            return outputs

        try:
            with ReadWatch() as watch:
                recording = backend.capture(checked_step, args, kwargs, self._generators)
        except BaseException as exc:
            snapshot.restore()
            if isinstance(exc, GraphStepError) or not isinstance(exc, Exception):
                raise
            raise capture_error(self._name, exc) from exc
        recording.outputs = sig.unflatten(entry.output_spec, entry.output_tensors)
        entry.recording = recording
        entry.optimizer_layout = self._optim.state_layout()
        if self.config.check != "off":
            entry.guard = StateGuard(
                self._state,
                self._fn,
                strict=self.config.check == "strict",
                grads_before=snapshot.grads,
                reads=watch.reads,
            )
        if isinstance(backend, CudaGraphBackend):
            torch.cuda.synchronize(backend.index)
        self._stats.captures += 1
        self._stats.capture_s += time.perf_counter() - start
        log.info("graphstep: captured %s for %s", self._name, entry.signature.describe())
        if backend.capture_executes:
            return self._deliver(entry, recording.outputs)
        return self._replay(entry, leaves, args, kwargs)

    def _replay(self, entry: _Entry, leaves: list, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter()
        if self._backend.static_buffers:
            self._load(entry, leaves)
        every = self.config.verify_every
        if every and (self._stats.replays + 1) % every == 0:
            outputs = self._verified_replay(entry, args, kwargs)
        else:
            outputs = entry.recording.replay(args, kwargs)
        result = self._deliver(entry, outputs)
        self._stats.replays += 1
        self._stats.replay_s += time.perf_counter() - start
        return result

    def _verified_replay(self, entry: _Entry, args: tuple, kwargs: dict) -> Any:
        # The eager run reads the same static buffers the replay will.
        eager = sig.unflatten(entry.signature.spec, entry.buffers) if entry.buffers else (args, kwargs)
        return verify(
            self._state,
            self._fn,
            self._backend.cuda_devices,
            run_eager=lambda: self._backend.warmup(self._fn, *eager, in_pool=False),
            replay=lambda: entry.recording.replay(args, kwargs),
            tolerance=self.config.verify_tolerance,
        )

    def _refuse_capture(self, entry: _Entry, rank: int) -> GraphStepError:
        """The last warm-up synchronised with the host (on this rank or on `rank`): no rank
        captures, and each warms up (and looks) once more on its next call."""
        sites, entry.sync_sites = entry.sync_sites, []
        if entry.recording is None and entry.warmups >= self._warmups_needed:
            entry.warmups -= 1
        return host_sync_error(self._name, sites, None if sites else rank)

    def _recapture(
        self,
        entry: _Entry,
        backend: Backend,
        changes: list[str],
        leaves: list,
        args: tuple,
        kwargs: dict,
        agreed: Agreement,
    ) -> Any:
        """Capture `entry` again because of `changes`; with none, because another rank captures
        (ranks capture together), which does not count towards `max_recaptures`."""
        forced = [f"rank {agreed.held_back_by} captures, and ranks capture together"]
        old = self._retire(
            entry, changes or forced, counted=bool(changes), limited=agreed.limited_by is not None
        )
        if old is None:
            return self._run_eager(entry.signature, args, kwargs)
        try:
            return self._capture(entry, backend, leaves, args, kwargs)
        finally:
            # Released only now: a pool whose last graph is gone cannot be captured into again.
            old.release()

    def _rewarm(self, entry: _Entry, backend: Backend, changes: list[str], args: tuple, kwargs: dict) -> Any:
        """Drop a graph whose state changed and warm up once before capturing again."""
        old = self._retire(entry, changes, limited=entry.recaptures >= self.config.max_recaptures)
        if old is None:
            return self._run_eager(entry.signature, args, kwargs)
        old.release()
        self._renew_pool_if_unused()
        entry.warmups = self._warmups_needed - 1
        return self._warm_up(entry, backend, args, kwargs)

    def _retire(
        self, entry: _Entry, changes: list[str], *, limited: bool, counted: bool = True
    ) -> Recording | None:
        """Take `entry`'s graph out of service because `changes` happened; returns it for the
        caller to release. `limited` (past `max_recaptures` on some rank): raises, or marks the
        entry stale and returns None."""
        what = "\n".join(f"  - {c}" for c in changes)
        old, entry.recording, entry.guard = entry.recording, None, None
        entry.recaptures += counted
        if not limited:
            log.warning(
                "graphstep: re-capturing %s because state it depends on changed:\n%s", self._name, what
            )
            return old
        old.release()
        message = stale_message(self._name, self.config.max_recaptures, what)
        if self.config.on_recapture_limit == "raise":
            raise StaleGraphError(message)
        entry.stale = True
        warnings.warn(message + " Running this signature eagerly from now on.", stacklevel=5)
        return None

    def _run_eager(self, signature: Signature, args: tuple, kwargs: dict, *, quiet: bool = False) -> Any:
        stale = signature in self._entries  # past max_recaptures: warned once already
        if (
            not quiet
            and not stale
            and signature not in self._eager_keys
            and len(self._eager_keys) < _MAX_EAGER_KEYS
        ):
            self._eager_keys.add(signature)
            message = eager_fallback_message(self._name, self.config.max_graphs, signature)
            warnings.warn(message, stacklevel=3)
            log.warning(message)
        self._stats.eager_calls += 1
        return sig.detached(self._fn(*args, **kwargs))

    # -- helpers ------------------------------------------------------------------------------

    def _renew_pool_if_unused(self) -> None:
        if self._backend is not None and not self._closed and self._pool_is_free():
            self._backend.renew_pool()

    def _pool_is_free(self) -> bool:
        """Warm up inside the pool only while no graph uses it (see `Backend.warmup`)."""
        return self._backend.graphs == 0

    def _backend_for(self, leaves: list[torch.Tensor]) -> Backend:
        if self._backend is None:
            self._ranks = distributed.ranks_for(self._process_group)  # first: it may refuse
            # Modules and optimizers the step reaches through its closure or globals are state too.
            found = self._state.discover((label, value) for label, _, value in bindings(self._fn))
            self._generators += [g for g in found if not any(g is known for known in self._generators)]
            self._optim = OptimizerAdapter(self._state.optimizers)
            if self._share is not None:
                if self._share._backend is None:
                    raise GraphStepError(
                        f"{self._name} shares the pool of {self._share._name}, which has not run yet: "
                        "call that step once first."
                    )
                self._backend = self._share._backend
            else:
                self._backend = choose_backend(self.config, leaves, self._state, self._name)
            self._backend.users += 1
            if self._ranks is not None and isinstance(self._backend, CudaGraphBackend):
                distributed.check_nccl_graph_registration(self._ranks.group)
            if distributed.prepare_ddp(self._state.modules):
                self._warmups_needed = max(self._warmups_needed, distributed.DDP_WARMUP_STEPS)
            if self._backend.static_buffers:  # graphs: capturable optimizers, lr as a tensor
                self._optim.prepare(getattr(self._backend, "device", "cpu"))
        return self._backend

    def _entry(self, signature: Signature, backend: Backend) -> _Entry | None:
        """The entry for `signature`, made if there is room; None means: run eagerly."""
        entry = self._entries.get(signature)
        if entry is not None:
            return entry
        if len(self._entries) >= self.config.max_graphs:
            if self.config.on_too_many_graphs == "raise":
                raise TooManyGraphsError(self._too_many_message(signature))
            return None
        entry = self._entries[signature] = _Entry(signature)
        return entry

    def _too_many_message(self, signature: Signature) -> str:
        return too_many_graphs_message(self._name, self.config.max_graphs, list(self._entries), signature)

    def _buffers(self, entry: _Entry, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        if entry.buffers is None:
            entry.buffers = [self._backend.new_buffer(t) for t in leaves]
            for buffer, t in zip(entry.buffers, leaves):
                buffer.requires_grad_(t.requires_grad and t.is_leaf)
            entry.host_staged = any(b.is_pinned() for b in entry.buffers)
        return entry.buffers

    def _load(self, entry: _Entry, leaves: list[torch.Tensor]) -> None:
        """Copy the call's tensors into the graph's input buffers (none when they are the buffers)."""
        if entry.host_staged:  # the previous replay may still be reading a host buffer
            torch.cuda.current_stream(self._backend.index).synchronize()
        with torch.no_grad():
            for buffer, t in zip(entry.buffers, leaves):
                if t is not buffer:
                    buffer.copy_(t)

    def _deliver(self, entry: _Entry, outputs: Any) -> Any:
        if not self._backend.static_buffers:
            return sig.detached(outputs)
        if self.config.outputs == "graph":
            return outputs
        return sig.unflatten(entry.output_spec, [t.clone() for t in entry.output_tensors])
