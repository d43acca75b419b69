"""The code whose writes a capture does not judge, each with the reason: the one list of exceptions.

Where code lives decides nothing: a package from pip that advances a Python counter in the step is as
frozen by a replay as the user's own `self.seen += 1`, so `writes.WriteWatch` judges library code as it
judges the user's. The exceptions are named here function by function (a class names all its
methods), never a whole package: each is code whose Python writes in a step are bookkeeping set again
to the same effect on every call (a lazy cache, scratch state reset by every call) or redone by
graphstep after each replay. Each entry names the test that runs that code inside a captured step and
compares it with eager: a name on the list is a promise a test keeps.

Found by running each package's stateful APIs inside captured steps with nothing trusted and reading
what the watch refused (torch's optimizers, schedulers, DDP `no_sync`, checkpointing, parametrization
caching, clipping and GradScaler leave nothing a replay misses: they are judged and pass). What a
trusted function does that changes per call is live (a tensor), a key of the graph (accelerate's sync
decision, `integrations/huggingface.py`), a segment or refused.

A function is named by its module (`__name__` of its globals) and qualified name (`co_qualname`, on
Python 3.10 found from the module's own functions and classes); an entry's name also covers what is
nested inside it (`Module._call_impl` covers `Module._call_impl.<locals>.inner`). The decision is
cached per code object.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

from ..guards.user_code import is_user_file
from .qualnames import qualname


@dataclasses.dataclass(frozen=True)
class Trusted:
    """Functions of one module whose writes a capture does not judge."""

    module: str
    names: tuple[str, ...]
    """Qualified names of functions or classes (a class: every method, nested code included)."""
    why: str
    test: str
    """The test that runs this code inside a captured step against eager (pytest id)."""


_T = "tests/test_trusted.py::"

TRUSTED: tuple[Trusted, ...] = (
    # -- torch ---------------------------------------------------------------------------------
    Trusted(
        "torch._library.simple_registry",
        ("SimpleLibraryRegistry.find",),
        "torch's registry of operator entries, filled on the first lookup of each operator: the same "
        "entry on every later call, read by torch's dispatch, never by the step's numbers",
        _T + "test_torch_lazy_operator_caches_fill_once_and_train_like_eager",
    ),
    Trusted(
        "torch._ops",
        ("_OpNamespace.__getattr__", "_Ops.__getattr__", "OpOverloadPacket.__getattr__"),
        "torch.ops caches a namespace, a namespace an operator and an operator an overload, the first "
        "time it is looked up (`torch.ops.c10d`, `torch.ops.aten.foo`, `torch.ops.aten.foo.Scalar`): the "
        "same object on every later call",
        _T + "test_torch_lazy_operator_caches_fill_once_and_train_like_eager",
    ),
    Trusted(
        "torch._dynamo.mutation_guard",
        ("GenerationTracker", "install_generation_tagging_init"),
        "dynamo's generation counter tags modules made while a frame runs; only dynamo's guards read "
        "it, and a compiled model compiles in the warm-ups, never at capture (backends/compiled.py)",
        "tests/test_compiled.py::test_a_compiled_model_compiles_in_the_first_warm_up_only",
    ),
    Trusted(
        "torch.utils.hooks",
        ("RemovableHandle.__init__", "BackwardHook"),
        "the id counter of hook handles (a class attribute): a module with a full backward hook makes "
        "and removes handles on every call, each with a new id; the ids key hook dicts only, never a "
        "value the step computes with",
        _T + "test_torch_module_hooks_train_like_eager",
    ),
    Trusted(
        "torch._compile",
        ("_disable_dynamo",),
        "the wrapper torch puts around its own functions (a module call, `zero_grad`) caches the "
        "disabled function on the function at its first call: the same object ever after; it runs on "
        "every module call, so judging it would cost the capture an opcode trace of each",
        _T + "test_torch_module_hooks_train_like_eager",
    ),
    Trusted(
        "torch._dynamo.eval_frame",
        ("_callback_from_stance", "DisableContext", "_TorchDynamoContext"),
        "picks dynamo's callback for the current stance on every call of a disabled function and "
        "writes nothing that outlives the call: trusted for the capture's cost (every module call)",
        _T + "test_torch_module_hooks_train_like_eager",
    ),
    Trusted(
        "torch.nn.modules.module",
        (
            "Module._call_impl",
            "Module._wrapped_call_impl",
            "Module.__getattr__",
            "Module.__setattr__",
            "Module.__delattr__",
            "Module.named_modules",
            "Module._named_members",
            "Module.named_parameters",
            "Module.parameters",
            "Module.named_buffers",
            "Module.buffers",
        ),
        "the machinery of a module call (hooks run in order, a forward's result returned) and of "
        "attribute access, and the walks over its submodules and parameters (writing only the memo "
        "each makes): per-call locals and hook bookkeeping, the same on every call; a store "
        "a module's own code makes (`self.x = ...`) is judged in that code's frame",
        _T + "test_torch_module_hooks_train_like_eager",
    ),
    Trusted(
        "torch.autograd.function",
        ("Function", "_SingleLevelFunction", "FunctionCtx", "BackwardCFunction"),
        "a custom autograd.Function's `apply` and context: saved tensors and flags on the context "
        "object each call makes",
        _T + "test_torch_module_hooks_train_like_eager",
    ),
    Trusted(
        "torch.amp.autocast_mode",
        ("autocast",),
        "autocast's enter and exit save and put back the autocast state on every call",
        _T + "test_torch_autocast_and_checkpoint_train_like_eager",
    ),
    Trusted(
        "torch.utils.checkpoint",
        (
            "checkpoint",
            "CheckpointFunction",
            "_checkpoint_without_reentrant_generator",
            "_checkpoint_hook",
            "_recomputation_hook",
            "_CheckpointFrame",
            "get_device_states",
            "set_device_states",
        ),
        "activation checkpointing stashes the RNG states and the recomputation's counters in objects "
        "each call makes, and puts the generators back as it found them (the draws themselves are "
        "the generators' offsets, which the graph advances)",
        _T + "test_torch_autocast_and_checkpoint_train_like_eager",
    ),
    Trusted(
        "torch.nn.parallel.distributed",
        ("DistributedDataParallel",),
        "DDP's per-iteration bookkeeping (the reducer's preparation, `no_sync` setting and restoring "
        "`require_backward_grad_sync`); a sync flag changed between calls is a module attribute the "
        "guards watch, and the reductions are collectives in the graph",
        _T + "test_ddp_no_sync_and_require_backward_grad_sync_train_like_eager",
    ),
    *(
        Trusted(
            f"torch.distributed.fsdp._fully_shard.{module}",
            names,
            "FSDP2's per-iteration state (training state, post-forward order, unshard bookkeeping), "
            "reset by every forward and backward; the shards and collectives are tensors in the graph",
            "tests/test_distributed.py::test_parallel_training_matches_eager_on_every_rank",
        )
        for module, names in (
            ("_fsdp_state", ("FSDPState", "_register_group_forward_hooks")),
            ("_fsdp_param_group", ("FSDPParamGroup", "RegisterPostBackwardFunction")),
            ("_fsdp_param", ("FSDPParam",)),
            ("_fully_shard", ("FSDPModule",)),
        )
    ),
    Trusted(
        "torch.autograd.profiler",
        ("record_function", "_maybe_cupti_monitor"),
        "a profiler range (every optimizer step opens one, and graphstep's named ranges) checks once "
        "per process whether a CUPTI monitor runs (`_cupti_monitor_checked`): set at the first range "
        "ever and the same after; the range object is made per call",
        "tests/test_explain.py::test_explain_finds_nothing_wrong_with_a_clean_step",
    ),
    Trusted(
        "torch.amp.grad_scaler",
        ("GradScaler",),
        "GradScaler's per-optimizer stage and found-inf records, made anew by `update()` every step; "
        "the scale and growth tracker are tensors the graph updates (its host-side inf check runs as "
        "an eager segment: backends/library_segments.py)",
        _T + "test_torch_grad_scaler_and_optimizer_hooks_train_like_eager",
    ),
    Trusted(
        "torch.optim.optimizer",
        (
            "Optimizer.profile_hook_step",
            "Optimizer._patch_step_function",
            "Optimizer._cuda_graph_capture_health_check",
            "Optimizer.zero_grad",
            "_use_grad_for_differentiable",
        ),
        "the optimizers' base class: the step's profiling name and hooks, the one-time capture "
        "health check, `_opt_called`, grads zeroed; the per-step values (`step`, moments) are tensors "
        "once graphstep makes the optimizer capturable",
        _T + "test_torch_grad_scaler_and_optimizer_hooks_train_like_eager",
    ),
    # -- accelerate --------------------------------------------------------------------------
    Trusted(
        "accelerate.optimizer",
        ("AcceleratedOptimizer.step", "patch_optimizer_step"),
        "accelerate's record of whether fp16's GradScaler skipped the step (`_is_overflow`, "
        "`_accelerate_step_called`) and its swap of the optimizer's `step` for the call: "
        "capture_accelerated sets the record after every call a graph ran, from whether the scaler "
        "backed off (a plain graphstep.capture cannot prepare an AcceleratedOptimizer)",
        "tests/test_integrations_accelerate.py::test_a_step_the_grad_scaler_skips_is_reported_skipped_after_replays_too",
    ),
    # -- DeepSpeed -------------------------------------------------------------------------------
    Trusted(
        "deepspeed.runtime.engine",
        ("_EngineBackwardGraphTracker",),
        "which autograd graph task an `engine.backward` runs (its loss's hook registers it, on autograd's "
        "thread on a GPU; `engine.backward` unregisters it in its `finally`): empty again after every "
        "call, read only inside a backward",
        "tests/test_integrations_deepspeed.py::test_zero_engine_step_trains_like_the_eager_engine",
    ),
    Trusted(
        "deepspeed.runtime.base_optimizer",
        (
            "BackwardHookStateManager",
            "ZeROOptimizer._remaining_grad_acc_hooks",
            "ZeROOptimizer._backward_active_depth",
            "ZeROOptimizer._backward_seen_this_step",
            "ZeROOptimizer._epilogue_ran_this_backward",
            "ZeROOptimizer._hooks_fired_this_backward",
            "ZeROOptimizer._max_expected_hooks_seen",
        ),
        "ZeRO's count of the gradient hooks fired in one backward and whether its epilogue ran (the "
        "autograd task id of its post-backward callback): reset by every forward "
        "(`reset_for_new_step`) and every backward's start, read only inside that backward",
        "tests/test_integrations_deepspeed.py::test_zero_engine_step_trains_like_the_eager_engine",
    ),
    # -- Lightning -----------------------------------------------------------------------------
    *(
        Trusted(
            f"{package}.loops.progress",
            ("_Progress.increment_ready", "_Progress.increment_started", "_Progress.increment_completed"),
            "Lightning's progress counters of the optimizer step and zero_grad, advanced inside the "
            "step: graphstep's Lightning integration advances them itself after each replay (checked "
            "against plain Lightning's `fit_loop.state_dict()`)",
            "tests/test_integrations_lightning.py::test_callback_trains_like_plain_lightning",
        )
        for package in ("pytorch_lightning", "lightning.pytorch")
    ),
    # -- OmegaConf -----------------------------------------------------------------------------
    *(
        Trusted(
            f"omegaconf.vendor.antlr4.{module}",
            names,
            "the parser OmegaConf runs on every read of an interpolation keeps its positions and "
            "prediction state in long-lived lexer and parser objects, reset at the start of every "
            "parse; the values a step reads from a config are guarded by content",
            "tests/test_guards_configs.py::test_a_config_changed_between_calls_picks_a_graph_for_its_new_values",
        )
        for module, names in (
            ("Lexer", ("Lexer",)),
            ("Parser", ("Parser",)),
            ("BufferedTokenStream", ("BufferedTokenStream",)),
            ("atn.LexerATNSimulator", ("SimState", "LexerATNSimulator")),
            ("atn.ParserATNSimulator", ("ParserATNSimulator",)),
            ("error.ErrorStrategy", ("DefaultErrorStrategy",)),
        )
    ),
    # -- graphstep's own machinery -------------------------------------------------------------
    Trusted(
        "graphstep.backends.recording",
        ("_Recorder",),
        "the recording backend's record of the capture (its ops and parts): the graph itself",
        "tests/test_capture.py::test_every_call_is_one_step_equal_to_eager",
    ),
    Trusted(
        "graphstep.backends.cuda",
        ("CudaGraphBackend.capture",),
        "the CUDA backend's list of graph parts of a capture, one begun after each eager segment: the "
        "graph itself",
        "tests/gpu/test_segments_gpu.py::test_an_optimizer_in_an_eager_segment_is_bitwise_equal_with_a_changing_schedule",
    ),
    Trusted(
        "graphstep.backends.grad_order",
        ("Watch", "Order", "Arguments", "reach", "seeded"),
        "a capture's walk of the autograd graph and the gradients it hands to each segment's backward, "
        "made for the capture and read by its replays' segments only",
        "tests/test_break_data_flow.py::test_a_break_whose_input_is_used_outside_it_trains_bitwise",
    ),
    Trusted(
        "graphstep.backends.loose",
        ("LooseArguments", "Placeholder", "placeholders", "resolve"),
        "the arguments handed to eager segments as they are: placeholders of the capture, replaced by "
        "each call's tensors before its segments run",
        "tests/test_segment_inputs.py::test_targets_used_only_in_a_segment_are_not_keyed_and_go_to_it_every_call",
    ),
    Trusted(
        "graphstep.guards.module_inputs",
        ("ModuleInputs",),
        "a BlockMask on a module swapped for the static one the graph reads during the capture, and put "
        "back after it: loaded before every replay",
        "tests/test_inputs.py::test_a_new_block_mask_every_batch_is_one_graph_bitwise_equal_to_eager",
    ),
    Trusted(
        "graphstep.backends.undo",
        ("UndoLog",),
        "the values a capture's ops overwrite, kept to take a failed capture back",
        "tests/test_effects_writes.py::test_an_attribute_counter_in_forward_is_refused_and_a_buffer_is_equal_to_eager",
    ),
    Trusted(
        "graphstep.backends.segments",
        ("split", "Splitter", "Capture", "Warmup", "run"),
        "the capture's list of eager segments between graph parts: the graph's own structure",
        "tests/test_segments.py::test_a_custom_optimizer_with_a_schedule_runs_as_a_segment",
    ),
    Trusted(
        "graphstep.backends.autograd_segments",
        ("_Plan", "ForwardSegment", "BackwardSegment"),
        "a graph break's forward and backward segments, recorded into the capture's plan",
        "tests/test_graph_breaks.py::test_a_marked_module_runs_forward_and_backward_eagerly_between_graphs",
    ),
    Trusted(
        "graphstep.guards.reads",
        ("ReadWatch",),
        "the read watch's record of the modules written during the capture (what its guard checks)",
        "tests/test_integrations_huggingface.py::test_graphstep_trainer_trains_like_the_trainer",
    ),
    Trusted(
        "graphstep.guards.barriers",
        ("_bump_structure_epoch", "_noted"),
        "the write barriers' epoch (a clock the guards compare, bumped on every structural write) and "
        "their notes of the module attributes written during the capture, which the guard reads",
        "tests/test_integrations_huggingface.py::test_graphstep_trainer_trains_like_the_trainer",
    ),
    Trusted(
        "graphstep.effects.writes",
        ("WriteWatch.__exit__", "redone_on_replays"),
        "the write watch's own list of what it found, filled as it stops watching, and of the places an "
        "integration tells it are set again on every replay",
        "tests/test_effects_writes.py::test_an_attribute_counter_in_forward_is_refused_and_a_buffer_is_equal_to_eager",
    ),
    Trusted(
        "graphstep.distributed.collectives",
        ("Together", "_Watch"),
        "the ranks' agreement collective by collective in one call (the count issued so far, whether "
        "the ranks stopped and why): made for each call, read by graphstep only",
        "tests/test_distributed.py::test_one_more_collective_on_one_rank_while_capturing_is_named_on_every_rank",
    ),
    Trusted(
        "graphstep.distributed.vote",
        ("GlooBoard", "SharedMemoryBoard"),
        "the vote's transport: a sequence number each exchange advances on every rank alike, so that "
        "ranks meet in the same exchange; taking it back on one rank would hang the others",
        "tests/test_distributed.py::test_one_more_collective_on_one_rank_while_capturing_is_named_on_every_rank",
    ),
    Trusted(
        "graphstep.optim.live",
        ("Live",),
        "the device tensors that keep an optimizer's hyperparameters live (lr, betas), made at the "
        "first step of each parameter group and filled from the Python values before every call",
        "tests/test_explain.py::test_explain_finds_nothing_wrong_with_a_clean_step",
    ),
    Trusted(
        "graphstep.effects.host_random",
        ("HostRandomWatch",),
        "the host-random watch's record of the draws it saw while capturing: each is refused, or "
        "drawn again by graphstep after every replay",
        "tests/test_host_random.py::test_numpy_mixup_lambda_is_refused_with_its_line_and_the_pass_it_in_fix",
    ),
    Trusted(
        "graphstep.diagnostics",
        ("HostSyncWatch", "_SyncSpy"),
        "the host-sync watch's record of the syncs it saw and the graph breaks they predict (what "
        "`graphstep.explain` reports and a capture refuses)",
        "tests/test_graph_breaks.py::test_explain_names_the_break_a_capture_will_make_and_the_ones_made",
    ),
    Trusted(
        "graphstep.backends.library_segments",
        ("_as_segment",),
        "the record of which library calls became eager segments and what they cost (the capture's "
        "log line); the segment itself runs on every replay",
        "tests/test_library_segments.py::test_grad_scaler_with_an_unfused_optimizer_runs_its_step_as_a_segment_equal_to_eager",
    ),
    Trusted(
        "graphstep.optim.python_state",
        ("_collect", "_memory", "StepObserver", "grad_references", "changes"),
        "the optimizer watch's walk over an optimizer's Python values and its comparison of them, "
        "writing only what it builds: trusted for the capture's cost (it visits every parameter's state)",
        "tests/test_optim_python_state.py::test_a_python_value_first_changed_at_capture_moves_the_step_to_a_segment",
    ),
    Trusted(
        "graphstep.state",
        ("_collect",),
        "the walk that finds the tensors a step trains, writing only the list it builds: trusted for "
        "the capture's cost",
        "tests/test_capture.py::test_every_call_is_one_step_equal_to_eager",
    ),
    Trusted(
        "graphstep.integrations.lightning",
        ("_GraphStepLogic", "_Logged", "_routed_closure_class"),
        "the Lightning integration's own per-call bookkeeping (whether the step's Python ran this call, "
        "the values `self.log` got, the closure's routing): set before every call, and what a replay "
        "needs of it is redone after the replay",
        "tests/test_integrations_lightning.py::test_callback_trains_like_plain_lightning",
    ),
    Trusted(
        "graphstep.integrations.deepspeed_handover",
        ("Handover", "put"),
        "the DeepSpeed integration's hand-over: DeepSpeed's Python state as the captured backward left "
        "it, put back before `engine.step()`'s segment on every replay (and rolled back at capture, "
        "so that the capture leaves what eager leaves); the places are told to the write watch",
        "tests/test_integrations_deepspeed.py::test_zero_engine_step_trains_like_the_eager_engine",
    ),
    Trusted(
        "graphstep.integrations.huggingface",
        ("_Accumulation.in_step", "_Accumulation.run"),
        "counts `accelerator.accumulate` entries of one call; capture_accelerated resets "
        "the count and advances accelerate's own sync decision before every call, replays included",
        "tests/test_integrations_accelerate.py::test_accumulate_trains_like_the_eager_accelerate_loop",
    ),
)
"""Every function whose writes a capture does not judge, with its reason and its test."""

_STDLIB = (
    "the standard library: its writes in a step are caches and registries (logging's level cache, "
    "warnings' once-registry, a context manager's own generator), not values a step computes with"
)

_BY_MODULE: dict[str, list[tuple[str, Trusted]]] = {}
for _entry in TRUSTED:
    for _name in _entry.names:
        _BY_MODULE.setdefault(_entry.module, []).append((_name, _entry))


def entry(module: str, qualname: str) -> Trusted | None:
    """The entry that trusts function `qualname` of `module`, or None."""
    for name, found in _BY_MODULE.get(module, ()):
        if qualname == name or qualname.startswith(name + "."):
            return found
    return None


def reason(module: str, qualname: str) -> str | None:
    """Why function `qualname` of `module` is trusted, or None when its writes are judged."""
    if module.split(".", 1)[0] in sys.stdlib_module_names:
        return _STDLIB
    found = entry(module, qualname)
    return found.why if found is not None else None


def _generated(filename: str) -> bool:
    """Code made with `exec` (a dataclass's `__init__`, attrs' methods): nobody's line to fix. An
    interactive session's ("<stdin>", "<ipython-input-...>") is the user's."""
    return filename == "<string>" or filename.startswith(("<frozen", "<attrs generated"))


class CodeKinds:
    """Which running code is the user's, and which is judged at all (the user's, and library code
    this list does not trust), cached per code object for one watch."""

    def __init__(self) -> None:
        self._user: dict[types.CodeType, bool] = {}
        self._judged: dict[types.CodeType, bool] = {}

    def is_user(self, code: types.CodeType) -> bool:
        user = self._user.get(code)
        if user is None:
            name = code.co_filename
            user = self._user[code] = not _generated(name) and is_user_file(name)
        return user

    def is_judged(self, frame: types.FrameType) -> bool:
        code = frame.f_code
        judged = self._judged.get(code)
        if judged is None:
            judged = self._judged[code] = not _generated(code.co_filename) and (
                self.is_user(code) or _judged(code, frame.f_globals.get("__name__") or "")
            )
        return judged

    def users_caller(self, frame: types.FrameType) -> types.FrameType | None:
        """The innermost user frame that led to library `frame`."""
        caller = frame.f_back
        while caller is not None and not self.is_user(caller.f_code):
            caller = caller.f_back
        return caller


@functools.lru_cache(maxsize=16384)
def _judged(code: types.CodeType, module: str) -> bool:
    if module.split(".", 1)[0] in sys.stdlib_module_names:
        return False
    if module not in _BY_MODULE:
        return True
    return entry(module, qualname(code, module)) is None
