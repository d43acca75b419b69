"""benchmarks/method_processes.py: the driver that runs each method of deepspeed_step.py and
torchtitan_step.py in a process of its own (those need a GPU and their stacks; the driver does not)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if not (BENCHMARKS / "method_processes.py").exists():
    pytest.skip("graphstep is installed without its repository", allow_module_level=True)

spec = importlib.util.spec_from_file_location("method_processes", BENCHMARKS / "method_processes.py")
driver = importlib.util.module_from_spec(spec)
sys.modules["method_processes"] = driver
spec.loader.exec_module(driver)


def test_each_method_runs_in_its_own_process_within_the_budget(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys, time
            sys.path.insert(0, {str(BENCHMARKS)!r})
            from method_processes import rows_line
            method = sys.argv[2]
            if method == "fails":
                raise SystemExit("no GPU here")
            if method == "hangs":
                time.sleep(60)
            print("noise")
            print(rows_line({{"method": method, "pid": os.getpid(), "port": os.environ["MASTER_PORT"]}}))
            """
        )
    )
    methods = ["a", "fails", "b", "hangs", "c"]
    got = {
        m: (rows, why)
        for m, rows, why in driver.run_each(str(script), methods, 3.0, first_port=100, min_left_s=1)
    }
    (a,), (b,) = got["a"][0], got["b"][0]
    assert a["method"] == "a" and b["method"] == "b" and a["pid"] != b["pid"]
    assert (a["port"], b["port"]) == ("100", "102"), "one port per method, in order"
    assert got["fails"] == ([], "no GPU here\n")
    assert got["hangs"][0] == [] and got["hangs"][1].startswith("timed out after")
    assert got["c"] == (None, "time budget spent"), "the hang spent the budget: c is not started"
    assert driver.failure({"method": "c", "skipped": "time budget spent"}, 10) == "time budget spent"
    assert driver.failure({"error": "a\nlong   error text"}, 10) == "error text"


def test_the_rows_are_written_as_json_and_markdown(tmp_path, capsys):
    driver.write(
        str(tmp_path / "out"), "h100_2026-11-27_x", {"gpu": "H100"}, [{"method": "a"}], ["# x", "| a |"]
    )
    assert (tmp_path / "out" / "h100_2026-11-27_x.md").read_text() == "# x\n| a |\n"
    assert '"rows"' in (tmp_path / "out" / "h100_2026-11-27_x.json").read_text()
    assert "| a |" in capsys.readouterr().out
