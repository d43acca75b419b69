"""`StepContext`: what every input signature of one captured step shares, set up on its first call:
the step function, its config, training state, backend, optimizers (adapter and modes), counters and
ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import distributed
from . import signature as sig
from .backends import Backend, CudaGraphBackend
from .backends.choice import choose_backend
from .backends.graph_breaks import GraphBreaks
from .backends.loose import LooseArguments
from .config import Config
from .diagnostics import StepStats
from .distributed import Ranks, p2p
from .errors import CaptureError, GraphStepError
from .guards import barriers, bindings
from .optim import OptimizerAdapter
from .optim.adapter import sparse_padding, sparse_parameters
from .optim.modes import OptimizerModes
from .state import TrainingState


@dataclasses.dataclass(eq=False)
class StepContext:
    """What every signature of one captured step shares."""

    fn: Callable
    name: str
    config: Config
    state: TrainingState
    backend: Backend
    optim: OptimizerAdapter
    modes: OptimizerModes
    """Which optimizers' `step()` runs as an eager segment between graph replays."""
    stats: StepStats
    generators: list[torch.Generator]
    ranks: Ranks | None
    breaks: GraphBreaks
    """The pieces of the step that run eagerly, forward and backward, between graphs."""
    warmups_needed: int
    graphs_alive: Callable[[], int]
    loose: LooseArguments = dataclasses.field(default_factory=LooseArguments)
    """Arguments used only in eager segments: not part of the key (`backends/loose.py`)."""
    pipelines: list = dataclasses.field(default_factory=list)
    """`torch.distributed.pipelining` schedules the step drives: one that will initialise its stages
    (a host exchange of shapes) in the next call makes that call a warm-up, never a capture."""

    def pipelines_initialise(self) -> bool:
        return any(p2p.initialises(s) for s in self.pipelines)

    @classmethod
    def open(
        cls,
        fn: Callable,
        name: str,
        config: Config,
        state: TrainingState,
        *,
        leaves: list[torch.Tensor],
        generators: list[torch.Generator],
        shared_backend: Backend | None,
        process_group: Any,
        stats: StepStats,
        graphs_alive: Callable[[], int],
    ) -> StepContext:
        """Set up on the first call: ranks (first: they may refuse), the state found in the step's
        closure and globals, the backend (`shared_backend`: another step's), the optimizers."""
        ranks = distributed.ranks_for(process_group)
        found = state.discover((label, value) for label, _, value in bindings(fn))
        generators = generators + [g for g in found if not any(g is known for known in generators)]
        optim = OptimizerAdapter(state.optimizers, allow_eager=config.optimizer_mode != "graph")
        backend = shared_backend or choose_backend(config, leaves, state, name)
        refused = sparse_padding(state.named_modules_roots()) if backend.static_buffers else None
        if refused:  # (the eager backend runs it as eager does)
            raise CaptureError(f"{name}: {refused}")
        backend.users += 1
        if ranks is not None and isinstance(backend, CudaGraphBackend):
            distributed.check_nccl_graph_registration(ranks.group)
        warmups = config.warmup_steps
        if distributed.prepare_ddp(state.modules):
            warmups = max(warmups, distributed.DDP_WARMUP_STEPS)
        # The eager backend runs every optimizer step eagerly already: nothing moves to a segment.
        modes = OptimizerModes(
            optim,
            config.optimizer_mode if backend.static_buffers else "graph",
            name,
            graphs=backend.static_buffers,
            host_tensors=bool(backend.cuda_devices),
        )
        if backend.static_buffers:  # graphs: capturable optimizers, lr as a tensor
            # The write barriers the guards use, in place before the first warm-up: a torch.compile'd
            # model compiled then sees nn.Module's hooks as the capture will (else it recompiles).
            barriers.install()
            optim.prepare(getattr(backend, "device", "cpu"), sparse_parameters(state.modules))
            if config.optimizer_mode == "eager":
                modes.move_to_eager(state.optimizers, 'Config(optimizer_mode="eager")')
        return cls(
            fn=fn,
            name=name,
            config=config,
            state=state,
            backend=backend,
            optim=optim,
            modes=modes,
            stats=stats,
            generators=generators,
            ranks=ranks,
            breaks=GraphBreaks(
                name,
                config.graph_breaks if backend.static_buffers else "off",
                state.named_modules_roots,
                getattr(fn, "__code__", None),
            ),
            warmups_needed=warmups,
            graphs_alive=graphs_alive,
            pipelines=p2p.pipeline_schedules(fn),
        )

    def pool_is_free(self) -> bool:
        """Warm up inside the pool only while no graph uses it (see `Backend.warmup`)."""
        return self.backend.graphs == 0

    def renew_pool_if_unused(self) -> None:
        if self.pool_is_free():
            self.backend.renew_pool()

    def run_eager(self, args: tuple, kwargs: dict) -> Any:
        self.stats.eager_calls += 1
        return sig.detached(self.fn(*args, **kwargs))


def shared_backend_of(step_name: str, other_name: str, other_ctx: StepContext | None) -> Backend:
    """The backend of the step whose pool `step_name` shares (`share_pool_with`)."""
    if other_ctx is None:
        raise GraphStepError(
            f"{step_name} shares the pool of {other_name}, which has not run yet: call that step once first."
        )
    return other_ctx.backend
