"""Which backend a captured step runs on, from its config and where its tensors live."""

from __future__ import annotations

import torch

from ..config import Config
from ..diagnostics import log
from ..errors import GraphStepError
from ..state import TrainingState
from .base import Backend
from .cuda import CudaGraphBackend
from .eager import EagerBackend
from .recording import RecordingBackend


def choose_backend(config: Config, leaves: list[torch.Tensor], state: TrainingState, name: str) -> Backend:
    """The backend for a step whose first call has these tensor `leaves` and trains `state`."""
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
