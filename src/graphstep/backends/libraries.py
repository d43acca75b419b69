"""Libraries that compute differently while a CUDA stream captures: warm-ups take that path too.

transformers asks `is_cuda_stream_capturing()` (through `is_tracing()`) and, while a stream
captures, builds attention masks explicitly (a model given no `attention_mask` gets a packed-
sequence mask instead of SDPA's `is_causal`) and skips its host-side checks. Left alone, the warm-
ups run one path and the capture records the other:

- a `torch.compile`d model compiles the capture's path for the first time *inside* the capture,
  and inductor's constant folding reads a tensor with `.item()` there: the capture fails
  (Llama-125M in the bench's models suite);
- the warm-up steps compute another function than the replays.

`as_captured()` answers True to transformers' question while graphstep warms up or captures, and
while a replay runs the step's eager segments (a graph break's module), so every call of a captured
step runs the path its graph replays, and a compiled model compiles it once, in the first warm-up. An eager twin is compared bitwise under the same answer (tests/gpu's
`transformers_capture_path`). A library not imported is left alone; nothing is imported here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("graphstep")

_TRANSFORMERS = "transformers.utils.import_utils"
_logged = False


def _capturing() -> bool:
    """What transformers is told during graphstep's warm-ups and captures. One function object
    for the life of the process: torch.compile guards on the function it traced, so warm-ups and
    capture must hand it the same one."""
    return True


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """While inside: libraries that ask whether a stream captures are told it does."""
    module: Any = sys.modules.get(_TRANSFORMERS)
    original = getattr(module, "is_cuda_stream_capturing", None)
    if original is None or original is _capturing:  # not imported, an older release, or nested
        yield
        return
    global _logged
    if not _logged:
        _logged = True
        log.info(
            "graphstep: transformers takes its stream-capture path (explicit attention masks, no host "
            "checks) in warm-up calls too, so warm-ups compute as the replays do and a compiled model "
            "compiles that path before the capture. Compare an eager run under the same path "
            "(patch transformers.utils.import_utils.is_cuda_stream_capturing to return True)."
        )
    module.is_cuda_stream_capturing = _capturing
    try:
        yield
    finally:
        module.is_cuda_stream_capturing = original
