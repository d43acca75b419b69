"""The process server that the tests' child processes are forked from (multiprocessing's "forkserver").

A process has one such server, started by the first test that forks, with the modules it preloads: a
child forked from it starts with them imported instead of importing them afresh, which was most of a
short child's time. torch._dynamo is among them: the first optimizer a process makes imports it (about
a second of CPU per rank), and preloading it halved the CPU time of the distributed tests. So every test
that forks asks for the server here, with one list, whichever comes first (tests/ranks.py for the
distributed tests' ranks, tests/test_examples.py for the examples).

The frameworks the examples train with are not preloaded: a rank forked from a server holding them
carries them too, and every capture's census of live objects cost more (measured when the census
listed them: more CPU for the distributed tests than the examples saved). Without CUDA only: a module
that initialised CUDA while imported would leave every child (the NCCL ranks of tests/gpu) with a CUDA
it cannot use, so with CUDA the server preloads torch and torch.distributed, as before. Nothing of graphstep is preloaded:
importing it reads the environment, which each child sets first.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch


def modules() -> list[str]:
    if torch.cuda.is_available():
        return ["torch", "torch.distributed"]
    return ["torch", "torch.distributed", "torch._dynamo"]


def context() -> Any:
    """The forkserver context; its server preloads `modules()` (set before it starts, so always)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(modules())
    return ctx
