"""An optional C++ helper for the guards' O(tensors) reads, with the pure-Python path as fallback.

`StateGuard.holds()` reads every tracked tensor's data pointer and every parameter's
`requires_grad` before each replay. From Python each read costs 50-70 ns, so a model with 1,000
parameter tensors pays over 100 us per replay; `_fastcheck.cpp` does the same reads in one C++
loop (about 9 us for 1,000 tensors on the CPU that measured the former).

The helper is used when it can be imported:

- `graphstep._fastcheck_ext`, built at install time (to be wired into the build: see the
  report of the guards branch), or
- built on first use with `torch.utils.cpp_extension.load` (a C++ compiler and ninja needed;
  about 30 s once, cached in torch's extension directory) when `GRAPHSTEP_BUILD_FASTCHECK=1`.

Anything else (no compiler, a torch whose ABI differs from the one it was built against) falls
back to Python, with one log line saying which path runs. Set `GRAPHSTEP_FASTCHECK=0` to force
the Python path.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

log = logging.getLogger("graphstep")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fastcheck.cpp")


@functools.cache
def helper() -> Any:
    """The extension module with `TensorCheck(tensors, requiring, frozen)`, or None."""
    if os.environ.get("GRAPHSTEP_FASTCHECK") == "0":
        return None
    try:
        from . import _fastcheck_ext  # type: ignore[attr-defined]

        return _fastcheck_ext
    except ImportError:
        pass
    except Exception as exc:  # built against another torch: undefined symbols and the like
        log.warning("graphstep: the C++ guard helper failed to load (%s); using the Python path", exc)
        return None
    if os.environ.get("GRAPHSTEP_BUILD_FASTCHECK") != "1":
        log.info(
            "graphstep: guards read tensors from Python (set GRAPHSTEP_BUILD_FASTCHECK=1 to build the C++ helper)"
        )
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load("graphstep_fastcheck", [_SOURCE], extra_cflags=["-O2"], verbose=False)
    except Exception as exc:
        log.warning("graphstep: building the C++ guard helper failed (%s); using the Python path", exc)
        return None
    log.info("graphstep: guards read tensors with the C++ helper")
    return module
