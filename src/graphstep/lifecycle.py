"""The life of one input signature of a captured step: warm-up, capture, replay, and what
happens when state the graph depends on changes.

A `Lifecycle` owns one signature's static input buffers, its warm-up count and its graphs.
Several graphs of one signature can be alive at once, one *variant* per set of guarded values
(train or eval, which parameters are frozen, a module attribute's value, a global a helper
reads): when a guard fails, a variant captured for the current values is replayed if there is
one, and a new one is captured only if not. Changes that can never come back (a parameter's
storage moved, an object rebound) *re-capture* instead: the graphs go, and the capture counts
towards `Config.max_recaptures`. A changed hyperparameter that an optimizer bakes in moves that
optimizer to an eager segment (see `backends/segments.py`) once, in `optimizer_mode="auto"`.

Each call (`Lifecycle.call`) goes plan (what this rank would do) -> agreement (what all ranks
do, see `distributed/`) -> act. (A signature past `Config.max_graphs` gets an `Overflow` instead,
see capture.py.) A value that changes on every call, so that every call would capture a
variant never replayed, makes its calls run eagerly until it holds still (`guards/churn.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings
from typing import Any

from . import signature as sig
from .backends import compiled, library_segments, segments
from .backends.buffers import InputBuffers
from .capturing import Variant, capture_variant
from .diagnostics import log, stale_message
from .distributed.ranks import Agreement, Phase
from .errors import CaptureError, CompileAtCaptureError, OutOfMemoryAtCapture, StaleGraphError, WarmUpAgain
from .guards.churn import Probe, VariantChurn
from .guards.reads import ReadWatch
from .guards.state_guard import trainable
from .profiling import REPLAY, listening_to_replays, ranged
from .signature import Signature
from .step_context import StepContext
from .verify import verified_replay

_clock = itertools.count(1)  # orders variants by last use


@dataclasses.dataclass(frozen=True)
class Plan:
    """What this rank would do with a call, before the ranks agree."""

    phase: Phase
    kind: str
    """"warm", "capture" (the first graph), "replay", "variant" (a graph for new guarded values,
    the others kept), "recapture" (counted), "switch" (an optimizer moved to an eager segment),
    "rewarm" (optimizer state of another layout: warm up once more), "ddp" (DDP rebuilt its buckets
    after a stopped call: every graph of the step captured again, not counted), "stale", "churn" (a value
    changes on every call: run eagerly instead of capturing, see `guards/churn.py`), "pipeline" (a
    pipeline schedule initialises its stages in this call: one more warm-up, `distributed/p2p.py`)."""
    changes: tuple[str, ...] = ()
    limited: bool = False
    """A counted re-capture would pass `Config.max_recaptures`."""


_REPLAY = Plan(Phase.REPLAY, "replay")  # most calls: made once
_REWARM = {
    "rewarm": "optimizer state changes its layout (loaded, or created for a layer that trains again)",
    "pipeline": "a pipeline schedule initialises its stages in this call (a host exchange of shapes)",
}
_DDP_REBUILT = Plan(
    Phase.CAPTURE,
    "ddp",
    ("DDP was reset after a stopped call and rebuilt its gradient buckets: the graph's are gone",),
)
_ALONE = Agreement(Phase.REPLAY, None, None)  # a replay with no other rank to agree with


def _plan(life: Lifecycle) -> Plan:
    """What this rank would do with a call, before the ranks agree: replay, switch to a variant that
    fits, warm up, capture (a first graph, a variant, again), or run eagerly (stale, churn)."""
    plan = _wanted(life)
    if plan.phase is not Phase.CAPTURE:  # most calls (a replay): nothing more to ask
        return plan
    ctx = life.ctx
    if ctx.ranks is not None and ctx.ranks.ddp_rebuilding:
        return Plan(Phase.EAGER, "warm")  # DDP rebuilds its buckets in an eager forward first
    if ctx.pipelines and ctx.pipelines_initialise():
        # A pipeline schedule initialises its stages in this call (its shapes exchanged on the host):
        # eagerly, in one more warm-up; the next call captures.
        why = "a pipeline schedule initialises its stages (after schedule.eval(), say)"
        return Plan(Phase.EAGER, "warm" if life.current is None else "pipeline", (*plan.changes, why))
    return plan


def _wanted(life: Lifecycle) -> Plan:
    ctx = life.ctx
    if life.stale:
        return Plan(Phase.EAGER, "stale")
    current = life.current
    if current is None:
        if life.churn.still_waiting(life.replays):
            if life.churn.waits_on():
                return Plan(Phase.EAGER, "churn", life.churn.texts)
            life.churn.end_wait()  # the values held still: one more warm-up, then a capture
            life.warmups = min(life.warmups, ctx.warmups_needed - 1)
        # Capture only while requires_grad is as at the last warm-up: a layer unfrozen since
        # has optimizer state still to be created, which a capture would bake in.
        ready = life.warmups >= ctx.warmups_needed and trainable(ctx.state) == life.trainable
        if not ready or compiled.warm_up_again(ctx.name, life.compiled, life.warmups, ctx.warmups_needed):
            return Plan(Phase.EAGER, "warm")
        if life.churn.waits_before_capture(life.replays):
            return Plan(Phase.EAGER, "churn", life.churn.texts)
        return Plan(Phase.CAPTURE, "capture")
    if current.modes_epoch != ctx.modes.epoch:
        return Plan(Phase.CAPTURE, "switch", ("an optimizer moved to an eager segment",))
    if ctx.ranks is not None and current.ddp_resets != ctx.ranks.ddp_resets:
        return _DDP_REBUILT
    if current.guard is None or current.guard.holds():
        return _REPLAY
    if life.churn.still_waiting(life.replays):  # cheap: no changes() while a value churns
        if _switch_to_a_variant_that_holds(life):
            return _REPLAY
        if life.churn.waits_on():
            return Plan(Phase.EAGER, "churn", life.churn.texts)
    changes = current.guard.changes()
    if not changes:  # an unrelated module elsewhere in the process was re-registered
        return _REPLAY
    texts = tuple(getattr(c, "text", c) for c in changes)
    if _switch_to_a_variant_that_holds(life):
        return _REPLAY
    if ctx.optim.state_layout() != current.optimizer_layout or any(
        getattr(c, "warm_up", False) for c in changes
    ):
        # Optimizer state was replaced by one of another layout (loaded empty, say), or will be
        # created lazily (a layer unfrozen): a capture now would record that first step forever.
        # Warm up once more first.
        return Plan(Phase.EAGER, "rewarm", texts)
    if ctx.modes.move_for_changes(changes):  # a baked hyperparameter changed: its log names it
        return Plan(Phase.CAPTURE, "switch", texts)
    if all(getattr(c, "variant", False) and getattr(c, "optimizer", None) is None for c in changes):
        full = ctx.graphs_alive() >= ctx.config.max_graphs
        if life.churn.waits_for_variant(life.replays, texts, current.guard, evicts=full):
            return Plan(Phase.EAGER, "churn", texts)
        return Plan(Phase.CAPTURE, "variant", texts)
    return Plan(Phase.CAPTURE, "recapture", texts, life.recaptures >= ctx.config.max_recaptures)


def _switch_to_a_variant_that_holds(life: Lifecycle) -> bool:
    """Make a variant captured for the current values the current one, if there is one."""
    epoch = life.ctx.modes.epoch
    for variant in life.variants:
        if variant is not life.current and variant.modes_epoch == epoch and variant.guard.holds():
            life.current = variant
            life.ctx.stats.variant_switches += 1
            return True
    return False


class Lifecycle:
    """One input signature of a captured step: its buffers, warm-ups and graph variants."""

    def __init__(self, ctx: StepContext, signature: Signature):
        self.ctx = ctx
        self.signature = signature
        self.warmups = 0
        self.inputs = InputBuffers(ctx.backend, signature.spec, signature.tensors, ctx.loose)
        self.variants: list[Variant] = []
        self.current: Variant | None = None
        self.recaptures = 0
        self.replays = 0
        """This signature's replays (the churn's runs and waits end at one)."""
        self.stale = False  # past max_recaptures with on_recapture_limit="eager": this signature runs eagerly
        self.trainable: list[bool] | None = None
        """`guards.trainable` after the last warm-up."""
        self.warm_outputs: list[sig.TensorMeta] | None = None
        """The output tensors of the last warm-up, described: the output ring is made like them."""
        self.gave_way_for: str | None = None  # the last capture gave way to: "compile", "segments", "memory"
        self.segment_results: list = []
        """What each user eager segment returned in the last warm-up (a capture hands out such buffers)."""
        self.churn = VariantChurn(ctx.name)
        self.compiled = compiled.NOTHING  # what torch.compile compiled in the last warm-up
        self.guarded = ctx.backend.static_buffers and ctx.config.check != "off"  # its graphs have guards

    def call(self, leaves: list, args: tuple, kwargs: dict) -> Any:
        """One call of this signature: plan what this rank would do, agree with the other ranks (all
        act on the least advanced phase; collectives are checked while any rank runs Python), act."""
        plan = self.plan()
        ranks = self.ctx.ranks
        if ranks is None:
            if plan is _REPLAY:  # most calls: straight to the replay, none of act's branches
                return self.replay(leaves, args, kwargs)
            if plan.phase is Phase.REPLAY:
                return self.act(plan, _ALONE, leaves, args, kwargs)
            alone = Agreement(plan.phase, None, 0 if plan.limited else None)
            return self.act(plan, alone, leaves, args, kwargs)
        agreed = ranks.agree(plan.phase, plan.limited, self.ctx.name)
        if agreed.phase is Phase.REPLAY:
            return self.act(plan, agreed, leaves, args, kwargs)
        with ranks.together(self.ctx.name, agreed, self.ctx.state.modules):
            return self.act(plan, agreed, leaves, args, kwargs)

    plan = _plan  # what this rank would do with a call, before the ranks agree (see `_plan`)

    # -- act ------------------------------------------------------------------------------------

    def act(self, plan: Plan, agreed: Agreement, leaves: list, args: tuple, kwargs: dict) -> Any:
        ctx = self.ctx
        if plan.kind == "stale":
            return ctx.run_eager(args, kwargs)
        if agreed.phase is Phase.REPLAY:
            return self.replay(leaves, args, kwargs)
        if agreed.phase is Phase.EAGER:
            outputs = self._step_eagerly(plan, args, kwargs)
            self.churn.after_eager_call()  # (while a value churns: the values this call left)
            return outputs
        # Phase.CAPTURE, on some rank.
        if agreed.limited_by is not None:  # some rank is past max_recaptures: no rank captures
            if self.current is not None:
                self.release()
                _give_up(ctx, plan.changes or (f"rank {agreed.limited_by} is past max_recaptures",))
                self.stale = True
            return ctx.run_eager(args, kwargs)
        replays = self.replays
        outputs = self._capture_for(plan, agreed, leaves, args, kwargs)
        self.churn.captured(replays, self.replays, plan.changes)
        return outputs

    def _capture_for(self, plan: Plan, agreed: Agreement, leaves: list, args: tuple, kwargs: dict) -> Any:
        ctx = self.ctx
        if self.current is None:
            return self.capture(leaves, args, kwargs, replaced=[])
        if plan.kind == "variant":
            ctx.stats.variants += 1
            log.info(
                "graphstep: capturing another variant of %s for the current values of:\n%s",
                ctx.name,
                _listed(plan.changes),
            )
            return self.capture(leaves, args, kwargs, replaced=self._evict_for_room())
        if plan.kind in ("replay", "switch", "ddp"):  # not counted
            changes = plan.changes or (f"rank {agreed.held_back_by} captures, and ranks capture together",)
            log.info("graphstep: capturing %s again:\n%s", ctx.name, _listed(changes))
            return self.capture(leaves, args, kwargs, replaced=self._take_all())
        self.recaptures += 1  # a counted re-capture
        log.warning(
            "graphstep: re-capturing %s because state it depends on changed:\n%s",
            ctx.name,
            _listed(plan.changes),
        )
        return self.capture(leaves, args, kwargs, replaced=self._take_all())

    # -- the phases -----------------------------------------------------------------------------

    def _step_eagerly(self, plan: Plan, args: tuple, kwargs: dict) -> Any:
        ctx = self.ctx
        if plan.kind in ("rewarm", "pipeline"):
            log.warning(
                "graphstep: %s: %s; one more warm-up, then a capture:\n%s",
                ctx.name,
                _REWARM[plan.kind],
                _listed(plan.changes),
            )
            self._drop_all()
            self.warmups = ctx.warmups_needed - 1
        elif plan.kind == "churn":  # a value changes on every call: the eager step
            ctx.stats.churn_calls += 1
            return ctx.run_eager(args, kwargs)
        if self.current is not None:  # another rank warms up or waits: step eagerly with it
            return ctx.run_eager(args, kwargs)
        return self.warm_up(args, kwargs)

    def warm_up(self, args: tuple, kwargs: dict) -> Any:
        ctx = self.ctx
        start = time.perf_counter()
        # The last two warm-ups before a capture are watched: what they read tells whether a value
        # changes on every call (guards/churn.py).
        probing = self.guarded and self.current is None and self.warmups + 2 >= ctx.warmups_needed
        if probing and self.churn.probing():
            self.churn.before_watched_warmup()
        else:
            probing = False
        with (
            ranged("graphstep.warmup"),
            segments.watching_warmup(ctx.backend.outside_pool) as watch,
            segments.optimizer_steps_as_segments(ctx.modes.eager, ctx.modes.fresh_grads()),
            ctx.modes.observing(ctx.state.optimizers),
            library_segments.calls_as_segments(ctx.name, capturing=False),
            ReadWatch(sig.non_tensor_arguments(args, kwargs))
            if probing
            else contextlib.nullcontext() as reads,
        ):
            count = compiled.CompileCount()
            outputs = ctx.backend.warmup(ctx.fn, args, kwargs, in_pool=ctx.pool_is_free())
            self.compiled = count.since()
        if probing:
            self.churn.probe = Probe.of_run(reads.reads, ctx.state, ctx.fn)
        self.segment_results = watch.seen
        ctx.loose.after_warmup(self.signature, args, kwargs, watch.passed)  # (backends/loose.py)
        self.trainable = trainable(ctx.state)
        self.warmups += 1
        ctx.stats.warmup_calls += 1
        ctx.stats.warmup_s += time.perf_counter() - start
        outputs = sig.detached(outputs)
        self.warm_outputs = [sig.TensorMeta.of(t) for t in sig.flatten(outputs)[0]]
        return outputs

    def capture(self, leaves: list, args: tuple, kwargs: dict, *, replaced: list[Variant]) -> Any:
        """Capture a graph for the current state, make it the current variant, and perform this
        call's step. `replaced`: graphs that go once the new one exists (a pool whose last graph
        was released cannot be captured into again)."""
        ctx = self.ctx
        backend = ctx.backend
        called_with = args, kwargs
        if backend.static_buffers:
            args, kwargs = sig.unflatten(self.signature.spec, self.inputs.like(leaves))
            self.inputs.load(leaves)
        try:
            variant = capture_variant(ctx, args, kwargs, self.segment_results, self.warm_outputs)
        except WarmUpAgain as again:
            return _warm_up_again(self, again, *called_with)
        finally:
            for old in replaced:
                old.recording.release()
        self.gave_way_for = None
        self.variants.append(variant)
        self.current = variant
        if backend.static_buffers:
            log.info("graphstep: captured %s for %s", ctx.name, self.signature.describe())
        if backend.capture_executes:
            variant.last_used = next(_clock)
            outputs = self.deliver(variant.recording.outputs)
        else:
            outputs = self.replay(leaves, args, kwargs, verify=False)
        ctx.breaks.logged_after_capture(getattr(variant.recording, "segments", ()))
        return outputs

    def replay(self, leaves: list, args: tuple, kwargs: dict, *, verify: bool = True) -> Any:
        ctx = self.ctx
        start = time.perf_counter()
        if listening_to_replays():
            with ranged(REPLAY):
                result = self._replay(leaves, args, kwargs, verify)
        else:  # the hot path: no range object when no profiler or NVTX tool would see it
            result = self._replay(leaves, args, kwargs, verify)
        ctx.stats.replays += 1
        ctx.stats.replay_s += time.perf_counter() - start
        self.replays += 1
        return result

    def _replay(self, leaves: list, args: tuple, kwargs: dict, verify: bool) -> Any:
        ctx = self.ctx
        variant = self.current
        variant.last_used = next(_clock)
        if ctx.backend.static_buffers:
            self.inputs.load(leaves, variant.inputs)  # and a BlockMask set on a module
        every = ctx.config.verify_every
        if verify and every and (ctx.stats.replays + 1) % every == 0:
            outputs = verified_replay(self, leaves, args, kwargs)
        else:
            outputs = variant.recording.replay(args, kwargs)
        return self.deliver(outputs)

    # -- outputs --------------------------------------------------------------------------------

    def deliver(self, outputs: Any) -> Any:
        ctx = self.ctx
        if not ctx.backend.static_buffers:
            return sig.detached(outputs)
        if ctx.config.outputs == "graph":
            return outputs
        variant = self.current
        ring = variant.recording.ring
        tensors = ring.hand_out() if ring is not None else [t.clone() for t in variant.output_tensors]
        if variant.output_spec is sig.TENSOR_SPEC:  # a step that returns its loss: no tree to rebuild
            return tensors[0]
        return sig.unflatten(variant.output_spec, tensors)

    # -- letting graphs go ---------------------------------------------------------------------

    def graphs(self) -> int:
        return len(self.variants)

    def release(self) -> None:
        """Drop every graph of this signature now."""
        for variant in self._take_all():
            variant.recording.release()

    def _take_all(self) -> list[Variant]:
        taken, self.variants, self.current = self.variants, [], None
        return taken

    def _drop_all(self) -> None:
        self.release()
        self.ctx.renew_pool_if_unused()

    def _evict_for_room(self) -> list[Variant]:
        """A new variant needs room under `max_graphs`: the least recently used variant of this
        signature goes (after the new one is captured)."""
        if self.ctx.graphs_alive() < self.ctx.config.max_graphs or not self.variants:
            return []
        oldest = min(self.variants, key=lambda v: v.last_used)
        self.variants.remove(oldest)
        if self.current is oldest:
            self.current = None
        log.info(
            "graphstep: %s holds max_graphs graphs: dropping its least recently used variant", self.ctx.name
        )
        return [oldest]


def _warm_up_again(life: Lifecycle, again: WarmUpAgain, args: tuple, kwargs: dict) -> Any:
    """A graph break was just made, the step called eager segments the last warm-up did not, or the GPU
    ran out of memory during the capture (twice in a row: raised):
    this call is one more warm-up (nothing of the failed capture is left), the next captures.
    Twice in a row without a break: the step's segments change from call to call. Likewise for a
    compiled frame that would have compiled during the capture (see `backends/compiled.py`)."""
    compiling = isinstance(again, CompileAtCaptureError)  # a compiled frame would have compiled
    if isinstance(again, OutOfMemoryAtCapture):
        if life.gave_way_for == "memory":  # twice in a row: memory is short, not momentarily full
            life.gave_way_for = None
            raise CaptureError(f"{again}\nThe previous capture ran out of memory too.") from again.__cause__
        log.warning(
            "graphstep: %s: %s ran out of memory while capturing; nothing of the capture is kept, this "
            "call ran as an eager step%s, and the next call captures again.",
            life.ctx.name,
            "the GPU" if again.rank is None else f"rank {again.rank}'s GPU",
            "" if again.rank is None else " on every rank",
        )
        life.gave_way_for = "memory"
        life.warmups = min(life.warmups, life.ctx.warmups_needed - 1)
        return life.warm_up(args, kwargs)
    if compiling:
        compiled.gave_way(life.ctx.name, again, repeated=life.gave_way_for == "compile")
    elif not again.after_break and life.gave_way_for is not None:
        raise CaptureError(str(again)) from None
    life.gave_way_for = "compile" if compiling else "segments"
    life.warmups = min(life.warmups, life.ctx.warmups_needed - 1)
    return life.warm_up(args, kwargs)


def _give_up(ctx: StepContext, changes: tuple[str, ...]) -> None:
    """Past `max_recaptures` on some rank: raise, or warn that the signature runs eagerly from now on."""
    message = stale_message(ctx.name, ctx.config.max_recaptures, _listed(changes))
    if ctx.config.on_recapture_limit == "raise":
        raise StaleGraphError(message)
    warnings.warn(message + " Running this signature eagerly from now on.", stacklevel=5)


def _listed(changes: tuple[str, ...]) -> str:
    return "\n".join(f"  - {c}" for c in changes)
