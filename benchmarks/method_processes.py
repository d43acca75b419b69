"""Each method of a bench script in a process of its own, inside one time budget.

The script runs itself with `--one METHOD`; that process prints each row it measured as a line
`ROW <json>`. Used by deepspeed_step.py and torchtitan_step.py (nothing of one method's allocator,
dynamo caches or graphs is left for the next, and a method that hangs costs only its share).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def arguments(doc: str, budget_s: float) -> argparse.Namespace:
    """The scripts' command line: `--out`, `--budget` (seconds for all methods together), and the
    hidden `--one METHOD` of the process that measures one method."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--budget", type=float, default=budget_s, help="seconds for all methods together")
    parser.add_argument("--one", metavar="METHOD", help=argparse.SUPPRESS)
    return parser.parse_args()


def rows_line(row: dict) -> str:
    """The line a `--one` process prints for a row it measured."""
    return "ROW " + json.dumps(row)


def run_each(
    script: str, methods: list[str], budget_s: float, *, first_port: int, min_left_s: float
) -> Iterator[tuple[str, list[dict] | None, str]]:
    """(method, the rows its process printed, why it printed none) for each method in turn; rows None:
    not started, less than `min_left_s` of the budget left. Each process gets its own MASTER_PORT."""
    start = time.monotonic()
    for port, method in enumerate(methods, start=first_port):
        left = budget_s - (time.monotonic() - start)
        if left < min_left_s:
            yield method, None, "time budget spent"
            continue
        env = {**os.environ, "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        try:
            done = subprocess.run(
                [sys.executable, script, "--one", method],
                env=env,
                capture_output=True,
                text=True,
                timeout=left,
            )
            stdout, why = done.stdout, (done.stderr or done.stdout)[-1500:]
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            why = f"timed out after {left:.0f} s"
        yield method, [json.loads(x[4:]) for x in stdout.splitlines() if x.startswith("ROW ")], why


def failure(row: dict, width: int) -> str:
    """A table cell for a row that did not run: why, its last `width` characters on one line."""
    return row.get("skipped") or " ".join(row.get("error", "").split())[-width:]


def write(out: str, stem: str, meta: dict, rows: list[dict], lines: list[str]) -> None:
    """`<out>/<stem>.json` (meta and rows) and `.md` (the lines), and the lines printed."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (folder / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
