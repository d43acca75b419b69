"""Every script in examples/ runs a few steps on CPU (graphstep's eager backend) and exits 0.

Each runs in its own process, as a user would run it; the DDP/FSDP2 example under torchrun with two
gloo ranks. Examples whose framework is not installed are skipped, saying which.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

# name: (command after the interpreter, package it needs or None, a line its output must contain)
CASES = {
    "plain_loop": (["plain_loop.py", "--steps", "10"], None, "graphstep: final loss"),
    "vision_classifier": (["vision_classifier.py", "--steps", "10"], None, "graphstep: final loss"),
    "hf_finetune_bert": (["hf_finetune.py", "--steps", "10"], "transformers", "graphstep: final loss"),
    "hf_finetune_llama": (
        ["hf_finetune.py", "--steps", "10", "--model", "llama"],
        "transformers",
        "final loss",
    ),
    "hf_finetune_trainer": (
        ["hf_finetune.py", "--steps", "10", "--trainer"],
        "accelerate",  # the Trainer needs it beside transformers
        "mean training loss",
    ),
    "lightning_automatic": (["lightning_module.py", "--steps", "10"], "pytorch_lightning", "final loss"),
    "lightning_manual": (
        ["lightning_module.py", "--steps", "10", "--manual"],
        "pytorch_lightning",
        "final loss",
    ),
    "ddp": (["ddp_torchrun.py", "--steps", "8"], "torchrun", "on 2 ranks"),
    "fsdp2": (["ddp_torchrun.py", "--steps", "8", "--fsdp"], "torchrun", "on 2 ranks"),
    "rl_ppo": (["rl_ppo.py", "--iters", "3", "--epochs", "2", "--minibatches", "2"], None, "final loss"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs_on_cpu(name: str) -> None:
    args, package, expected = CASES[name]
    if package and package != "torchrun" and importlib.util.find_spec(package) is None:
        pytest.skip(f"examples/{args[0]} needs {package}, which is not installed")
    prefix = TORCHRUN if package == "torchrun" else [sys.executable]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [*prefix, str(EXAMPLES / args[0]), *args[1:], "--device", "cpu"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output[-4000:]}"
    assert expected in output, output[-4000:]
