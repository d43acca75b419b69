"""graphstep: capture a whole PyTorch training step into CUDA graphs, bitwise equal to eager."""

from . import errors
from .capture import CapturedStep, capture
from .config import Config
from .diagnostics import StepStats
from .errors import GraphStepError
from .explain import Explanation, explain

__all__ = [
    # the verb and its configuration
    "capture",
    "Config",
    # what it returns
    "CapturedStep",
    "StepStats",
    # looking before capturing
    "explain",
    "Explanation",
    # errors
    "GraphStepError",
    "errors",
]

__version__ = "0.1.0"
