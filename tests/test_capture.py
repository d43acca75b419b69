"""The state machine of a captured step, on the CPU, with the recording and eager backends."""

from __future__ import annotations

import gc
import inspect
import logging
import weakref

import pytest
import torch

import graphstep
from cpu_common import batches, same_params, sgd_step
from graphstep.errors import ClosedError, GraphStepError, TooManyGraphsError

RECORDING = graphstep.Config(backend="recording")


def run_both(twins, data, config=RECORDING, seed=7):
    (m_e, o_e), (m_g, o_g) = twins
    torch.manual_seed(seed)
    eager = [sgd_step(m_e, o_e)(x, y) for x, y in data]
    step = graphstep.capture(sgd_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    torch.manual_seed(seed)
    graphed = [step(x, y) for x, y in data]
    return eager, graphed, step


@pytest.mark.parametrize("backend", ["recording", "eager"])
def test_every_call_is_one_step_equal_to_eager(twins, backend):
    eager, graphed, step = run_both(twins, batches(10), graphstep.Config(backend=backend))
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert same_params(twins[0][0], twins[1][0])
    s = step.stats
    assert (s.warmup_calls, s.captures) == (3, 1)
    # The capturing call performs its step during capture on these backends: 10 = 3 + 1 + 6.
    assert s.replays == 6 and s.eager_calls == 0 and s.graphs_alive == 1
    assert step.backend_name == backend


@pytest.mark.parametrize("backend", ["recording", "eager"])
def test_a_result_the_caller_drops_is_freed_at_once_from_the_first_call_on(twins, backend):
    """Nothing of a call is left in a reference cycle: a frame kept alive until the next garbage
    collection holds its callers' locals (the result, the capture's buffers)."""
    _, (model, opt) = twins
    step = graphstep.capture(
        sgd_step(model, opt), model=model, optimizer=opt, config=graphstep.Config(backend=backend)
    )
    gc.disable()
    try:
        for i, (x, y) in enumerate(batches(6)):
            result = weakref.ref(step(x, y))
            assert result() is None, (
                f"call {i} ({step.stats}): its result outlives the caller's last reference"
            )
    finally:
        gc.enable()
    assert step.stats.captures == 1


def test_warmup_steps_is_honoured(twins):
    _, _, step = run_both(twins, batches(5), graphstep.Config(backend="recording", warmup_steps=4))
    assert step.stats.warmup_calls == 4 and step.stats.captures == 1 and step.stats.replays == 0


def test_decorator_forms_keep_the_signature():
    def train(x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        """Doc of train."""
        return x * scale

    plain = graphstep.capture(train)
    called = graphstep.capture()(train)
    configured = graphstep.capture(config=graphstep.Config(warmup_steps=2))(train)
    for step in (plain, called, configured):
        assert isinstance(step, graphstep.CapturedStep)
        assert inspect.signature(step) == inspect.signature(train)
        assert step.__doc__ == "Doc of train." and step.__name__ == "train"
    assert configured.config.warmup_steps == 2


def test_a_new_shape_gets_its_own_graph(twins):
    data = batches(5, batch_size=4) + batches(5, batch_size=2, seed=2) + batches(3, batch_size=4, seed=3)
    eager, graphed, step = run_both(twins, data)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert step.stats.graphs_alive == 2 and step.stats.captures == 2


def test_python_values_are_part_of_the_key():
    calls = []

    def fn(x, n):
        calls.append(n)
        return x * n

    # `calls` counts the runs of the step's Python: a write graphstep would refuse, allowed here.
    config = graphstep.Config(backend="recording", warmup_steps=1, allow_python_writes=True)
    step = graphstep.capture(fn, config=config)
    x = torch.ones(3)
    assert torch.equal(step(x, 2), x * 2)  # warm-up
    assert torch.equal(step(x, 2), x * 2)  # capture
    assert torch.equal(step(x, 3), x * 3)  # another key: warm-up, not a replay of n=2
    assert torch.equal(step(x, 2), x * 2)  # replay: no Python runs
    assert calls == [2, 2, 3]
    assert step.stats.replays == 1


def test_inputs_are_copied_into_static_buffers():
    step = graphstep.capture(lambda x: x + 1, config=graphstep.Config(backend="recording", warmup_steps=1))
    for value in range(5):
        x = torch.full((4,), float(value))
        assert torch.equal(step(x), x + 1)


def test_one_tensor_passed_twice_shares_a_buffer_and_a_distinct_pair_gets_its_own_graph():
    """`step(ids, ids)` (transformers' input_ids and labels): in eager both names are one tensor, so
    a write through one shows in the other; a graph must read them from one buffer, and a later call
    with two tensors must not replay that graph (it would copy both into the one buffer)."""

    def fn(a, b):
        a.mul_(2)  # visible through b when they are one tensor
        return a + b

    step = graphstep.capture(fn, config=graphstep.Config(backend="recording", warmup_steps=1))
    for value in range(4):
        x, twin = torch.full((3,), float(value)), torch.full((3,), float(value))
        assert torch.equal(step(x, x), fn(twin, twin)), value
    for value in range(3):
        x, y = torch.full((3,), float(value)), torch.full((3,), 1.0)
        assert torch.equal(step(x, y), fn(x.clone(), y.clone())), value
    assert step.stats.captures == 2, step.stats
    assert "the same tensor as args[0]" in graphstep.signature.Signature.of((x, x), {})[0].describe()


def test_passing_the_static_buffers_copies_nothing():
    step = graphstep.capture(lambda x: x * 2, config=graphstep.Config(backend="recording", warmup_steps=1))
    (buffer,), _ = step.input_buffers(torch.zeros(3))
    buffer.fill_(1.0)
    step(buffer)
    step(buffer)  # captured reading `buffer` itself
    buffer.fill_(5.0)
    assert torch.equal(step(buffer), torch.full((3,), 10.0))
    (again,), _ = step.input_buffers(torch.zeros(3))
    assert again is buffer


def test_pytrees_in_and_out():
    import collections
    import dataclasses

    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        scale: float

    def fn(batch: Batch, extra: dict):
        y = batch.x * batch.scale + extra["bias"][0]
        return {"y": y, "pair": Pair(y.sum(), None), "list": [y.mean()]}

    step = graphstep.capture(fn, config=graphstep.Config(backend="recording", warmup_steps=1))
    for i in range(4):
        x = torch.randn(3)
        out = step(Batch(x, 2.0), {"bias": [torch.tensor(float(i))]})
        assert torch.equal(out["y"], x * 2.0 + i)
        assert torch.equal(out["pair"].a, (x * 2.0 + i).sum()) and out["pair"].b is None
        assert torch.equal(out["list"][0], (x * 2.0 + i).mean())


def test_clone_outputs_are_owned_by_the_caller():
    step = graphstep.capture(lambda x: x * 3, config=graphstep.Config(backend="recording", warmup_steps=1))
    kept = [step(torch.full((2,), float(i))) for i in range(5)]
    assert [t[0].item() for t in kept] == [0.0, 3.0, 6.0, 9.0, 12.0]


def test_graph_outputs_are_overwritten_by_the_next_call():
    config = graphstep.Config(backend="recording", warmup_steps=1, outputs="graph")
    step = graphstep.capture(lambda x: x * 3, config=config)
    step(torch.zeros(2))
    first = step(torch.ones(2))  # capture
    second = step(torch.full((2,), 2.0))  # replay
    assert second is first or second.data_ptr() == first.data_ptr()
    assert first[0].item() == 6.0  # the buffer now holds the latest result


def test_outputs_are_detached():
    w = torch.ones(3, requires_grad=True)
    step = graphstep.capture(
        lambda x: (w * x).sum(), config=graphstep.Config(backend="recording", warmup_steps=1)
    )
    assert all(not step(torch.ones(3)).requires_grad for _ in range(3))


def test_non_tensor_output_is_refused_at_capture_with_its_path(twins):
    (_, _), (model, opt) = twins
    inner = sgd_step(model, opt)

    def fn(x, y):
        loss = inner(x, y)
        return {"loss": loss, "lr": opt.param_groups[0]["lr"]}

    step = graphstep.capture(
        fn, model=model, optimizer=opt, config=graphstep.Config(backend="recording", warmup_steps=1)
    )
    data = batches(2)
    step(*data[0])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(graphstep.errors.UnsupportedOutputError, match=r"at output\['lr'\]"):
        step(*data[1])
    # The refused capture took no step.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_max_graphs_raises_listing_the_signatures_seen():
    step = graphstep.capture(lambda x: x + 1, config=graphstep.Config(backend="recording", max_graphs=2))
    step(torch.zeros(1))
    step(torch.zeros(2))
    with pytest.raises(TooManyGraphsError) as info:
        step(torch.zeros(3))
    message = str(info.value)
    assert "float32[1]" in message and "float32[2]" in message and "new: args[0]: float32[3]" in message
    assert "Pad or bucket" in message


def test_max_graphs_eager_fallback_warns_once_per_signature():
    config = graphstep.Config(backend="recording", max_graphs=1, on_too_many_graphs="eager")
    step = graphstep.capture(lambda x: x + 1, config=config)
    step(torch.zeros(1))
    with pytest.warns(UserWarning, match="max_graphs=1") as warned:
        assert torch.equal(step(torch.zeros(2)), torch.ones(2))
    assert warned[0].filename == __file__  # the warning points at the user's call
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(torch.zeros(2))  # same signature: no second warning
    assert step.stats.eager_calls == 2


def test_unhashable_python_argument_is_refused():
    step = graphstep.capture(lambda x, opts: x, config=RECORDING)
    with pytest.raises(graphstep.errors.UnsupportedInputError, match=r"args\[1\] is a set"):
        step(torch.zeros(1), {1, 2})


def test_reset_warms_up_again_and_close_refuses_calls(twins):
    _, _, step = run_both(twins, batches(5))
    assert step.stats.graphs_alive == 1
    step.reset()
    assert step.stats.graphs_alive == 0
    step(*batches(1)[0])
    assert step.stats.warmup_calls == 4
    with step:
        pass
    with pytest.raises(ClosedError):
        step(*batches(1)[0])


def test_a_step_cannot_call_itself():
    holder = {}

    def fn(x):
        return holder["step"](x) if x.sum() > 0 else x

    holder["step"] = graphstep.capture(fn, config=graphstep.Config(backend="eager"))
    with pytest.raises(GraphStepError, match="inside itself"):
        holder["step"](torch.ones(1))


def test_auto_backend_on_cpu_tensors_is_eager_with_one_notice(twins, caplog):
    (_, _), (model, opt) = twins
    step = graphstep.capture(sgd_step(model, opt), model=model, optimizer=opt)
    with caplog.at_level(logging.INFO, logger="graphstep"):
        for x, y in batches(6):
            step(x, y)
    assert step.backend_name == "eager"
    notices = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(notices) == 1, [r.getMessage() for r in caplog.records]


def test_cuda_backend_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    step = graphstep.capture(lambda x: x, config=graphstep.Config(backend="cuda"))
    with pytest.raises(GraphStepError, match="CUDA is not available"):
        step(torch.zeros(1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"max_graphs": 0}, "max_graphs"),
        ({"outputs": "copy"}, "outputs"),
        ({"backend": "tpu"}, "backend"),
        ({"on_too_many_graphs": "ignore"}, "on_too_many_graphs"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        graphstep.Config(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = graphstep.Config()
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.warmup_steps = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        graphstep.Config(3)  # type: ignore[misc]


def test_bad_model_and_optimizer_arguments():
    with pytest.raises(graphstep.errors.UnsupportedInputError, match="model"):
        graphstep.capture(lambda: None, model="not a module")
    with pytest.raises(graphstep.errors.UnsupportedInputError, match="optimizer"):
        graphstep.capture(lambda: None, optimizer=[torch.nn.Linear(1, 1)])


def test_an_eval_step_shares_the_training_steps_backend(twins):
    (_, _), (model, opt) = twins
    train = graphstep.capture(sgd_step(model, opt), model=model, optimizer=opt, config=RECORDING)

    @torch.no_grad()
    def evaluate(x, y):
        return torch.nn.functional.mse_loss(model(x), y)

    evaluation = graphstep.capture(evaluate, model=model, share_pool_with=train, config=RECORDING)
    x, y = batches(1)[0]
    with pytest.raises(GraphStepError, match="call that step once first"):
        evaluation(x, y)
    train(x, y)
    evaluation(x, y)
    assert evaluation._ctx.backend is train._ctx.backend and train._ctx.backend.users == 2
    evaluation.close()
    assert train._ctx.backend.users == 1
    train.close()


def test_the_walk_over_an_operations_values_finds_and_replaces_every_tensor():
    """What the recording backend and the host-random watch walk for each ATen operation, in place of
    pytree: nested lists and tuples (a fused optimizer returns tuples of lists), keyword dicts, a named
    tuple (rebuilt through pytree), and values with no tensor left as they are."""
    from collections import namedtuple

    from graphstep.state import map_op_tensors, op_tensors

    Pair = namedtuple("Pair", "first second")
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    size = torch.Size([2, 3])
    value = ([a, (b, 1.5)], {"out": c, "dim": size}, Pair(a, "x"))
    assert [id(t) for t in op_tensors(value)] == [id(a), id(b), id(c), id(a)]
    doubled = map_op_tensors(lambda t: t * 2, value)
    assert torch.equal(doubled[0][0], a * 2) and torch.equal(doubled[0][1][0], b * 2)
    assert doubled[0][1][1] == 1.5 and doubled[1]["dim"] is size and torch.equal(doubled[1]["out"], c * 2)
    assert type(doubled[2]) is Pair and torch.equal(doubled[2].first, a * 2) and doubled[2].second == "x"
    assert type(doubled[0]) is list and type(doubled[0][1]) is tuple
