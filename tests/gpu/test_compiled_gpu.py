"""A `torch.compile`d transformers Llama inside graphstep, from a cold compile cache (issue 34), bitwise
against the same compiled model stepped eagerly: losses and parameters.

A fresh process with empty inductor and triton cache directories, as on a new machine: every graph
compiles in it, so a branch the warm-ups did not compile would compile during the capture (it did: the
causal mask of `masking_utils.sdpa_mask`, "operation not permitted when stream is capturing").
Deterministic mode and `CUBLAS_WORKSPACE_CONFIG=:4096:8`; `torch.equal`, no tolerances.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
MARK = "compiled_llama_result: "

if __name__ != "__main__":  # collected by pytest; the child below runs without it
    from gpu_common import needs_cuda

    pytestmark = [*needs_cuda, pytest.mark.timeout(600)]


def test_compiled_llama_from_a_cold_cache_is_bitwise_equal_to_compiled_eager(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),  # empty: everything compiles here
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the child exited {done.returncode}:\n{output[-6000:]}"
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith(MARK))[len(MARK) :])
    print(f"\ncompiled Llama, cold cache: {result}")
    assert result["losses_equal"] == [True] * STEPS, result
    assert result["params_equal"], result
    stats = result["stats"]
    assert stats["captures"] == 1 and stats["warmup_calls"] + stats["replays"] == STEPS, stats
    # Nothing compiled after the warm-ups, and nothing would have compiled during the capture.
    assert sum(result["frames_per_call"][stats["warmup_calls"] :]) == 0, result
    assert "would compile during the capture" not in output, output[-6000:]


def _child() -> None:
    """The run itself, in a process of its own."""
    import logging

    import transformers

    import graphstep
    from graphstep.backends.libraries import as_captured
    from graphstep.demo.train import deterministic
    from graphstep.optim import make_capturable

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    model.train()
    twins = []
    for m in (model, copy.deepcopy(model)):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        make_capturable(opt, "cuda")  # the settings graphstep gives the captured one
        twins.append((m, opt, torch.compile(m)))

    def make_step(m, opt, forward):
        def step(input_ids, attention_mask, labels):  # (B, T) each; no mask: packed sequences
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    (m_e, o_e, f_e), (m_g, o_g, f_g) = twins
    eager = make_step(m_e, o_e, f_e)
    step = graphstep.capture(make_step(m_g, o_g, f_g), model=m_g, optimizer=o_g)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(cfg.vocab_size, (4, 32), generator=g).cuda() for _ in range(STEPS)]
    losses, frames = [], []
    counters = torch._dynamo.utils.counters
    with deterministic():
        for ids in batches:
            start = counters["frames"]["total"]
            got = step(ids, None, ids)  # first: the twin runs the code graphstep compiled, not the reverse
            frames.append(counters["frames"]["total"] - start)
            with as_captured():  # the eager twin on transformers' capture path, as graphstep's calls
                want = eager(ids, None, ids)
            losses.append(torch.equal(want, got))
    torch.cuda.synchronize()
    params = all(torch.equal(p, q) for p, q in zip(m_e.parameters(), m_g.parameters()))
    stats = {k: v for k, v in vars(step.stats).items() if isinstance(v, int)}
    result = dict(losses_equal=losses, params_equal=params, stats=stats, frames_per_call=frames,
                  torch=torch.__version__, transformers=transformers.__version__,
                  gpu=torch.cuda.get_device_name())  # fmt: skip
    print(MARK + json.dumps(result), flush=True)
    step.close()


if __name__ == "__main__":
    _child()
