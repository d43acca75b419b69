"""An optional C++ helper for the guards' O(tensors) reads, with the pure-Python path as fallback.

`StateGuard.holds()` reads every tracked tensor's data pointer and every parameter's
`requires_grad` before each replay. From Python each read costs 50-70 ns, so a model with 1,000
parameter tensors pays over 100 us per replay; `_fastcheck.cpp` does the same reads in one C++
loop (about 9 us for 1,000 tensors on the CPU that measured the former). It also checks optimizer
state dicts by identity (`StateCheck`, see optimizer.py); from Python 3.12 it watches those dicts
(PEP 699) and walks them only after one of them changed.

The helper is used when it can be imported:

- `graphstep.guards._fastcheck_ext`, built at install time by setup.py when torch is importable during
  the build (`pip install --no-build-isolation`, as `make setup` does) and a C++ compiler works
  (about 40 s), or
- built on first use with `torch.utils.cpp_extension.load` (a C++ compiler and ninja needed;
  about 30 s once, cached in torch's extension directory) when `GRAPHSTEP_BUILD_FASTCHECK=1`.

Anything else (no compiler, a torch other than the one it was built against: the helper records
that version and is refused under another) falls back to Python, with one log line saying which
path runs. Set `GRAPHSTEP_FASTCHECK=0` to force the Python path.
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
    module = _installed()
    if module is None and os.environ.get("GRAPHSTEP_BUILD_FASTCHECK") == "1":
        module = _built_now()
    if module is None:
        log.info("graphstep: guards read tensors from Python (the C++ helper is not built)")
        return None
    log.info("graphstep: guards read tensors with the C++ helper")
    return module


def _installed() -> Any:
    """The helper built at install time, if it was and fits the torch running now."""
    try:
        from . import _fastcheck_ext  # type: ignore[attr-defined]
    except ModuleNotFoundError:
        return None
    except Exception as exc:  # built against another torch: undefined symbols and the like
        log.warning("graphstep: the C++ guard helper failed to load (%s); using the Python path", exc)
        return None
    return _if_same_torch(_fastcheck_ext)


def _built_now() -> Any:
    import torch
    from torch.utils.cpp_extension import load

    try:
        module = load(
            "graphstep_fastcheck",
            [_SOURCE],
            extra_cflags=["-O2", f'-DGRAPHSTEP_TORCH_VERSION="{torch.__version__}"'],
            verbose=False,
        )
    except Exception as exc:
        log.warning("graphstep: building the C++ guard helper failed (%s); using the Python path", exc)
        return None
    return _if_same_torch(module)


def _if_same_torch(module: Any) -> Any:
    import torch

    built_for = getattr(module, "torch_version", "unknown")
    if built_for != torch.__version__:  # its view of torch's structures may be wrong: never guess
        log.warning(
            "graphstep: the C++ guard helper was built for torch %s, this is torch %s; using the Python path "
            "(reinstall graphstep with `pip install --no-build-isolation` to rebuild it)",
            built_for,
            torch.__version__,
        )
        return None
    return module


# The kinds of an `IdentityCheck` entry `(kind, a, b, c)`:
ITEM = 0  # (ITEM, dict, key, expected): dict.get(key, missing) is expected
CELL = 1  # (CELL, cell, expected, None)
ATTR = 2  # (ATTR, obj, name, expected): getattr(obj, name, missing) is expected
ITEMS = 3  # (ITEMS, container, expected tuple, None): the same objects in the same order
DICT = 4  # (DICT, dict, keys tuple, values tuple): the same keys, in order, holding the same objects
TRUE = 5  # (TRUE, callable, None, None): callable() is True
FALSE = 6  # (FALSE, callable, None, None): callable() is False


def identity_check(entries: list | None, missing: Any) -> Any:
    """One C++ pass over `entries` (see the kinds above) answering whether all of them still hold,
    or None without the helper or without entries (a guard part with no identity form)."""
    check = getattr(helper(), "IdentityCheck", None)
    if check is None or entries is None:
        return None
    return check(entries, missing)
