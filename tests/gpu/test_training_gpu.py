"""A real training loop on a GPU (issue 4): optimizers, schedulers, zero_grad, AMP, accumulation,
clipping, activation checkpointing, RNG, checkpoint/resume and an evaluation step.

Every test trains the same model twice from the same initialisation and seed, eagerly and with
graphstep, for 30 steps or more in deterministic mode, and asserts bitwise equality (`torch.equal`)
of every loss, parameter and buffer. Two models: the demo GPT with dropout, and a small CNN with
BatchNorm (running statistics and `num_batches_tracked` are compared too).

Both runs apply `graphstep.optim.make_capturable` to their optimizer and call the adapter's
`before_call()` before each step: bitwise equality needs the same optimizer settings (capturable,
lr as a float32 device tensor) on both sides. graphstep does the same for its own optimizer once
the adapter is wired into `capture()`; doing it twice is harmless.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from gpu_common import assert_same_losses, assert_same_params, deterministic, needs_cuda
from torch import nn
from torch.optim import lr_scheduler as sched
from torch.utils.checkpoint import checkpoint

import graphstep
from graphstep.demo.gpt import GPT, GPTConfig, make_batches
from graphstep.optim import make_capturable

pytestmark = needs_cuda

DEVICE = "cuda"
N_STEPS = 30
SEED = 1234
GPT_CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)


class SmallCNN(nn.Module):
    """Two conv blocks with BatchNorm, dropout, global pooling and a linear classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block2 = nn.Sequential(
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(), nn.Dropout2d(0.1)
        )
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor, ckpt: str | None = None) -> torch.Tensor:
        # x: (B, 3, 16, 16) float, y: (B,) int64
        h = self.block1(x)
        h = self.block2(h) if ckpt is None else checkpoint(self.block2, h, use_reentrant=ckpt == "reentrant")
        return F.cross_entropy(self.head(self.drop(h.mean((2, 3)))).float(), y)


def gpt_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor, ckpt: str | None = None) -> torch.Tensor:
    """GPT.forward, with each block optionally under torch.utils.checkpoint (dropout inside)."""
    x = model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))
    for block in model.blocks:
        x = block(x) if ckpt is None else checkpoint(block, x, use_reentrant=ckpt == "reentrant")
    logits = model.head(model.ln_f(x))  # (B, T, vocab)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ckpt: str | None = None) -> torch.Tensor:
    return gpt_loss(model, x, y, ckpt) if isinstance(model, GPT) else model(x, y, ckpt)


def make_gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPT_CFG).to(DEVICE)


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN().to(DEVICE)


def gpt_data(n: int = 8) -> list:
    return make_batches(GPT_CFG, batch_size=4, n_batches=n, seed=0, device=DEVICE)


def cnn_data(n: int = 8) -> list:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 3, 16, 16, generator=g).to(DEVICE), torch.randint(10, (8,), generator=g).to(DEVICE))
        for _ in range(n)
    ]


def default_optimizer(model: nn.Module, **options) -> torch.optim.Optimizer:
    """AdamW (foreach, made capturable) for the GPT; SGD with momentum, fused (a tensor lr) for the CNN.

    Non-fused SGD would read its lr as a float: correct under graphstep, but every lr change re-captures.
    """
    if isinstance(model, GPT):
        return torch.optim.AdamW(model.parameters(), **{"lr": 1e-3, "weight_decay": 0.1, **options})
    return torch.optim.SGD(
        model.parameters(), **{"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "fused": True, **options}
    )


MODELS = {"gpt": (make_gpt, gpt_data), "cnn": (make_cnn, cnn_data)}


@dataclasses.dataclass
class Training:
    """One way to train a model: the step, its optimizer, and what happens between calls."""

    step: Callable[..., torch.Tensor]
    optimizer: torch.optim.Optimizer
    between: Callable[[int, torch.Tensor], None] = lambda i, loss: None
    extra: Callable[[], dict[str, object]] = dict  # more state to compare at the end


@dataclasses.dataclass
class Run:
    model: nn.Module
    training: Training
    losses: list[torch.Tensor]
    step: Callable


def plain_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    clip: str = "norm",
    zero: str = "optimizer",
    autocast: torch.dtype | None = None,
    ckpt: str | None = None,
) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=autocast) if autocast else contextlib.nullcontext():
            loss = loss_of(model, x, y, ckpt)
        loss.backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        opt.step()
        (model if zero == "model" else opt).zero_grad()
        return loss

    return step


