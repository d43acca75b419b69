"""Guards on a real GPU: each change between calls gives results bitwise equal to eager, or a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_common import assert_same_params, batches, deterministic, gpt_pair, needs_cuda, train_step

import graphstep
from graphstep.errors import HostSyncError
from graphstep.guards.churn import VariantChurn

pytestmark = needs_cuda


def lr_by_hand(model, opt):
    opt.param_groups[0]["lr"] = 3e-4


def betas(model, opt):
    opt.param_groups[0]["betas"] = (0.8, 0.95)


def param_data(model, opt):
    model.head.weight.data = model.head.weight.data.clone()


def eval_then_train(model, opt):
    model.eval() if model.training else model.train()


def load_optimizer_state(model, opt):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


# name: (change, handled by a re-capture?). A float lr is copied into the graph's lr tensor and a
# same-layout optimizer state into the graph's state tensors: no re-capture needed for those.
CHANGES = {
    "param.data reassigned": (param_data, True),
    "optimizer.load_state_dict": (load_optimizer_state, False),
    "eval then train": (eval_then_train, True),
    "float lr by hand": (lr_by_hand, False),
    "betas": (betas, True),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_change_between_calls_stays_bitwise_equal(name):
    change, recaptures = CHANGES[name]
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(30)
    eager_fn = train_step(m_e, o_e)
    with deterministic(), graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g) as step:
        for i, (x, y) in enumerate(data):
            if i in (10, 20):  # eval at 10, train again at 20 for the mode change
                change(m_e, o_e)
                change(m_g, o_g)
                # graphstep copies an assigned float lr into its lr tensor; give eager the same
                # settings (a float lr is another code path, rounded differently).
                graphstep.optim.make_capturable(o_e, "cuda")
            e, g = eager_fn(x, y), step(x, y)
            assert torch.equal(e, g), f"{name}: step {i}: eager {e.item()} != graphstep {g.item()}"
        captures = step.stats.captures
    assert_same_params(m_e, m_g)
    assert (captures >= 2) == recaptures, f"{name}: {captures} captures"


def test_grads_set_to_none_between_calls_stay_equal():
    """Gradient accumulation across calls, cleared by the user every 4 calls."""
    (m_e, o_e), (m_g, o_g) = gpt_pair()

    def accumulate(model, opt):
        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / 4
            loss.backward()
            return loss

        return step

    data = batches(32)
    eager_fn = accumulate(m_e, o_e)
    with deterministic(), graphstep.capture(accumulate(m_g, o_g), model=m_g, optimizer=o_g) as step:
        for i, (x, y) in enumerate(data):
            e, g = eager_fn(x, y), step(x, y)
            assert torch.equal(e, g), f"step {i}"
            if i % 4 == 3:
                for opt in (o_e, o_g):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    assert_same_params(m_e, m_g)


def test_closure_tensor_replaced_between_calls():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    scale = torch.tensor(1.0, device="cuda")

    def make(model, opt):
        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) * scale
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    data = batches(30)
    eager_fn, step = make(m_e, o_e), graphstep.capture(make(m_g, o_g), model=m_g, optimizer=o_g)
    with deterministic():
        for i, (x, y) in enumerate(data):
            if i == 15:
                scale = torch.tensor(0.5, device="cuda")  # rebinds the cell both steps read
            assert torch.equal(eager_fn(x, y), step(x, y)), f"step {i}"
    assert_same_params(m_e, m_g)
    assert step.stats.captures == 2
    step.close()


def test_item_inside_the_step_is_refused_before_capture():
    (_, _), (model, opt) = gpt_pair()

    def fn(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if loss.item() != loss.item():  # a NaN check with a host sync
            raise FloatingPointError
        return loss

    step = graphstep.capture(fn, model=model, optimizer=opt)
    data = batches(4)
    for x, y in data[:3]:
        step(x, y)  # warm-ups complete as real steps
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(HostSyncError, match=r"loss\.item\(\) != loss\.item\(\)"):
        step(*data[3])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.cuda.get_sync_debug_mode() == 0
    step.close()


def test_verify_every_agrees_with_eager_on_the_gpu():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    data = batches(20)
    eager_fn = train_step(m_e, o_e)
    config = graphstep.Config(verify_every=3)
    with (
        deterministic(),
        graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g, config=config) as step,
    ):
        for i, (x, y) in enumerate(data):
            assert torch.equal(eager_fn(x, y), step(x, y)), f"step {i}"
        assert step.stats.replays == 17  # 3 warm-ups; the capturing call replays too
    assert_same_params(m_e, m_g)


def test_explain_on_the_gpu_finds_the_host_sync_and_changes_nothing():
    (_, _), (model, opt) = gpt_pair()
    inner = train_step(model, opt)

    def fn(x, y):
        loss = inner(x, y)
        return loss if loss.item() > 0 else -loss

    step = graphstep.capture(fn, model=model, optimizer=opt)
    before = [p.detach().clone() for p in model.parameters()]
    report = graphstep.explain(step, *batches(1)[0])
    assert report.backend == "cuda"
    assert any("loss.item() > 0" in h for h in report.hazards), report.hazards
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    step.close()


MOMENTUM = [0.99 + 0.0002 * i for i in range(30)]  # a teacher's EMA momentum schedule
it = 0  # the training loop's step counter, read by the step


def teacher_step(student, teacher, opt):
    """DINO/BYOL-style: the teacher follows the student by an EMA whose momentum is read as a
    Python float through the global counter `it`."""

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = student(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        m = MOMENTUM[it]
        with torch.no_grad():
            torch._foreach_mul_(list(teacher.parameters()), m)
            torch._foreach_add_(list(teacher.parameters()), list(student.parameters()), alpha=1 - m)
        return loss

    return step


def test_a_momentum_read_through_a_counter_that_churns_runs_eagerly_then_captures_again():
    """Held still for the warm-ups, the capture and some replays; then changing on 12 calls in a row
    (every call would capture a graph never replayed); then still again. Every call is bitwise equal
    to eager; the captures are bounded, and the step captures again and replays once it holds."""
    global it
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    t_e, t_g = (copy.deepcopy(m).requires_grad_(False) for m in (m_e, m_g))
    eager_fn = teacher_step(m_e, t_e, o_e)
    data = batches(30)
    history = []
    with (
        deterministic(),
        graphstep.capture(teacher_step(m_g, t_g, o_g), model=[m_g, t_g], optimizer=o_g) as step,
    ):
        for i, (x, y) in enumerate(data):
            it = 0 if i < 8 else min(i - 7, 12)  # changes on calls 8 to 19
            history.append(step.stats)
            e, g = eager_fn(x, y), step(x, y)
            assert torch.equal(e, g), f"step {i}: eager {e.item()} != graphstep {g.item()}"
        s = step.stats
    assert_same_params(m_e, m_g)
    assert_same_params(t_e, t_g)
    assert s.captures <= 1 + VariantChurn.CALLS + 1 and s.churn_calls >= 12 - VariantChurn.CALLS - 1, s
    assert s.captures > history[20].captures, s  # captured again once the value held still ...
    assert s.replays - history[22].replays == 8 and s.captures == history[22].captures, s  # ... and replays
