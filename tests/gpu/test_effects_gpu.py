"""On a GPU, with real models: a step that counts in Python is refused at capture with its line and
nothing lost; counted in a device tensor, it is bitwise equal to eager (transformers GPT-2, torchvision
ResNet). Libraries' own Python bookkeeping in every forward is never refused."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from gpu_common import assert_same_params, deterministic, needs_cuda, transformers_capture_path

import graphstep
from graphstep.errors import PythonWriteError
from graphstep.optim import make_capturable

pytestmark = needs_cuda
STEPS = 12
PROGRESS = types.SimpleNamespace(steps=0)  # a training script's counter


def pair(make_model):
    torch.manual_seed(0)
    model = make_model().cuda()
    out = []
    for m in (model, copy.deepcopy(model)):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
        make_capturable(opt, "cuda")  # the settings graphstep gives the captured one
        out.append((m, opt))
    return out


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_data(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(512, (4, 64), generator=g)
        mask = torch.ones(4, 64, dtype=torch.int64)
        mask[0, 32:] = 0
        out.append((ids.cuda(), mask.cuda(), ids.clone().cuda()))
    return out


def counting_step(model, opt, counter=None):
    """The GPT-2 step, counting its calls in PROGRESS (Python) or in `counter` (a device tensor)."""

    def step(input_ids, attention_mask, labels):
        if counter is None:
            PROGRESS.steps += 1  # the refused write
        else:
            counter.add_(1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_a_python_counter_in_a_transformers_step_is_refused_and_nothing_is_lost():
    (m_e, o_e), (m_g, o_g) = pair(gpt2)
    data = gpt2_data(4)
    PROGRESS.steps = 0
    with deterministic():
        eager = counting_step(m_e, o_e)
        torch.manual_seed(1)  # GPT-2's dropout: both twins draw the same numbers
        for batch in data[:3]:
            eager(*batch)
        captured = graphstep.capture(counting_step(m_g, o_g), model=m_g, optimizer=o_g)
        torch.manual_seed(1)
        for batch in data[:3]:
            captured(*batch)  # warm-ups: eager steps
        with pytest.raises(PythonWriteError) as info:
            captured(*data[3])
    text = str(info.value)
    assert "test_effects_gpu.py" in text and "PROGRESS.steps += 1" in text, text
    assert "attribute 'steps' of a SimpleNamespace object: 6 -> 7" in text, text
    assert PROGRESS.steps == 6  # three eager steps of each twin, the capture's write undone
    assert_same_params(m_e, m_g)
    for p, q in zip(m_e.parameters(), m_g.parameters()):
        for key, value in o_e.state[p].items():
            assert torch.equal(value, o_g.state[q][key]), f"optimizer state {key!r} differs"
    captured.close()


def test_a_device_counter_in_a_transformers_step_is_bitwise_equal_to_eager():
    (m_e, o_e), (m_g, o_g) = pair(gpt2)
    data = gpt2_data(STEPS)
    counters = [torch.zeros((), dtype=torch.long, device="cuda") for _ in range(2)]
    # Compared with an eager twin that takes transformers' capture path too (explicit masks).
    with deterministic(), transformers_capture_path():
        eager = counting_step(m_e, o_e, counters[0])
        captured = graphstep.capture(counting_step(m_g, o_g, counters[1]), model=m_g, optimizer=o_g)
        for batch in data:
            torch.manual_seed(1)
            want = eager(*batch)
            torch.manual_seed(1)
            assert torch.equal(want, captured(*batch))
    assert_same_params(m_e, m_g)
    assert torch.equal(counters[0], counters[1]) and int(counters[1]) == STEPS
    assert captured.stats.captures == 1
    captured.close()


def test_a_counter_on_a_torchvision_wrapper_is_refused_and_a_buffer_is_equal_to_eager():
    tv = pytest.importorskip("torchvision")

    class Counted(torch.nn.Module):
        def __init__(self, as_buffer: bool):
            super().__init__()
            self.net = tv.models.resnet18(num_classes=10)
            self.as_buffer = as_buffer
            if as_buffer:
                self.register_buffer("seen", torch.zeros((), dtype=torch.long))
            else:
                self.seen = 0

        def forward(self, x):
            if self.as_buffer:
                self.seen.add_(1)
            else:
                self.seen += 1
            return self.net(x)

    def step_of(model, opt):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 32, 32, generator=g).cuda(), torch.randint(10, (8,), generator=g).cuda())]
    data = data * STEPS
    with deterministic():
        (m_e, o_e), (m_g, o_g) = pair(lambda: Counted(as_buffer=False))
        captured = graphstep.capture(step_of(m_g, o_g), model=m_g, optimizer=o_g)
        for x, y in data[:3]:
            step_of(m_e, o_e)(x, y)
            captured(x, y)
        with pytest.raises(PythonWriteError, match=r"self\.seen \+= 1"):
            captured(*data[3])
        assert m_g.seen == m_e.seen == 3
        assert_same_params(m_e, m_g)
        captured.close()

        (m_e, o_e), (m_g, o_g) = pair(lambda: Counted(as_buffer=True))
        eager = step_of(m_e, o_e)
        captured = graphstep.capture(step_of(m_g, o_g), model=m_g, optimizer=o_g)
        for x, y in data:
            assert torch.equal(eager(x, y), captured(x, y))
        assert_same_params(m_e, m_g)
        assert torch.equal(m_e.seen, m_g.seen) and int(m_g.seen) == STEPS
        assert captured.stats.captures == 1
        captured.close()