def compare(
    make_model: Callable[[], nn.Module],
    make_training: Callable[[nn.Module], Training],
    data: list,
    n_steps: int = N_STEPS,
    *,
    config: graphstep.Config | None = None,
    captures: int | None = 1,
) -> tuple[Run, Run]:
    """Train eagerly and with graphstep from the same start; assert every loss, parameter, buffer
    and `extra()` value is bitwise equal. `captures`: how many captures graphstep should make."""
    runs = []
    for graphed in (False, True):
        model = make_model()
        training = make_training(model)
        adapter = make_capturable(training.optimizer, DEVICE)
        step = (
            graphstep.capture(training.step, model=model, optimizer=training.optimizer, config=config)
            if graphed
            else training.step
        )
        torch.manual_seed(SEED)
        losses = []
        with deterministic():
            for i in range(n_steps):
                adapter.before_call()
                losses.append(step(*data[i % len(data)]))
                training.between(i, losses[-1])
        torch.cuda.synchronize()
        runs.append(Run(model, training, losses, step))
    eager, graphed = runs
    assert graphed.step.backend_name == "cuda"
    assert_same_losses(eager.losses, graphed.losses)
    assert_same_state(eager, graphed)
    stats = graphed.step.stats
    if captures is not None:
        assert stats.captures == captures, stats
    assert stats.replays >= n_steps - 3 * stats.captures - 1, stats  # most calls were replays
    graphed.step.close()
    return eager, graphed


def assert_same_model(eager: nn.Module, graphed: nn.Module) -> None:
    """Parameters and buffers (BatchNorm running statistics, num_batches_tracked), bitwise."""
    assert_same_params(eager, graphed)
    for (name, a), b in zip(eager.named_buffers(), graphed.buffers()):
        assert torch.equal(a, b), (
            f"buffer {name} differs: {a.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()}"
        )


def assert_same_state(eager: Run, graphed: Run) -> None:
    assert_same_model(eager.model, graphed.model)
    a_extra, b_extra = eager.training.extra(), graphed.training.extra()
    for key in a_extra:
        a, b = a_extra[key], b_extra[key]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert same, f"{key}: eager {a!r} != graphstep {b!r}"


# -- optimizers and learning rates -------------------------------------------------------------

SCHEDULERS = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=7, gamma=0.5),
    "CosineAnnealingLR": lambda opt: sched.CosineAnnealingLR(opt, T_max=N_STEPS),
    "OneCycleLR": lambda opt: sched.OneCycleLR(
        opt, max_lr=10 * float(opt.param_groups[0]["lr"]), total_steps=N_STEPS + 1, cycle_momentum=False
    ),
    "LambdaLR": lambda opt: sched.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s)),
    "SequentialLR": lambda opt: sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, start_factor=0.1, total_iters=5), sched.ExponentialLR(opt, gamma=0.95)],
        milestones=[5],
    ),
    "ReduceLROnPlateau": lambda opt: sched.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}


def with_scheduler(make_scheduler: Callable, **optimizer_options) -> Callable[[nn.Module], Training]:
    def make(model: nn.Module) -> Training:
        opt = default_optimizer(model, **optimizer_options)
        scheduler = make_scheduler(opt)  # before make_capturable: the usual order in user code
        lrs: list[float] = []

        def between(i: int, loss: torch.Tensor) -> None:
            if isinstance(scheduler, sched.ReduceLROnPlateau):
                scheduler.step(loss.detach())  # reads the loss on the host, between calls: fine
            else:
                scheduler.step()
            lrs.append(float(opt.param_groups[0]["lr"]))

        return Training(plain_step(model, opt), opt, between, lambda: {"lrs": lrs})

    return make


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_schedulers_update_the_lr_with_no_recapture(model, name):
    make_model, data = MODELS[model]
    eager, _ = compare(make_model, with_scheduler(SCHEDULERS[name]), data())
    lrs = eager.training.extra()["lrs"]
    assert len(set(lrs)) > 1, f"{name} never changed the lr: {lrs}"


