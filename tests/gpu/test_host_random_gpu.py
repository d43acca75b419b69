"""Host random draws on a GPU: transformers' LayerDrop (BART, `torch.rand([])` on the CPU tested in
Python) is refused at capture, naming the module and the fix, with nothing lost; with LayerDrop off
BART is bitwise equal to eager, torch's CPU generator included (older transformers still draw per
layer then: graphstep redraws after each replay); a torchvision ResNet-18 with mixup drawn on the
device is bitwise equal to eager. Deterministic mode; each model is skipped, saying so, when its
package is missing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from gpu_common import assert_same_params, deterministic, needs_cuda, transformers_capture_path

import graphstep
from graphstep.errors import HostRandomError
from graphstep.optim import make_capturable

pytestmark = needs_cuda
STEPS = 20


def twins(make_model, make_opt) -> list[tuple]:
    torch.manual_seed(0)
    model = make_model().cuda().train()
    out = []
    for m in (model, copy.deepcopy(model)):
        opt = make_opt(m)
        make_capturable(opt, "cuda")  # the settings graphstep gives the captured one
        out.append((m, opt))
    return out


def side_by_side(pair: list[tuple], make_step, data: list) -> graphstep.CapturedStep:
    """Eager twin and captured step on the same data, the same CUDA seed before each call."""
    (m_e, o_e), (m_g, o_g) = pair
    eager = make_step(m_e, o_e)
    step = graphstep.capture(make_step(m_g, o_g), model=m_g, optimizer=o_g)
    for i, batch in enumerate(data):
        torch.manual_seed(i)
        want = eager(*batch)
        want_cpu_rng = torch.get_rng_state()
        torch.manual_seed(i)
        got = step(*batch)
        assert torch.equal(want, got), f"step {i}: eager {want.item()!r} != graphstep {got.item()!r}"
        assert torch.equal(torch.get_rng_state(), want_cpu_rng), f"step {i}: the CPU generator differs"
    assert_same_params(m_e, m_g)
    assert step.stats.captures == 1 and step.stats.replays == len(data) - 3
    return step


# -- transformers BART with LayerDrop ----------------------------------------------------------------


def bart(layerdrop: float):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(
        vocab_size=512,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=128,
        encoder_layerdrop=layerdrop,
        decoder_layerdrop=layerdrop,
    )
    return transformers.BartForConditionalGeneration(cfg)


def bart_step(model, opt):
    def step(input_ids, attention_mask, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def bart_data(n: int = STEPS, batch: int = 4, seq: int = 32) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 512, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, seq // 2 :] = 0
        out.append((ids.cuda(), mask.cuda(), torch.randint(3, 512, (batch, seq), generator=g).cuda()))
    return out


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=3e-4)


def test_bart_layerdrop_is_refused_at_capture_with_the_module_and_the_fix():
    (model, opt), _ = twins(lambda: bart(0.5), adamw)
    step = graphstep.capture(bart_step(model, opt), model=model, optimizer=opt)
    data = bart_data(4)
    report = graphstep.explain(step, *data[0])
    assert any("host random draw" in h and "layerdrop" in h for h in report.hazards), report.hazards
    for batch in data[:3]:
        step(*batch)  # warm-up calls are eager: LayerDrop draws freely
    params = [p.detach().clone() for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    with pytest.raises(HostRandomError) as info:
        step(*data[3])
    message = str(info.value)
    print(message)
    assert "torch's default CPU generator" in message and "modeling_bart.py" in message
    assert "BartEncoder.layerdrop=0.5" in message and "encoder_layerdrop=0" in message
    assert "test_host_random_gpu.py" in message  # the user's line: the call of the model
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert step.stats.captures == 0


def test_bart_without_layerdrop_is_bitwise_equal_to_eager():
    pair = twins(lambda: bart(0.0), adamw)
    with deterministic(), transformers_capture_path():
        side_by_side(pair, bart_step, bart_data())


# -- torchvision ResNet-18 with mixup drawn on the device ---------------------------------------------


def test_resnet18_with_device_side_mixup_is_bitwise_equal_to_eager():
    tv = pytest.importorskip("torchvision")

    def make_step(model, opt):
        def step(x, y):
            lam = torch.rand((), device=x.device)
            x = lam * x + (1 - lam) * x.flip(0)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
                loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y.flip(0))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(8, 3, 32, 32, generator=g).cuda(), torch.randint(10, (8,), generator=g).cuda())
        for _ in range(STEPS)
    ]
    pair = twins(
        lambda: tv.models.resnet18(num_classes=10),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    )
    with deterministic():
        side_by_side(pair, make_step, data)
