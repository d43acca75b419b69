"""The command line on CPU: `graphstep demo` end to end, `graphstep bench` without CUDA, the results writer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphstep
from graphstep.cli import main
from graphstep.demo.train import sparkline


def test_demo_on_cpu_trains_bitwise_equal_to_eager(capsys):
    assert main(["demo", "--steps", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "graphstep runs its eager backend" in out
    assert "losses yes (8 steps)" in out
    assert "final parameters yes" in out
    assert "graphstep (eager backend): 3 warm-up calls" in out
    # The demo turns deterministic algorithms on for its runs only: the setting is process-wide.
    assert not torch.are_deterministic_algorithms_enabled()


class _NudgedStep:
    """A captured step that scales the model's output layer after call `after`: a graph gone wrong."""

    def __init__(self, step, model: torch.nn.Module, *, after: int):
        self.step, self.model, self.after, self.calls = step, model, after, 0

    def __call__(self, x, y):
        loss = self.step(x, y)
        self.calls += 1
        if self.calls == self.after:
            with torch.no_grad():
                self.model.get_parameter("head.weight").mul_(1.01)
        return loss

    def __getattr__(self, name):  # stats, backend_name, close: the real step's
        return getattr(self.step, name)


def test_demo_detects_a_divergence_and_exits_1(monkeypatch, capsys):
    real_capture = graphstep.capture

    def nudged_capture(fn, **kwargs):
        return _NudgedStep(real_capture(fn, **kwargs), kwargs["model"], after=6)

    monkeypatch.setattr(graphstep, "capture", nudged_capture)
    assert main(["demo", "--steps", "8", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "losses NO" in out
    assert "losses first differ at step 7" in out  # the first call after the weights were scaled
    assert "final parameters NO" in out
    assert "parameters that differ: " in out
    assert "FAILED" in out


def test_bench_without_cuda_exits_2_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "graphstep bench needs a CUDA GPU" in err
    assert "graphstep demo" in err  # and points to what does run on CPU


def test_bench_rejects_an_unknown_method(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--methods", "eager,warp_speed"])
    assert exc.value.code == 2
    assert "warp_speed" in capsys.readouterr().err


def test_python_dash_m_graphstep_runs_the_cli():
    src = str(Path(graphstep.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "graphstep", "bench", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--methods" in result.stdout and "--suite" in result.stdout


def test_bench_parses_the_models_suite_options():
    from graphstep.cli import _parser

    args = _parser().parse_args(
        [
            "bench",
            "--suite",
            "models",
            "--quick",
            "--out",
            "/tmp/x",
            "--budget",
            "330",
            "--row-timeout",
            "200",
        ]
    )
    assert (args.suite, args.quick, args.out, args.budget, args.row_timeout) == (
        "models",
        True,
        "/tmp/x",
        330.0,
        200.0,
    )
    assert args.configs is None and args.methods is None and not args.in_process  # the suite's own, isolated
    args = _parser().parse_args(
        ["bench", "--configs", "resnet50,gcn", "--methods", "eager,graphstep", "--in-process"]
    )
    assert args.suite == "gpt" and args.configs == ["resnet50", "gcn"] and args.in_process


def test_bench_models_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--suite", "models", "--quick"]) == 2
    assert "graphstep bench needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--suite", "imagenet"], ["--budget", "0"], ["--configs", "alexnet"]])
def test_bench_rejects_bad_options(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *bad])
    assert exc.value.code == 2
    assert bad[1] in capsys.readouterr().err


def test_sparkline_falls_with_a_falling_curve():
    line = sparkline(torch.linspace(6.0, 1.0, 100), lo=1.0, hi=6.0, width=20)
    assert len(line) == 20
    ramp = next(r for r in ("▁▂▃▄▅▆▇█", "_.-=+*#@") if line[0] in r)  # block glyphs, or ASCII fallback
    levels = [ramp.index(c) for c in line]
    assert levels[0] == len(ramp) - 1 and levels[-1] == 0
    assert levels == sorted(levels, reverse=True)
