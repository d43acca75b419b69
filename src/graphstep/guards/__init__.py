"""Guards: a replay never silently differs from eager.

- `state_guard.py`: `StateGuard`, one graph's guard over everything it baked (tensors, modes, reads).
- `reads.py`: the Python state the step reads (globals, closure cells, attributes), found while it runs;
  `read_guard.py`: the check on every replay that those values are still what the graph saw;
  `contents.py` + `walk.py` + `configs.py`: what it reads inside containers and config objects, by content;
  `unchanging(obj)`: an object the user promises not to change between calls.
- `barriers.py`: write barriers, a cheap notice of writes to modules' Python state instead of a scan.
- `optimizer.py`: the optimizer part of a guard (param groups, baked numbers, per-parameter state).
- `fastcheck.py` (+ `_fastcheck.cpp`): the optional C++ helper for the O(tensors) checks.
- `change.py`: `Change`, one reason a guard fails.
- `churn.py`: `VariantChurn`, a value that changes on every call (a capture per call, never replayed),
  and the eager calls that wait it out.
"""

from .state_guard import StateGuard, bindings, named_state_tensors, trainable
from .walk import unchanging

__all__ = ["StateGuard", "bindings", "named_state_tensors", "trainable", "unchanging"]
