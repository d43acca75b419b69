"""The trusted list (effects/trusted.py): every entry names functions that exist, and the test it
names; torch's stateful APIs run inside a captured step (recording backend, which bakes Python like a
CUDA graph) equal eager bitwise or are refused: module hooks, a custom autograd.Function, autocast,
checkpointing, GradScaler, optimizer hooks, parametrization caching, clipping's flags, `SWALR`, and
the lazy operator caches torch fills on a first lookup.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parametrize

import graphstep
from cpu_common import TinyNet, batches
from graphstep.effects import qualnames, trusted
from graphstep.errors import PythonWriteError

RECORDING = graphstep.Config(backend="recording", warmup_steps=2, graph_breaks="off")
TESTS = Path(__file__).parent


OLDER_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def test_every_entry_names_functions_that_exist_and_a_test_that_exists():
    for e in trusted.TRUSTED:
        path, _, name = e.test.partition("::")
        assert (TESTS.parent / path).exists() and f"def {name}(" in (TESTS.parent / path).read_text(), e.test
        try:
            module = importlib.import_module(e.module)
        except ImportError:  # a framework not installed here (lightning.pytorch beside pytorch_lightning)
            continue
        for qualname in e.names:
            obj = module
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            if obj is None and e.module.startswith("torch") and OLDER_TORCH:
                continue  # a function of a newer torch (`_maybe_cupti_monitor`): CI's torch 2.13 checks it
            assert obj is not None, f"{e.module}.{qualname} does not exist"


def test_the_docs_list_every_entry_with_its_test():
    text = (TESTS.parent / "docs" / "python-effects.md").read_text()
    for e in trusted.TRUSTED:
        assert f"`{e.module}`" in text and e.test.replace("tests/", "") in text, e.module
        assert all(f"`{name}`" in text for name in e.names), e.module


def test_qualified_names_on_python_3_10_come_from_the_modules_own_functions():
    """Python 3.10 has no co_qualname: the names are found from the module's functions and classes."""
    module = "torch.nn.modules.module"
    names = qualnames.qualnames_in(module)
    call = inspect.unwrap(torch.nn.Module._call_impl).__code__  # torch wraps it (dynamo's disable)
    assert names[call] == "Module._call_impl"
    nested = [c for c, n in names.items() if n.startswith("Module._call_impl.<locals>.")]
    if sys.version_info >= (3, 11):
        assert all(c.co_qualname == names[c] for c in (call, *nested))
    zero_grad = inspect.unwrap(torch.optim.Optimizer.zero_grad).__code__
    assert qualnames.qualnames_in("torch.optim.optimizer")[zero_grad] == "Optimizer.zero_grad"


def test_the_decision_is_per_function_not_per_package():
    kinds = trusted.CodeKinds()

    def frame_of(fn: types.FunctionType) -> types.FrameType:
        frame = types.SimpleNamespace(f_code=fn.__code__, f_globals=fn.__globals__)
        return frame  # what is_judged reads of a frame

    assert not kinds.is_judged(frame_of(torch.nn.Module._call_impl))
    assert kinds.is_judged(frame_of(torch.nn.Module.train)), "torch, but not named"
    assert kinds.is_judged(frame_of(torch.optim.lr_scheduler.LRScheduler.step))


def twins(model_cls=TinyNet, make_step=None, config=RECORDING, opt_cls=None):
    torch.manual_seed(0)
    model = model_cls()
    twin = copy.deepcopy(model)
    make_opt = opt_cls or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    opt, twin_opt = make_opt(model.parameters()), make_opt(twin.parameters())
    captured = graphstep.capture(make_step(twin, twin_opt), model=twin, optimizer=twin_opt, config=config)
    return (model, make_step(model, opt)), (twin, captured)


def equal(model_cls, make_step, steps: int = 6, opt_cls=None):
    (model, eager), (twin, captured) = twins(model_cls, make_step, opt_cls=opt_cls)
    for i, (x, y) in enumerate(batches(steps)):
        torch.manual_seed(i)
        want = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(want, captured(x, y)), f"call {i}"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert captured.stats.replays == steps - 3, captured.stats
    return model, twin


def mse_step(model, opt, before=None):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if before is not None:
            before(model)
        opt.step()
        opt.zero_grad()
        return loss

    return step


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class Hooked(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.fc1.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
        self.fc1.register_forward_hook(lambda m, args, out: out + 1)
        self.fc2.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 0.5,))

    def forward(self, x):
        return Scale.apply(super().forward(x), 0.7)


def test_torch_module_hooks_train_like_eager():
    equal(Hooked, mse_step)


