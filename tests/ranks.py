"""Run a test function on several processes joined by torch.distributed, with a time limit.

`run_ranks(worker, n)` starts `n` fresh processes (spawn), each with a process group of
`n` ranks (gloo on CPU, NCCL on GPUs), calls `worker(rank, n, **kwargs)` in each, destroys
the group (unless `destroy=False`) and returns what each returned, by rank. A rank that raises
fails the test with its traceback; a rank whose process ends without reporting fails it too,
unless listed in `exits` (its result is then `{"exitcode": code}`); ranks that have not finished
within `timeout` seconds are killed and the test fails as hung, so no test can hang the suite.

The processes are forked from a server process that has imported torch once (multiprocessing's
"forkserver", tests/preload.py): a rank starts in a fraction of a second instead of importing
torch afresh, which made process start-up most of the distributed tests' time. Nothing of graphstep
is preloaded (importing it reads the environment), and each rank applies the test's `env` itself,
first thing (a forked rank inherits the server's environment, not the test's), then imports the
worker's module, which is passed by name.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import preload

INIT_FAILED = "init failed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(
    worker_at: tuple[str, str],
    rank: int,
    size: int,
    port: int,
    backend: str,
    destroy: bool,
    env: dict[str, str],
    kwargs: dict,
    out: Any,
) -> None:
    os.environ.update(env)  # before graphstep is imported, NCCL initialised or the vote reads it
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" in env:  # torch was imported by the server, before this variable was set
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        # The worker's module imports graphstep: only now (passed by name, unpickling it would import
        # it before the environment above is set; graphstep reads some of it at import).
        module, name = worker_at
        worker = getattr(importlib.import_module(module), name)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
            )
        except Exception as exc:  # the free port was taken before rank 0 listened on it (EADDRINUSE), or
            # a peer's failure there closed this rank's connection: run_ranks starts them all again
            out.put((rank, INIT_FAILED, f"{type(exc).__name__}: {exc}"))
            return
        result = worker(rank, size, **kwargs)
        if destroy and dist.is_initialized():
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(
    worker: Callable,
    size: int,
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    destroy: bool = True,
    env: dict[str, str] | None = None,
    exits: tuple[int, ...] = (),
    **kwargs: Any,
) -> list[Any]:
    # A port found free can be taken (by NCCL's own sockets, another test's ranks) before rank 0
    # listens on it, and a rank failing there closes its peers' connections: then every rank stops
    # before the worker runs, and the ranks start again on another port.
    last = ""
    for _ in range(3):
        try:
            return _run_once(worker, size, backend, timeout, destroy, env, exits, kwargs)
        except _InitFailed as failed:
            last = str(failed)
    raise AssertionError(f"the process group could not be set up three times in a row; last: {last}")


class _InitFailed(Exception):
    pass


def _run_once(
    worker: Callable,
    size: int,
    backend: str,
    timeout: float,
    destroy: bool,
    env: dict[str, str] | None,
    exits: tuple[int, ...],
    kwargs: dict,
) -> list[Any]:
    ctx = preload.context()
    out = ctx.Queue()
    port = _free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_main,
            args=(
                (worker.__module__, worker.__qualname__),
                r,
                size,
                port,
                backend,
                destroy,
                env,
                kwargs,
                out,
            ),
            daemon=True,
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    gone: dict[int, int] = {}  # ranks whose process ended without reporting: exit code
    deadline = time.monotonic() + timeout
    suspects: set[int] = set()
    init_failed = ""
    try:
        # Until every rank reported or ended, one failed (the others are then likely stuck in a
        # collective with it), or time is up.
        while len(results) + len(gone) < size and not errors and time.monotonic() < deadline:
            try:
                rank, status, value = out.get(timeout=0.5)
            except queue.Empty:
                # Seen ended twice with nothing in the queue in between: it did not report.
                ended = {r for r, p in enumerate(procs) if p.exitcode is not None and r not in results}
                gone.update({r: procs[r].exitcode for r in ended & suspects})
                suspects = ended - set(gone)
                continue
            if status == INIT_FAILED:
                init_failed = value
                break
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if not (errors or init_failed) else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if init_failed:
        raise _InitFailed(init_failed)
    if errors:
        rank, trace = sorted(errors.items())[0]
        raise AssertionError(f"rank {rank} of {size} failed:\n{trace}")
    unexpected = {r: code for r, code in gone.items() if r not in exits}
    if unexpected:
        raise AssertionError(f"ranks {sorted(unexpected)} of {size} exited without reporting: {unexpected}")
    results.update({r: {"exitcode": code} for r, code in gone.items()})
    if len(results) < size:
        missing = sorted(set(range(size)) - set(results))
        raise AssertionError(
            f"ranks {missing} of {size} did not finish within {timeout:.0f} s (hung) and were killed"
        )
    hung_at_exit = [r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in gone]
    if hung_at_exit:
        raise AssertionError(f"ranks {hung_at_exit} finished but did not exit cleanly (killed after 10 s)")
    return [results[r] for r in range(size)]
