"""Transformer Engine (2.20) training steps captured with graphstep, bitwise against eager TE.

The cases are benchmarks/te_probe.py's: te.Linear, te.LayerNormMLP and te.TransformerLayer stacks (fp32
parameters, bf16 autocast), each with FP8 off and on (`DelayedScaling`: the amax history and the scales
change on every step), with TE's activation recompute (`te.distributed.checkpoint` after an input projection,
without and with a graph-safe RNG tracker), and te.Linear with TE's FP8 weight cache
(`is_first_microbatch=True`). Per case the probe trains the model eagerly, then a fresh identical model
under `graphstep.capture`, deterministic mode, on the same batches, and compares after every call: the
loss, every parameter, and every FP8 meta tensor TE keeps (`fp8_meta`'s scale and amax_history, the
quantizers' views, the cached FP8 weights), with `torch.equal`.

Other models under the same recipe, first run after the capture (from call 5): `_secondmodel` trains one,
`_evalmodel` runs one's forward without grad (te.autocast reduces only with grad enabled, so its amaxes
wait for the next training step's reduction: eagerly that covers them, a graph captured before the model
registered would not). Either joins TE's amax buffers, and the captured step, seeing it, is captured again:
PASS with 2 captures. Recompute with or without an RNG tracker: PASS (the layers have no dropout, so the
generator state TE's checkpoint saves and puts back is not exercised by these numbers).

The probe runs in one child process for the whole module: TE's import stays out of this process (it would
slow every later capture's census of live objects here) and its process-global FP8 state starts clean.
Needs TE importable (the lead's install under /tmp/te/site-packages, see benchmarks/te_probe.py):
    PYTHONPATH=/tmp/te/site-packages:$PWD/src python -m pytest -q tests/gpu/test_transformer_engine_gpu.py
(`TE_PROBE_OUT=DIR` keeps the probe's report there.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import te_probe  # noqa: E402  (loads TE only when asked: load_te())

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_IMPORTS = (
    torch.cuda.is_available()
    and subprocess.run(
        [sys.executable, "-c", "import transformer_engine.pytorch"], capture_output=True
    ).returncode
    == 0
)
if not _IMPORTS:
    pytest.skip(
        "needs Transformer Engine (transformer_engine.pytorch does not import)", allow_module_level=True
    )

# FP8 cases are listed always; on a GPU without FP8 the probe does not run them and they skip.
CASES = te_probe.cases(fp8_ok=True)


@pytest.fixture(scope="module")
def probe_rows(tmp_path_factory) -> dict[str, dict]:
    out = (
        Path(os.environ["TE_PROBE_OUT"])
        if "TE_PROBE_OUT" in os.environ
        else tmp_path_factory.mktemp("te_probe")
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "te_probe.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(done.stdout[-20000:], done.stderr[-5000:])
    found = list(out.glob("*_te-probe.json"))
    assert found, f"the probe wrote no report (exit {done.returncode}):\n{done.stderr[-5000:]}"
    report = json.loads(found[0].read_text())
    assert not report.get("import_error"), report.get("import_error")
    return {row["case"]: row for row in report["probe"]}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_te_step_bitwise_equal_to_eager(probe_rows, case):
    if case.name not in probe_rows:
        pytest.skip(f"{case.name}: not run (FP8 unavailable on this GPU)")
    row = probe_rows[case.name]
    said = f"{case.name}: {row['result']}: {row['detail']}\nstats: {row['stats']}"
    assert row["result"] == "PASS", said
    # The whole step in graphs: replays after the warm-ups, nothing run eagerly instead, no break.
    stats = row["stats"]
    assert stats["replays"] > 0 and stats["eager_calls"] == 0 and stats["graph_breaks"] == 0, stats
    if (
        case.second_model or case.eval_model
    ):  # the model that joined: captured again, its reduction covering it
        assert stats["captures"] == 2, stats