def test_torch_lazy_operator_caches_fill_once_and_train_like_eager():
    class Ops(TinyNet):
        def forward(self, x):
            # A namespace torch.ops has not made yet, on every call (its name counts those made): made
            # and cached at capture too, as `torch.ops.c10d` is at a first collective under a capture.
            getattr(torch.ops, f"graphstep_test_namespace_{len(torch.ops._dir)}")
            # An overload not looked up yet, on every call where torch makes them lazily (2.11 does, and
            # a capture on the GPU machine reached one first: `OpOverloadPacket.__getattr__` caching it
            # was refused; 2.13 makes every overload with its operator, and there is none to look up).
            packet = torch.ops.aten.ne
            fresh = next((o for o in packet.overloads() if o not in vars(packet)), None)
            if fresh is not None:
                getattr(packet, fresh)
            return torch.ops.aten.hardtanh(super().forward(x), -0.5, 0.5)

    equal(Ops, mse_step)


class Checkpointed(TinyNet):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.utils.checkpoint.checkpoint(
                lambda t: torch.relu(self.fc1(t)), x, use_reentrant=self.reentrant, preserve_rng_state=True
            )
        return self.fc2(h.float())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_autocast_and_checkpoint_train_like_eager(reentrant):
    # Without dropout in the checkpointed part: the recording backend does not record the CPU
    # generator checkpointing puts back (issue 40, item 6); tests/gpu/test_trusted_gpu.py runs it with dropout.
    equal(lambda: Checkpointed(reentrant), mse_step)


def test_torch_grad_scaler_and_optimizer_hooks_train_like_eager():
    scalers = {}

    def make_step(model, opt):
        scaler = scalers.setdefault(id(model), torch.amp.GradScaler("cpu", init_scale=2.0**4))
        opt.register_step_pre_hook(lambda o, args, kwargs: None)

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        return step

    def adamw(params):
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        graphstep.optim.make_capturable(opt, "cpu")  # what graphstep does to the captured one
        return opt

    equal(TinyNet, make_step, opt_cls=adamw)


class Orthogonal(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        parametrize.register_parametrization(self.fc1, "weight", Symmetric())

    def forward(self, x):
        with parametrize.cached():
            return super().forward(x) + self.fc1.weight.sum() * 0.01


class Symmetric(torch.nn.Module):
    def forward(self, w):  # (16, 8) -> (16, 8): a reparametrization that is not the identity
        return w * 0.5 + w.flip(0) * 0.5


def test_torch_parametrizations_cached_train_like_eager():
    equal(Orthogonal, mse_step)


@pytest.mark.parametrize("options", [{"foreach": True}, {"foreach": False}, {"error_if_nonfinite": True}])
def test_torch_clip_grad_norm_flags_train_like_eager(options):
    clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, **options)  # noqa: E731
    equal(TinyNet, lambda model, opt: mse_step(model, opt, clip))


def test_torch_swalr_stepped_inside_the_step_is_refused():
    """SWALR is an LR scheduler: its epoch counter is a Python number, judged like any scheduler's."""

    def make_step(model, opt):
        swa = torch.optim.swa_utils.SWALR(opt, swa_lr=0.01, anneal_epochs=3)
        inner = mse_step(model, opt)

        def step(x, y):
            loss = inner(x, y)
            swa.step()
            return loss

        return step

    (_, _), (_, captured) = twins(TinyNet, make_step)
    data = batches(3)
    for x, y in data[:2]:
        captured(x, y)
    with pytest.raises(PythonWriteError, match="last_epoch"):
        captured(*data[2])


def test_ddp_no_sync_and_require_backward_grad_sync_train_like_eager(tmp_path):
    """One-rank DDP (gloo): accumulation with `no_sync()` inside the step and with
    `require_backward_grad_sync` set between calls. A comm hook doubles the reduced gradients, so a
    sync decision baked into a graph would show in the parameters."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:

        def doubled(state, bucket):
            future = torch.futures.Future()
            future.set_result(bucket.buffer() * 2)
            return future

        def make(seed=0):
            torch.manual_seed(seed)
            ddp = torch.nn.parallel.DistributedDataParallel(TinyNet())
            ddp.register_comm_hook(None, doubled)
            return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)

        def make_step(ddp, opt):
            def step(x, y, accumulate: bool):
                if accumulate:
                    with ddp.no_sync():
                        torch.nn.functional.mse_loss(ddp(x), y).backward()
                    return torch.zeros(())
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                return loss

            return step

        (model, opt), (twin, twin_opt) = make(), make()
        eager = make_step(model, opt)
        captured = graphstep.capture(
            make_step(twin, twin_opt), model=twin, optimizer=twin_opt, config=RECORDING
        )
        for i, (x, y) in enumerate(batches(40)):
            accumulate = i % 2 == 0
            for ddp in (model, twin):  # the manual way too, from outside the step: no reduction
                ddp.require_backward_grad_sync = i % 4 != 1
            torch.manual_seed(i)
            want = eager(x, y, accumulate)
            torch.manual_seed(i)
            assert torch.equal(want, captured(x, y, accumulate)), f"call {i}"
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
        assert captured.stats.replays > 0, captured.stats
        captured.close()
    finally:
        dist.destroy_process_group()
