"""`python -m graphstep.bench.worker JOB.json`: one row of `graphstep bench` in a process of its own.

`graphstep bench` starts one of these per (config, method), so each method's memory peak is its
own (no leftovers of the methods before it: compiled code, cudagraph pools, the allocator's cache)
and a crash, a hang or a poisoned CUDA context costs one row, not the run. The job file says what to
run (see `runner.py`); the row is written to the job's `row_path` after every phase.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m graphstep.bench.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())

    logger = logging.getLogger("graphstep")
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)

    from .measure import Counts, cupti_graph_workaround, measure_row

    cupti_graph_workaround()
    row = measure_row(
        suite=job["suite"],
        config=job["config"],
        method=job["method"],
        counts=Counts(**job["counts"]),
        device=job.get("device", "cuda"),
        tiny=job.get("tiny", False),
        graphstep_config=job.get("graphstep_config"),
        row_path=job["row_path"],
    )
    status = "skipped" if row["skipped"] else ("failed" if row["error"] else "ok")
    print(f"bench_worker: {job['config']}/{job['method']}: {status}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: the row is written, and a hang at exit (compile workers, CUDA
    # teardown) would cost the run a timeout. The parent kills this process group afterwards.
    os._exit(code)