@pytest.mark.parametrize("model", list(MODELS))
def test_one_cycle_with_momentum_cycling_recaptures_and_equals_eager(model, recwarn):
    """cycle_momentum=True changes betas/momentum, Python floats baked into the graph, every step:
    the guards capture again each time. Correct, but slow: prefer cycle_momentum=False. The optimizer
    step ends up in an eager segment, after which the step launches nothing: that empty part is neither
    replayed nor warned of (torch's warning says "captured on wrong device or stream")."""
    make_model, data = MODELS[model]

    def one_cycle(opt):
        return sched.OneCycleLR(opt, max_lr=10 * float(opt.param_groups[0]["lr"]), total_steps=N_STEPS + 1)

    compare(
        make_model,
        with_scheduler(one_cycle),
        data(),
        config=graphstep.Config(max_recaptures=2 * N_STEPS),
        captures=None,
    )
    assert not [w for w in recwarn if "CUDA Graph is empty" in str(w.message)]


@pytest.mark.parametrize("model", list(MODELS))
def test_lr_assigned_by_hand_between_calls(model):
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)
        base = float(opt.param_groups[0]["lr"])

        def between(i: int, loss: torch.Tensor) -> None:
            for group in opt.param_groups:
                group["lr"] = (
                    base * 0.9**i
                )  # a float replaces graphstep's tensor; absorbed before the next call

        return Training(plain_step(m, opt), opt, between)

    compare(make_model, make, data())


@pytest.mark.parametrize("model", list(MODELS))
def test_adam_that_stepped_eagerly_before_capture(model):
    """Adam without capturable=True keeps its step count on the host; make_capturable moves it to the GPU."""
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        with deterministic():  # both runs' eager pre-steps must agree (cuDNN backward)
            for x, y in data(2):
                plain_step(m, opt)(x, y)
        assert all(s["step"].device.type == "cpu" for s in opt.state.values())
        return Training(plain_step(m, opt), opt)

    _, graphed = compare(make_model, make, data())
    opt = graphed.training.optimizer
    assert all(opt.state[p]["step"].device == p.device for p in graphed.model.parameters())


@pytest.mark.parametrize("via", ["optimizer", "model"])
@pytest.mark.parametrize("model", list(MODELS))
def test_zero_grad_set_to_none_inside_the_step(model, via):
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)

        def between(i: int, loss: torch.Tensor) -> None:
            assert all(p.grad is None for p in m.parameters()), f"call {i} left grads attached"

        return Training(plain_step(m, opt, zero=via), opt, between)

    compare(make_model, make, data())


# -- mixed precision -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_bf16_autocast(model):
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)
        return Training(plain_step(m, opt, autocast=torch.bfloat16), opt)

    compare(make_model, make, data())


INF_STEPS = (10, 20)  # these calls' gradients overflow fp16: GradScaler must skip them and back off


def scaled_data(data: list) -> list:
    boost = [torch.tensor(1e30 if i in INF_STEPS else 1.0, device=DEVICE) for i in range(N_STEPS)]
    return [(*data[i % len(data)], boost[i]) for i in range(N_STEPS)]


def scaled_training(fused: bool) -> Callable[[nn.Module], Training]:
    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m, fused=fused, **({} if fused else {"foreach": True}))
        scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**16, growth_interval=4)
        scales: list[float] = []

        def step(x: torch.Tensor, y: torch.Tensor, boost: torch.Tensor) -> torch.Tensor:
            with torch.autocast(DEVICE, dtype=torch.float16):
                loss = loss_of(m, x, y)
            scaler.scale(loss * boost).backward()  # boost: () float32, 1 or 1e30
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        def between(i: int, loss: torch.Tensor) -> None:
            scales.append(scaler.get_scale())

        return Training(step, opt, between, lambda: {"scales": scales, "growth": scaler._growth_tracker})

    return make


@pytest.mark.parametrize("model", list(MODELS))
def test_fp16_grad_scaler_with_a_fused_optimizer_skips_inf_steps_as_eager(model):
    make_model, data = MODELS[model]
    eager, graphed = compare(make_model, scaled_training(fused=True), scaled_data(data()))
    scales = eager.training.extra()["scales"]
    for i in INF_STEPS:
        assert scales[i] == scales[i - 1] / 2, f"no back-off at the overflowing step {i}: {scales}"
    assert max(scales) > 2.0**16, f"the scale never grew: {scales}"
    assert graphed.step.stats.replays >= N_STEPS - 4


