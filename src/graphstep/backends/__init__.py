"""Backends: what warm-up, capture and replay mean on a machine, and what runs between graphs.

- `base.py`: the `Backend` protocol and the `Recording` a capture hands out.
- `cuda.py`: CUDA graphs in one private pool; `eager.py`: the step runs every call;
  `recording.py`: a CPU stand-in for a graph, for tests.
- `segments.py`: eager segments, work that runs eagerly between graph replays.
- `buffers.py`: a signature's static input buffers; `undo.py`: taking a failed capture's writes back.
"""

from .base import Backend, PartsRecording, Recording
from .cuda import CudaGraphBackend, capture_stream
from .eager import EagerBackend

__all__ = ["Backend", "CudaGraphBackend", "EagerBackend", "PartsRecording", "Recording", "capture_stream"]
