"""The command line on CPU: `graphstep demo` end to end, `graphstep bench` without CUDA, the results writer."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphstep
from graphstep.cli import main
from graphstep.demo import bench
from graphstep.demo.train import sparkline

REQUIRED_ROW_KEYS = {
    "config",
    "method",
    "step_ms",
    "kernel_ms",
    "peak_reserved_gib",
    "capture_s",
    "ratio_to_graphstep",
}


def test_demo_on_cpu_trains_bitwise_equal_to_eager(capsys):
    assert main(["demo", "--steps", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "graphstep runs its eager backend" in out
    assert "losses yes (12 steps)" in out
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
    assert main(["demo", "--steps", "12", "--device", "cpu"]) == 1
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
    assert "--quick" in result.stdout and "--methods" in result.stdout


def _fake_rows() -> list[dict]:
    # Invented numbers: this tests the writer, not a benchmark.
    rows = []
    for config, scale in (("tiny", 1.0), ("gpt2_small", 10.0)):
        for method, ms in (("eager", 12.0), ("manual_graph", 1.5), ("graphstep", 2.0)):
            rows.append(
                dict(config=config, method=method, step_ms=ms * scale, kernel_ms=1.0 * scale, peak_reserved_gib=0.5,
                     capture_s=3.0, ratio_to_graphstep=None, final_loss=5.0, error=None)
            )  # fmt: skip
    rows.append(
        dict(config="tiny", method="compile", step_ms=None, kernel_ms=None, peak_reserved_gib=None, capture_s=None,
             ratio_to_graphstep=None, final_loss=None, error="RuntimeError: a | b")
    )  # fmt: skip
    return rows


def _fake_meta(*, quick: bool) -> dict:
    return dict(
        gpu="h200", gpu_name="NVIDIA H200", torch=torch.__version__, cuda="13.0", date="2026-01-02", python="3.11",
        graphstep="0.1.0", quick=quick, methods=["eager", "manual_graph", "graphstep", "compile"],
        configs={"tiny": dict(model={"n_layer": 4}, batch_size=8, tokens_per_step=512, parameters=930_000,
                              timed_steps=30, warmup_calls=6, profiled_steps=3)},
        step="AdamW", measurement=bench.MEASUREMENT,
    )  # fmt: skip


def test_add_ratios_divides_by_graphstep_of_the_same_config():
    rows = _fake_rows()
    bench.add_ratios(rows)
    ratio = {(r["config"], r["method"]): r["ratio_to_graphstep"] for r in rows}
    assert ratio["tiny", "graphstep"] == 1.0
    assert ratio["tiny", "eager"] == 6.0
    assert ratio["gpt2_small", "manual_graph"] == 0.75
    assert ratio["tiny", "compile"] is None  # failed: no step time


def test_write_results_writes_json_markdown_and_chart(tmp_path):
    rows = _fake_rows()
    bench.add_ratios(rows)
    paths = bench.write_results(rows, _fake_meta(quick=False), tmp_path / "results")
    names = [p.name for p in paths]
    assert names[:2] == ["h200_2026-01-02.json", "h200_2026-01-02.md"]

    data = json.loads(paths[0].read_text())
    assert {"gpu", "torch", "date", "cuda", "configs", "rows", "measurement"} <= data.keys()
    assert data["gpu"] == "h200" and data["date"] == "2026-01-02"
    assert len(data["rows"]) == len(rows)
    assert all(r.keys() >= REQUIRED_ROW_KEYS for r in data["rows"])
    assert data["rows"][0]["ratio_to_graphstep"] == 6.0

    md = paths[1].read_text()
    assert "NVIDIA H200" in md and "| config | method | step ms |" in md
    assert "| tiny | eager | 12.00 | 6.00 | 1.00 | 0.50 | 3.0 |" in md
    assert "RuntimeError: a / b" in md  # a '|' in an error must not break the table
    assert all(f"`{k}`" in md for k in bench.MEASUREMENT)

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(paths) == 2
    else:
        assert names[2] == "h200_2026-01-02.png"
        assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_results_without_matplotlib_skips_the_chart_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        paths = bench.write_results(_fake_rows(), _fake_meta(quick=True), tmp_path)
    assert [p.name for p in paths] == ["h200_2026-01-02_quick.json", "h200_2026-01-02_quick.md"]
    assert not list(tmp_path.glob("*.png"))
    assert "matplotlib is not installed" in caplog.text


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla V100-SXM2-16GB", "v100"),
    ],
)
def test_gpu_slug(name, slug):
    assert bench.gpu_slug(name) == slug


def test_sparkline_falls_with_a_falling_curve():
    line = sparkline(torch.linspace(6.0, 1.0, 100), lo=1.0, hi=6.0, width=20)
    assert len(line) == 20
    ramp = next(r for r in ("▁▂▃▄▅▆▇█", "_.-=+*#@") if line[0] in r)  # block glyphs, or ASCII fallback
    levels = [ramp.index(c) for c in line]
    assert levels[0] == len(ramp) - 1 and levels[-1] == 0
    assert levels == sorted(levels, reverse=True)