@pytest.mark.parametrize("model", list(MODELS))
def test_fp16_grad_scaler_with_an_unfused_optimizer_runs_its_step_as_a_segment(model):
    """GradScaler.step reads found_inf with .item() unless the optimizer is fused: graphstep runs
    that check and the optimizer's step as an eager segment (issue 22), bitwise equal to eager."""
    make_model, data = MODELS[model]
    eager, _ = compare(make_model, scaled_training(fused=False), scaled_data(data()))
    scales = eager.training.extra()["scales"]
    for i in INF_STEPS:
        assert scales[i] == scales[i - 1] / 2, f"no back-off at the overflowing step {i}: {scales}"


# -- the step's own structure ---------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_gradient_accumulation_over_stacked_micro_batches(model):
    make_model, data = MODELS[model]
    micro = 4
    batches = data(4 * micro)
    stacked = [
        (
            torch.stack([x for x, _ in batches[i : i + micro]]),
            torch.stack([y for _, y in batches[i : i + micro]]),
        )
        for i in range(0, len(batches), micro)
    ]  # each: x (micro, B, ...), y (micro, B, ...)

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)

        def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            total = torch.zeros((), device=DEVICE)
            for k in range(xs.shape[0]):  # a Python loop: unrolled into the graph
                loss = loss_of(m, xs[k], ys[k]) / xs.shape[0]
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return total

        return Training(step, opt)

    compare(make_model, make, stacked)


@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("model", list(MODELS))
def test_gradient_clipping(model, clip):
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)
        return Training(plain_step(m, opt, clip=clip), opt)

    compare(make_model, make, data())


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("model", list(MODELS))
def test_activation_checkpointing_with_dropout_inside(model, ckpt):
    # Suspect: checkpoint stashes the CUDA RNG state (torch.cuda.get_rng_state) to replay the
    # dropout masks in the recomputation. torch releases whose CUDA generator refuses that during
    # capture ("Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture") fail here
    # with a CaptureError; graphstep would then need a graph-safe stash (graphsafe_get_state /
    # graphsafe_set_state) patched into torch.utils.checkpoint during capture.
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)
        return Training(plain_step(m, opt, ckpt=ckpt), opt)

    compare(make_model, make, data())


# -- random numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_manual_seed_between_calls_is_respected(model):
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)

        def between(i: int, loss: torch.Tensor) -> None:
            torch.manual_seed(100 + i % 3)  # replays read the generator's seed and offset afresh

        return Training(plain_step(m, opt), opt, between)

    compare(make_model, make, data())


def test_user_cuda_generator_inside_the_step():
    """A generator in the step's closure is found and registered with the graph."""
    gen_seed = 7

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)
        gen = torch.Generator(device=DEVICE).manual_seed(gen_seed)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            perm = torch.randperm(x.shape[0], generator=gen, device=DEVICE)  # shuffle the rows
            mask = torch.rand(x.shape, generator=gen, device=DEVICE) < 0.05  # token dropout
            x = torch.where(mask, torch.zeros_like(x), x[perm])
            loss = loss_of(m, x, y[perm])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return Training(step, opt, extra=lambda: {"generator": gen.get_state()})

    compare(make_gpt, make, gpt_data())


