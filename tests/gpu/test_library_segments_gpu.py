"""Library calls that read the host, on a GPU (issue 22): fp16 + GradScaler + AdamW with `foreach=True`
on a transformers model runs GradScaler's inf check and the optimizer step as an eager segment, bitwise
equal to eager, overflowing steps skipped (the default AdamW, fused by graphstep on CUDA, stays in one
graph); clip_grad_norm_(error_if_nonfinite=True) raises at the replay where eager raises; examples/rl_ppo.py
runs with its defaults."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_common import assert_same_params, deterministic, needs_cuda, transformers_capture_path

import graphstep
from graphstep.demo.gpt import GPT, GPTConfig, make_batches
from graphstep.optim import make_capturable

pytestmark = needs_cuda

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
INF_CALLS = (3, 10, 17)  # call 3 is the capturing call: its replay skips too


def hf_data(n: int = 8, vocab: int = 512, batch: int = 4, seq: int = 32) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(vocab, (batch, seq), generator=g).cuda() for _ in range(n)]


def scaled_hf_step(model, opt, scaler):
    def step(ids: torch.Tensor, boost: torch.Tensor) -> torch.Tensor:  # ids: (B, T); boost: () 1 or 1e30
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss * boost).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    return step


@pytest.mark.parametrize("choice", ["foreach", "default", "fused"])
def test_fp16_grad_scaler_with_adamw_on_gpt2_is_bitwise_eager(caplog, choice):
    """`foreach=True`, and the default AdamW (which graphstep, and make_capturable for the twin, run
    fused on CUDA without telling GradScaler so): GradScaler.step's inf check and the update are an
    eager segment. The user's own `fused=True` unscales and skips on the device: one graph."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).cuda()
    twin = copy.deepcopy(model)
    runs = []
    for m in (model, twin):
        options = {"foreach": {"foreach": True}, "default": {}, "fused": {"fused": True}}[choice]
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01, **options)
        make_capturable(opt, "cuda")  # the settings graphstep gives the captured one
        runs.append((m, opt, torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=4)))
    (m_e, o_e, s_e), (m_g, o_g, s_g) = runs
    eager = scaled_hf_step(m_e, o_e, s_e)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        step = graphstep.capture(scaled_hf_step(m_g, o_g, s_g), model=m_g, optimizer=o_g)
    data = hf_data()
    scales = []
    # The eager twin takes transformers' capture path too (explicit masks, no host checks).
    with deterministic(), transformers_capture_path(), caplog.at_level(logging.WARNING, logger="graphstep"):
        for i in range(STEPS):
            boost = torch.tensor(1e30 if i in INF_CALLS else 1.0, device="cuda")
            torch.manual_seed(i)
            want = eager(data[i % len(data)], boost)
            torch.manual_seed(i)
            got = step(data[i % len(data)], boost)
            assert torch.equal(want, got), f"call {i}: eager {want.item()!r} != graphstep {got.item()!r}"
            scales.append((s_e.get_scale(), s_g.get_scale()))
    assert all(a == b for a, b in scales), scales
    for i in INF_CALLS:
        assert scales[i][0] == scales[i - 1][0] / 2, f"no back-off at the overflowing call {i}: {scales}"
    assert_same_params(m_e, m_g)
    assert torch.equal(s_e._growth_tracker, s_g._growth_tracker)
    assert step.backend_name == "cuda" and step.stats.captures == 1, step.stats
    lines = [r.message for r in caplog.records if "eager segment" in r.message]
    if choice == "fused":
        assert not lines, lines
    else:
        assert len(lines) == 1 and "GradScaler.step(AdamW)" in lines[0], lines
        assert bool(o_g.param_groups[0].get("fused")) == (choice == "default"), o_g.param_groups[0]["fused"]
        print(lines[0])
    step.close()


def test_clip_grad_norm_error_if_nonfinite_raises_at_the_replay_where_eager_raises():
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    twin = copy.deepcopy(model)
    pairs = []
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        make_capturable(opt, "cuda")
        pairs.append((m, opt))

    def make(m, opt):
        def step(x, y, boost):
            (m(x, y) * boost).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
            opt.step()
            opt.zero_grad()
            return norm

        return step

    (m_e, o_e), (m_g, o_g) = pairs
    eager, step = make(m_e, o_e), graphstep.capture(make(m_g, o_g), model=m_g, optimizer=o_g)
    data = make_batches(cfg, batch_size=4, n_batches=4, seed=0, device="cuda")
    bad = 9
    with deterministic():
        for i in range(14):
            boost = torch.tensor(float("inf") if i == bad else 1.0, device="cuda")
            outcomes = []
            for fn, opt in ((eager, o_e), (step, o_g)):
                try:
                    outcomes.append(fn(*data[i % 4], boost))
                except RuntimeError as exc:
                    outcomes.append(exc)
                    opt.zero_grad()
            want, got = outcomes
            if i == bad:
                assert isinstance(want, RuntimeError) and isinstance(got, RuntimeError), outcomes
                assert "non-finite" in str(got)
            else:
                assert torch.equal(want, got), f"call {i}"
    assert_same_params(m_e, m_g)
    assert step.stats.captures == 1, step.stats
    step.close()


def test_an_ema_updated_inside_the_step_is_bitwise_eager():
    """AveragedModel.update_parameters reads n_averaged on the host: an eager segment after the graph."""
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    twin = copy.deepcopy(model)
    runs = []
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        make_capturable(opt, "cuda")
        ema = torch.optim.swa_utils.AveragedModel(
            m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
        )

        def step(x, y, m=m, opt=opt, ema=ema):
            loss = m(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(m)
            return loss.detach()

        runs.append((step, opt, ema))
    (eager, _, ema_e), (fn, opt_g, ema_g) = runs
    step = graphstep.capture(fn, model=twin, optimizer=opt_g)
    data = make_batches(cfg, batch_size=4, n_batches=4, seed=0, device="cuda")
    with deterministic():
        for i in range(12):
            assert torch.equal(eager(*data[i % 4]), step(*data[i % 4])), f"call {i}"
    assert_same_params(ema_e, ema_g)
    assert step.stats.captures == 1 and step.stats.replays >= 8, step.stats
    step.close()


def test_the_ppo_example_runs_with_its_defaults():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(ROOT / "examples" / "rl_ppo.py")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "graphstep: final loss" in output and "eager:" in output, output[-4000:]
    print(output[-400:])
