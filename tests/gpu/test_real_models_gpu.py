"""Real training loops on models no one here wrote, on a GPU, bitwise against an eager twin:
torchvision ResNet with SGD + momentum + OneCycleLR (the optimizer moves to an eager segment),
a transformers BERT with AdamW + linear warmup from lr 0, GPT-2 with gradient checkpointing and an
attention mask (transformers syncs with the host only when not capturing), and graph variants
(train/eval flips, freezing) on the demo GPT. Deterministic mode; each model is skipped, saying
so, when its package is missing."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from gpu_common import assert_same_params, deterministic, needs_cuda, transformers_capture_path

import graphstep
from graphstep.optim import make_capturable

pytestmark = needs_cuda
STEPS = 24


def twins(make_model: Callable, make_opt: Callable, make_sched: Callable | None = None) -> list[tuple]:
    torch.manual_seed(0)
    model = make_model().cuda()
    out = []
    for m in (model, copy.deepcopy(model)):
        opt = make_opt(m)
        make_capturable(opt, "cuda")  # the settings graphstep gives the captured one
        out.append((m, opt, make_sched(opt) if make_sched else None))
    return out


def side_by_side(pair: list[tuple], make_step: Callable, data: list, config=None, between=None) -> tuple:
    """Train the eager twin and the captured one on the same data; returns (step, eager ms, graph ms)."""
    (m_e, o_e, s_e), (m_g, o_g, s_g) = pair
    eager = make_step(m_e, o_e)
    step = graphstep.capture(make_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    times = {"eager": [], "graph": []}
    for i, batch in enumerate(data):
        for name, fn, sched, model in (("eager", eager, s_e, m_e), ("graph", step, s_g, m_g)):
            if between is not None:
                between(i, model)
            torch.manual_seed(i)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = fn(*batch)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            if name == "eager":
                want = loss
            else:
                assert torch.equal(want, loss), (
                    f"step {i}: eager {want.item()!r} != graphstep {loss.item()!r}"
                )
            if sched is not None:
                sched.step()
    assert_same_params(m_e, m_g)
    ms = {k: 1e3 * sorted(v[-8:])[4] for k, v in times.items()}
    print(f"{step.__name__}: eager {ms['eager']:.2f} ms, graphstep {ms['graph']:.2f} ms, {step.stats}")
    return step, ms


def test_torchvision_resnet_sgd_momentum_one_cycle():
    tv = pytest.importorskip("torchvision")

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def one_cycle(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS + 2)

    def make_step(model, opt):
        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(8, 3, 64, 64, generator=g).cuda().to(memory_format=torch.channels_last),
            torch.randint(10, (8,), generator=g).cuda(),
        )
        for _ in range(STEPS)
    ]
    pair = twins(
        lambda: tv.models.resnet18(num_classes=10).to(memory_format=torch.channels_last), make_opt, one_cycle
    )
    with deterministic():
        step, _ = side_by_side(pair, make_step, data)
    assert step.stats.captures == 1  # OneCycleLR drives SGD's baked lr and momentum: an eager segment


def hf_step(model, opt):
    def step(input_ids, attention_mask, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def hf_data(vocab: int, batch: int = 4, seq: int = 64, n: int = STEPS, labels: str = "tokens") -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, seq // 2 :] = 0  # padding in one row: the mask matters
        y = ids.clone() if labels == "tokens" else torch.randint(2, (batch,), generator=g)
        out.append((ids.cuda(), mask.cuda(), y.cuda()))
    return out


def test_transformers_bert_adamw_linear_warmup_from_zero():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01)

    def warmup(o):
        return transformers.get_linear_schedule_with_warmup(o, num_warmup_steps=8, num_training_steps=STEPS)

    pair = twins(lambda: transformers.BertForSequenceClassification(cfg), make_opt, warmup)
    with deterministic(), transformers_capture_path():
        step, _ = side_by_side(pair, hf_step, hf_data(512, labels="class"))
    assert step.stats.captures == 1


def test_transformers_gpt2_gradient_checkpointing_with_a_mask_captures():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)

    def make_model():
        model = transformers.GPT2LMHeadModel(cfg)
        model.gradient_checkpointing_enable()
        return model

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=3e-4)

    pair = twins(make_model, make_opt)
    data = hf_data(512)
    # Captured as transformers really runs it: its host checks run in warm-up only.
    with deterministic():
        _, (m_g, o_g, _) = pair
        step = graphstep.capture(hf_step(m_g, o_g), model=m_g, optimizer=o_g)
        for batch in data[:6]:
            step(*batch)
        assert step.stats.captures == 1 and step.stats.replays == 3
        step.close()
    # Bitwise against an eager twin that takes transformers' capture path too.
    pair = twins(make_model, make_opt)
    with deterministic(), transformers_capture_path():
        step, _ = side_by_side(pair, hf_step, data)
    assert step.stats.captures == 1


def test_verify_against_a_fresh_capture_passes_for_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    ((model, opt, _),) = twins(
        lambda: transformers.GPT2LMHeadModel(cfg), lambda m: torch.optim.AdamW(m.parameters())
    )[:1]
    config = graphstep.Config(verify_every=2, verify_against="capture")
    step = graphstep.capture(hf_step(model, opt), model=model, optimizer=opt, config=config)
    with deterministic():
        for batch in hf_data(512, n=10):
            step(*batch)
    assert step.stats.replays == 7 and step.stats.captures == 1


def test_variants_for_train_eval_flips_and_freezing_on_the_demo_gpt():
    from graphstep.demo.gpt import GPT, GPTConfig, make_batches

    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)

    def make_step(model, opt):
        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    def between(i, model):
        model.train(i % 2 == 0)  # flip every call
        model.blocks[0].requires_grad_(i % 4 < 2)  # freeze and unfreeze the first block
        model.blocks[1].drop.p = 0.0 if i % 3 == 0 else 0.1  # a dropout schedule

    pair = twins(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    data = make_batches(cfg, batch_size=4, n_batches=STEPS, seed=0, device="cuda")
    with deterministic():
        step, _ = side_by_side(pair, make_step, data, between=between)
    assert step.stats.captures <= 12 and step.stats.variant_switches > 0


LOSS_CFG = {"smoothing": 0.0, "aux": {"weight": 0.1}}  # a config dict the loss reads, changed in place
AUX_TERMS = [1.0, 0.5]  # a list the loss reads, changed in place


def test_transformers_gpt2_loss_reading_a_config_dict_and_list_changed_in_place():
    """Label smoothing and an auxiliary weight read from a dict and a list that the training loop
    changes in place every few steps (a curriculum): each new value picks or captures a graph, and
    every step stays bitwise equal to eager."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)

    def make_step(model, opt):
        def step(input_ids, attention_mask, labels):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten(),
                label_smoothing=LOSS_CFG["smoothing"],
            )
            loss = loss + LOSS_CFG["aux"]["weight"] * AUX_TERMS[0] * logits.float().square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss

        return step

    def curriculum(i, model):
        LOSS_CFG["smoothing"] = (0.0, 0.1, 0.2)[(i // 5) % 3]  # 0.0 again from call 15: the first graph
        LOSS_CFG["aux"]["weight"] = 0.1 if i < 12 else 0.05
        AUX_TERMS[0] = 1.0 if (i // 7) % 2 == 0 else 0.5

    pair = twins(
        lambda: transformers.GPT2LMHeadModel(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4)
    )
    try:
        with deterministic(), transformers_capture_path():
            step, _ = side_by_side(pair, make_step, hf_data(512), between=curriculum)
    finally:
        LOSS_CFG["smoothing"], LOSS_CFG["aux"]["weight"], AUX_TERMS[0] = 0.0, 0.1, 1.0
    assert step.stats.captures >= 4 and step.stats.variants >= 3, step.stats
