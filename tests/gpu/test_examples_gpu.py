"""Every script in examples/ runs on a CUDA GPU with its default arguments (CUDA graphs, then the same
training without graphstep) and exits 0, printing its step time against the framework alone.

Each runs in its own process, as a user would run it. The DDP/FSDP2 example needs two GPUs: it stays
in tests/test_examples.py (CPU, gloo) until a two-GPU machine runs this suite. Each speed-up is
printed and, when $OUT is set, appended as a JSON line to $OUT/examples_gpu.jsonl.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_common import needs_cuda

pytestmark = [*needs_cuda, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# name: (arguments after the script, package it needs or None, prints a speed-up against eager)
CASES = {
    "plain_loop": (["plain_loop.py"], None, True),
    "vision_classifier": (["vision_classifier.py"], None, True),
    "hf_finetune_bert": (["hf_finetune.py"], "transformers", True),
    "hf_finetune_llama": (["hf_finetune.py", "--model", "llama"], "transformers", True),
    "hf_finetune_trainer": (["hf_finetune.py", "--trainer"], "accelerate", False),
    "lightning_automatic": (["lightning_module.py"], "pytorch_lightning", True),
    "lightning_manual": (["lightning_module.py", "--manual"], "pytorch_lightning", True),
    "rl_ppo": (["rl_ppo.py"], None, True),
}

_TIME = re.compile(r"^(graphstep|eager):\s+final loss \S+, ([\d.]+) ms", re.M)


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs_on_the_gpu_with_its_defaults(name: str) -> None:
    args, package, compares = CASES[name]
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"examples/{args[0]} needs {package}, which is not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(EXAMPLES / args[0]), *args[1:]]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output[-4000:]}"
    if not compares:
        assert "graphstep:" in output and "captures=" in output, output[-4000:]
        print(f"\n{name}: {output.strip().splitlines()[-1]}")
        return
    times = dict(_TIME.findall(output))
    assert set(times) == {"graphstep", "eager"}, f"no step times printed:\n{output[-4000:]}"
    graphed, eager = float(times["graphstep"]), float(times["eager"])
    row = {"example": name, "args": args, "graphstep_ms": graphed, "eager_ms": eager}
    row |= {
        "speedup": round(eager / graphed, 2),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    print(f"\n{name}: graphstep {graphed:.2f} ms, without {eager:.2f} ms ({row['speedup']}x)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "examples_gpu.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
