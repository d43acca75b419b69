"""Every script in examples/ runs a few steps on CPU (graphstep's eager backend) and exits 0.

Each runs in a process of its own, as `python examples/X.py ...` with its output and exit code; the
DDP/FSDP2 example under torchrun with two gloo ranks. The single-process examples are forked from a
server that has imported torch once (multiprocessing's "forkserver", tests/preload.py), instead of
each importing it afresh; each imports its framework itself. Examples whose framework is not installed
are skipped, saying which.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import preload

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


def _run_script(path: str, argv: list[str], log: str) -> None:
    """In the forked process: run `path` as `__main__` with `argv`, its output (fds 1 and 2) in `log`."""
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # as `python path` puts the script's folder first
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_forked(script: Path, argv: list[str], log: Path) -> tuple[int, str]:
    proc = preload.context().Process(target=_run_script, args=(str(script), argv, str(log)))
    proc.start()
    proc.join(timeout=420)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode, log.read_text()


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs_on_cpu(name: str, tmp_path: Path) -> None:
    args, package, expected = CASES[name]
    if package and package != "torchrun" and importlib.util.find_spec(package) is None:
        pytest.skip(f"examples/{args[0]} needs {package}, which is not installed")
    argv = [*args[1:], "--device", "cpu"]
    command = f"python examples/{args[0]} {' '.join(argv)}"
    if package == "torchrun":
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(
            [*TORCHRUN, str(EXAMPLES / args[0]), *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
        code, output = done.returncode, done.stdout + done.stderr
    else:
        code, output = _run_forked(EXAMPLES / args[0], argv, tmp_path / "output.txt")
    assert code == 0, f"{command} exited {code}:\n{output[-4000:]}"
    assert expected in output, output[-4000:]