# -- checkpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_resume_from_a_checkpoint_equals_an_uninterrupted_eager_run(model):
    make_model, data_of = MODELS[model]
    data = data_of()
    stop = N_STEPS // 2

    def training(m: nn.Module) -> tuple[Training, sched.LRScheduler]:
        opt = default_optimizer(m)
        scheduler = sched.StepLR(opt, step_size=5, gamma=0.7)
        return Training(plain_step(m, opt), opt), scheduler

    def train(step, adapter, scheduler, steps) -> list[torch.Tensor]:
        losses = []
        with deterministic():
            for i in steps:
                adapter.before_call()
                losses.append(step(*data[i % len(data)]))
                scheduler.step()
        return losses

    # Uninterrupted, eagerly.
    eager_model = make_model()
    eager, eager_sched = training(eager_model)
    torch.manual_seed(SEED)
    eager_losses = train(eager.step, make_capturable(eager.optimizer, DEVICE), eager_sched, range(N_STEPS))

    # graphstep until `stop`, save, then a new process's worth of objects loads and goes on.
    model = make_model()
    first, first_sched = training(model)
    adapter = make_capturable(first.optimizer, DEVICE)
    torch.manual_seed(SEED)
    with graphstep.capture(first.step, model=model, optimizer=first.optimizer) as step:
        losses = train(step, adapter, first_sched, range(stop))
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": first.optimizer.state_dict(),
            "scheduler": first_sched.state_dict(),
            "rng": torch.cuda.get_rng_state(),
        },
        buffer,
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    resumed_model = make_model()
    resumed, resumed_sched = training(resumed_model)
    resumed_model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed_sched.load_state_dict(saved["scheduler"])
    torch.cuda.set_rng_state(saved["rng"])
    adapter = make_capturable(resumed.optimizer, DEVICE)
    with graphstep.capture(resumed.step, model=resumed_model, optimizer=resumed.optimizer) as step:
        losses += train(step, adapter, resumed_sched, range(stop, N_STEPS))
        assert step.stats.captures == 1
    torch.cuda.synchronize()

    assert_same_losses(eager_losses, losses)
    assert_same_model(eager_model, resumed_model)
    for p, q in zip(eager_model.parameters(), resumed_model.parameters()):
        for key, value in eager.optimizer.state[p].items():
            assert torch.equal(value, resumed.optimizer.state[q][key]), f"optimizer state {key} differs"


@pytest.mark.parametrize("model", list(MODELS))
def test_load_state_dict_between_calls_rewinds_like_eager(model):
    """model.load_state_dict copies in place; optimizer.load_state_dict is copied into the tensors
    the graph uses by graphstep's hooks: no re-capture, and the run equals eager's."""
    make_model, data = MODELS[model]

    def make(m: nn.Module) -> Training:
        opt = default_optimizer(m)
        saved = {}

        def between(i: int, loss: torch.Tensor) -> None:
            if i == 11:
                saved["all"] = copy.deepcopy((m.state_dict(), opt.state_dict(), torch.cuda.get_rng_state()))
            if i == 19:  # back to the state after step 11, and on from there
                model_state, opt_state, rng = saved["all"]
                m.load_state_dict(model_state)
                opt.load_state_dict(opt_state)
                torch.cuda.set_rng_state(rng)

        return Training(plain_step(m, opt), opt, between)

    compare(make_model, make, data(), n_steps=N_STEPS + 8)


# -- evaluation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_no_grad_eval_step_beside_the_training_step(model):
    make_model, data_of = MODELS[model]
    data = data_of()
    runs = []
    for graphed in (False, True):
        m = make_model()
        opt = default_optimizer(m)
        adapter = make_capturable(opt, DEVICE)

        @torch.no_grad()
        def evaluate(x: torch.Tensor, y: torch.Tensor, m=m) -> torch.Tensor:
            return loss_of(m, x, y)

        train_step, eval_step = plain_step(m, opt), evaluate
        if graphed:
            train_step = graphstep.capture(train_step, model=m, optimizer=opt)
            eval_step = graphstep.capture(evaluate, model=m, share_pool_with=train_step)
        torch.manual_seed(SEED)
        losses, evals = [], []
        with deterministic():
            for i in range(N_STEPS):
                adapter.before_call()
                losses.append(train_step(*data[i % len(data)]))
                if i % 2 == 1:
                    m.eval()
                    evals.append(eval_step(*data[(i + 3) % len(data)]))
                    m.train()
        torch.cuda.synchronize()
        runs.append((m, losses, evals, train_step, eval_step))
    (m_e, losses_e, evals_e, _, _), (m_g, losses_g, evals_g, train_g, eval_g) = runs
    assert_same_losses(losses_e, losses_g)
    assert_same_losses(evals_e, evals_g)
    assert_same_model(m_e, m_g)
    assert eval_g.stats.replays >= N_STEPS // 2 - 4 and train_g.stats.captures == 1
    pools = {
        g.pool()
        for step in (train_g, eval_g)
        for life in step._lives.values()
        for v in life.variants
        for g in v.recording.cuda_graphs
    }
    assert eval_g._ctx.backend is train_g._ctx.backend and len(pools) == 1, pools
    train_g.close()
    eval_g.close()
