"""graphstep: capture a whole PyTorch training step into CUDA graphs, bitwise equal to eager."""

from . import errors
from .backends.autograd_segments import eager_segment
from .backends.cuda import capture_stream
from .capture import CapturedStep, capture
from .config import Config
from .diagnostics import StepStats
from .errors import GraphStepError
from .explain import Explanation, explain
from .guards import unchanging

__all__ = [
    # the verb and its configuration
    "capture",
    "Config",
    # work that runs eagerly between a step's graphs
    "eager_segment",
    # the stream it captures on (construct DDP under it)
    "capture_stream",
    # what it returns
    "CapturedStep",
    "StepStats",
    # looking before capturing
    "explain",
    "Explanation",
    # an object the step reads that never changes between calls (not read by content, not named)
    "unchanging",
    # errors
    "GraphStepError",
    "errors",
]

__version__ = "0.1.0"
