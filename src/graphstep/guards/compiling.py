"""What torch.compile must not see of graphstep, and whether it is looking.

graphstep's hooks run inside a compiled model's frames: nn.Module's registration hooks and attribute
barrier (`barriers.py`), and the profile and trace functions that watch a step's Python (`reads.py`,
`effects/`). dynamo compiles what it sees. A hook it traces becomes part of the model's guards: a
recompile whenever graphstep's own state changes, at a capture too, where inductor cannot run. A
profile function the interpreter calls inside a compiled region is compiled as a frame of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compiling() -> bool:
    """True while dynamo traces the caller (it folds the call to a constant); False when it runs."""
    return torch.compiler.is_compiling()


def unseen(hook: F) -> F:
    """`hook` (a profile or trace function) run with torch.compile off, so that dynamo neither compiles
    it nor anything it calls. Unchanged while dynamo has compiled no frame in this process: its
    eval-frame callback, which would see the hook, is only on around compiled code, and the wrapper
    costs every event (0.5 µs on the CPU machine; a tiny GPT's capture has some 200,000). graphstep
    imports dynamo itself (`autograd_segments.run` is `torch.compiler.disable`d), so being imported
    says nothing. A compiled function called for the first time inside a capture fails the capture
    anyway (`compiled.no_compiling`)."""
    if not frames_compiled():
        return hook
    return torch.compiler.disable(hook)


def frames_compiled() -> int:
    """Frames dynamo has been asked to compile in this process (0 where it is not imported)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return 0 if counters is None else int(counters.get("frames", {}).get("total", 0))
