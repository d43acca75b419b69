"""Transformer Engine training steps under graphstep (issue 39, item 3): a bitwise probe and a bench.

Tiny models, one per TE module kind (`te.Linear`, `te.LayerNormMLP`, `te.TransformerLayer`; fp32 parameters
under bf16 autocast, as TE users train), each trained by one step function: the forward under
`te.autocast` (FP8 with `DelayedScaling`: amax history and scales change on every step; or FP8 off), an MSE
loss, backward, AdamW, zero_grad. Variants: TE's activation recompute (`te.distributed.checkpoint` around
each layer, after an input projection that is not checkpointed; without and with a graph-safe RNG
tracker), te.Linear with TE's weight cache (`is_first_microbatch`), and FP8 te.Linear with another model of
the same recipe that first runs after the capture (trained: `_secondmodel`; forward without grad:
`_evalmodel`: the step is captured again once it joined TE's amax buffers).

`--quick` (the probe): per case, an eager run, then a fresh identical model captured with
`graphstep.capture(step, model=..., optimizer=...)`, deterministic mode, the same batches; after every
call `torch.equal` on the loss, every parameter and every FP8 meta tensor TE keeps (per module: `fp8_meta`'s
`scaling_fwd` / `scaling_bwd` recipe states, their `scale` and `amax_history`, the quantizers' views of
them, and the cached FP8 weights' data and `scale_inv` in `_fp8_workspaces`). PASS / FAIL (what differs,
first call) / REFUSED (graphstep's message) / ERROR (traceback), with `step.stats`.
Writes `<out>/<gpu>_<date>_te-probe.{json,md}`; about two minutes on an H100.

`--bench`: ms per step (CUDA events over TIMED steps after WARMUP) and peak memory for eager, TE's
`te.make_graphed_callables` (the model graphed with its FP8 arguments, loss and AdamW eager) and graphstep,
on BENCH_CASES (a TE transformer, hidden 1024, 4 layers: bf16, FP8, FP8 with recompute and the RNG
tracker). Writes `<out>/<gpu>_<date>_te-bench.{json,md}`; well under 90 s on an H100.

TE's FP8 state is process-global (`FP8GlobalStateManager.quantization_state`: the amax reduction at
`te.autocast`'s exit updates every module registered under the same recipe key), so each run starts from
`FP8GlobalStateManager.reset()`: two models trained in one process would otherwise share amax buffers.

    PYTHONPATH=/tmp/te/site-packages:$PWD/src python3 benchmarks/te_probe.py --quick --out $OUT
    PYTHONPATH=/tmp/te/site-packages:$PWD/src python3 benchmarks/te_probe.py --bench --out $OUT
"""

from __future__ import annotations

import os

# Before torch and TE load: deterministic cuBLAS and TE attention (the bitwise cases need both).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import argparse
import dataclasses
import datetime
import json
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import graphstep
import graphstep.optim
from graphstep.demo.train import deterministic

te = transformer_engine = DelayedScaling = Format = (
    None  # loaded by load_te(): the test imports this file without TE
)


def load_te() -> str:
    """Imports Transformer Engine into this module's globals; returns the traceback where it fails."""
    global te, transformer_engine, DelayedScaling, Format
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except Exception:  # the probe reports what failed rather than dying on import
        te = None
        return traceback.format_exc()
    return ""


CALLS, WARMUP, TIMED = 10, 10, 40
JOINS = 5  # the other model's first call (after graphstep's capture, call 3 counted from 0)
DEVICE = "cuda"  # TE needs CUDA; the probe's own logic was tried on the CPU with stand-ins for TE
SEQ, BATCH = 128, 4
BENCH_BUDGET_S = 75  # the bench's rows after this many seconds are skipped (its callers allow ~100 s)


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "linear", "layernorm_mlp", "transformer"
    fp8: bool
    recompute: str = (
        ""  # "": none; "plain": te.distributed.checkpoint; "tracker": with a graph-safe RNG tracker
    )
    first_microbatch: bool = False  # te.Linear's FP8 weight cache (is_first_microbatch=True on each call)
    # A second model with the same recipe, trained eagerly from call JOINS on: eagerly, the captured
    # step's reductions cover its tensors too, the graph's do not; no difference is expected all the same
    # (run 1: PASS), since its own reductions consume its amaxes and TE's update skips a zero amax.
    second_model: bool = False
    # A model with the same recipe whose forward runs under te.autocast with autograd off (an evaluation,
    # a frozen teacher) from call JOINS on, after each training call. Such a forward writes its amaxes but
    # does not reduce them (te.autocast reduces at its exit only with grad enabled): the next training
    # step's reduction does, eagerly; a graph captured before the model's first forward does not (TE's
    # kernel skips a registered tensor whose current amax is 0, which is why `second_model` cannot show it).
    eval_model: bool = False
    hidden: int = 256
    layers: int = 2

    @property
    def name(self) -> str:
        extra = {"": "", "plain": "_recompute", "tracker": "_recompute_rngtracker"}[self.recompute]
        extra += "_weightcache" if self.first_microbatch else ""
        extra += "_secondmodel" if self.second_model else ""
        extra += "_evalmodel" if self.eval_model else ""
        return f"{self.kind}_{'fp8' if self.fp8 else 'bf16'}{extra}"


def cases(fp8_ok: bool) -> list[Case]:
    out = []
    for fp8 in [False, True] if fp8_ok else [False]:
        for kind in ("linear", "layernorm_mlp", "transformer"):
            out.append(Case(kind, fp8))
            out.append(Case(kind, fp8, recompute="plain"))
            out.append(Case(kind, fp8, recompute="tracker"))
        out.append(Case("linear", fp8, first_microbatch=True))
    if fp8_ok:
        out.append(Case("linear", True, second_model=True))
        out.append(Case("linear", True, eval_model=True))
    return out


# The bench's cases: a TE transformer (hidden 1024, 4 layers) with FP8 off and on, and with FP8 under
# recompute with the graph-safe RNG tracker (the recompute that captures).
BENCH_CASES = [
    Case("transformer", fp8, recompute=recompute, hidden=1024, layers=4)
    for fp8, recompute in ((True, ""), (False, ""), (True, "tracker"))
]


# -- the model and the step ------------------------------------------------------------------------


class Stack(torch.nn.Module):
    """`layers` TE modules of one kind, each optionally under TE's activation recompute."""

    def __init__(self, case: Case):
        super().__init__()
        h = case.hidden
        if case.kind == "linear":
            blocks = [te.Linear(h, h, bias=True) for _ in range(case.layers)]
        elif case.kind == "layernorm_mlp":
            blocks = [te.LayerNormMLP(h, 4 * h) for _ in range(case.layers)]
        elif case.kind == "transformer":
            blocks = [
                te.TransformerLayer(
                    h, 4 * h, max(1, h // 64), hidden_dropout=0.0, attention_dropout=0.0, layer_number=i + 1
                )
                for i in range(case.layers)
            ]
        else:
            raise ValueError(f"unknown TE module kind {case.kind!r}")
        self.blocks = torch.nn.ModuleList(blocks)
        # Under recompute, an input projection first, not checkpointed (an embedding, in a real model):
        # te.distributed.checkpoint is reentrant by default, an autograd Function whose output needs grad
        # only when an input tensor does (the layer's parameters are not its inputs). Checkpointing the
        # first layer on the raw data would leave the loss with no grad_fn, as it would eagerly.
        self.proj = torch.nn.Linear(h, h) if case.recompute else None
        self.recompute, self.first_microbatch = case.recompute, case.first_microbatch
        self.tracker = None
        if case.recompute == "tracker":
            # TE's recipe for recompute under CUDA graphs: an RNG tracker whose states are graph-safe
            # generators (torch >= 2.4); checkpoint then saves and restores the CUDA RNG state with
            # graphsafe_get_state / graphsafe_set_state instead of get_state (not allowed while capturing).
            self.tracker = te.distributed.CudaRNGStatesTracker()
            self.tracker.add("model-parallel-rng", 1234)

    def _tracker(self):
        return self.tracker

    def generators(self) -> list[torch.Generator]:
        """The tracker's CUDA generators: graphstep registers them with its graphs."""
        if self.tracker is None:
            return []
        return [g for g in self.tracker.get_states().values() if isinstance(g, torch.Generator)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"is_first_microbatch": True} if self.first_microbatch else {}
        if self.proj is not None:
            x = self.proj(x)
        for block in self.blocks:
            if self.recompute == "tracker":
                x = te.distributed.checkpoint(block, x, get_rng_state_tracker=self._tracker, **kwargs)
            elif self.recompute:
                x = te.distributed.checkpoint(block, x, **kwargs)
            else:
                x = block(x, **kwargs)
        return x


def recipe() -> DelayedScaling:
    # Format.HYBRID: E4M3 forward, E5M2 gradients; a short history so that it rolls within the probe.
    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, amax_compute_algo="max")


def fresh_fp8_state() -> None:
    """A clean process-global FP8 state (no other model's modules in its amax buffers)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE before 2.10 kept it in fp8.py
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    FP8GlobalStateManager.reset()


def build(case: Case, seed: int = 0) -> tuple[Stack, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Stack(case).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphstep.optim.make_capturable(opt, DEVICE)  # what graphstep does to the captured one: eager does it too
    return model, opt


def make_step(model: torch.nn.Module, forward: Callable, opt: torch.optim.Optimizer, case: Case) -> Callable:
    """The training step; `forward` is the model or TE's graphed version of it."""
    fp8_recipe = recipe()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            with te.autocast(enabled=case.fp8, recipe=fp8_recipe):
                out = forward(x)
            loss = (out.float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def batches(case: Case, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (SEQ, BATCH, case.hidden)  # TE's default layout: sequence first
    return [
        (torch.randn(shape, device=DEVICE, generator=g), torch.randn(shape, device=DEVICE, generator=g))
        for _ in range(n)
    ]


# -- TE's FP8 state, for the comparison --------------------------------------------------------------


def fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 meta tensor TE 2.20 keeps per module, cloned: `fp8_meta["scaling_fwd"|"scaling_bwd"]`
    (DelayedScalingRecipeState: `scale`, `amax_history`; TE makes `scale_inv` per quantized tensor), the
    quantizers' `scale` / `amax` (views of those), and cached FP8 weights (`_fp8_workspaces`)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            for attr in ("scale", "amax_history", "scale_inv", "amax"):
                t = getattr(state, attr, None)
                if isinstance(t, torch.Tensor):
                    out[f"{name}.fp8_meta[{key}].{attr}"] = t.detach().clone()
            for i, q in enumerate(getattr(module, "quantizers", {}).get(key, []) or []):
                for attr in ("scale", "amax"):
                    t = getattr(q, attr, None)
                    if isinstance(t, torch.Tensor):
                        out[f"{name}.quantizers[{key}][{i}].{attr}"] = t.detach().clone()
        for wname, ws in (getattr(module, "_fp8_workspaces", None) or {}).items():
            for attr in ("_data", "_scale_inv", "_transpose"):
                t = getattr(ws, attr, None)
                if isinstance(t, torch.Tensor):
                    out[f"{name}._fp8_workspaces[{wname}].{attr}"] = t.detach().clone()
    return out


def snapshot(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    snap = {"loss": loss.detach().clone()}
    snap.update({f"param {n}": p.detach().clone() for n, p in model.named_parameters()})
    snap.update(fp8_state(model))
    return snap


def first_difference(eager: list[dict], graphed: list[dict]) -> str | None:
    for i, (e, g) in enumerate(zip(eager, graphed, strict=True)):
        if e.keys() != g.keys():
            return f"call {i}: different FP8 state keys: {sorted(set(e) ^ set(g))[:6]}"
        for key, t in e.items():
            if not torch.equal(t, g[key]):
                diff = (t.float() - g[key].float()).abs().max().item() if t.shape == g[key].shape else "shape"
                return f"call {i}: {key} differs (max |diff| {diff})"
    return None


# -- the probe ---------------------------------------------------------------------------------------


def run_eager(case: Case, data: list) -> list[dict]:
    fresh_fp8_state()
    model, opt = build(case)
    return train(case, model, make_step(model, model, opt, case), data)


def train(case: Case, model: torch.nn.Module, step: Callable, data: list) -> list[dict]:
    """Calls `step` on each batch; with `second_model`, an eager second model trained from call JOINS on;
    with `eval_model`, an eval model's forward (no grad) after each call from JOINS on."""
    other = other_step = None
    # Built (not run) before the first call: TE registers a module's amaxes at its first forward, and the
    # eval model's first forward must come after the capture; building it here keeps the seeding out of
    # the calls.
    watcher = build(case, seed=1)[0].eval() if case.eval_model else None
    snaps = []
    for i, (x, y) in enumerate(data):
        snap = snapshot(model, step(x, y))
        if case.second_model and i >= JOINS:
            if other is None:
                other, other_opt = build(case, seed=1)
                other_step = make_step(other, other, other_opt, case)
            snap.update({f"second model {k}": v for k, v in snapshot(other, other_step(x, y)).items()})
        if watcher is not None and i >= JOINS:
            fp8 = te.autocast(enabled=case.fp8, recipe=recipe())
            with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16), fp8:
                out = watcher(x)
            snap.update({f"eval model {k}": v for k, v in snapshot(watcher, out.float()).items()})
        snaps.append(snap)
    return snaps


def run_graphstep(case: Case, data: list, config: graphstep.Config | None = None) -> tuple[list[dict], dict]:
    fresh_fp8_state()
    model, opt = build(case)
    step = graphstep.capture(
        make_step(model, model, opt, case),
        model=model,
        optimizer=opt,
        generators=model.generators() or None,
        config=config,
    )
    return train(case, model, step, data), stats_of(step)


def stats_of(step) -> dict:
    stats = step.stats
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))


def probe(case: Case, calls: int = CALLS) -> dict:
    """One case: eager against graphstep, bitwise. Never raises."""
    row = {"case": case.name, "result": "ERROR", "detail": "", "stats": {}}
    try:
        # A second model makes the step warm up and capture again (3 + 1 calls) after it joins.
        calls = max(calls, JOINS + 9) if case.second_model or case.eval_model else calls
        data = batches(case, calls)
        with deterministic():
            eager = run_eager(case, data)
            try:
                graphed, row["stats"] = run_graphstep(case, data)
            except graphstep.GraphStepError as e:
                row.update(result="REFUSED", detail=f"{type(e).__name__}: {e}")
                return row
        difference = first_difference(eager, graphed)
        n_fp8 = sum(1 for k in eager[0] if "fp8" in k or "quantizers" in k)
        row.update(
            result="FAIL" if difference else "PASS",
            detail=difference or f"{calls} calls, {n_fp8} FP8 tensors",
        )
    except Exception:
        row["detail"] = traceback.format_exc()
    finally:
        try:  # a failed capture can leave the device in an error state: say so rather than stop the probe
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:
            row["detail"] += "\nafter the case:\n" + traceback.format_exc()
    return row


# -- the bench ---------------------------------------------------------------------------------------


def timed(step: Callable, data: list) -> tuple[float, float]:
    """ms per step over TIMED calls after WARMUP, and peak MiB over the whole run."""
    for i in range(WARMUP):
        step(*data[i % len(data)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(TIMED):
        step(*data[i % len(data)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / TIMED, torch.cuda.max_memory_allocated() / 2**20


def bench_one(case: Case, method: str) -> dict:
    row = {"case": case.name, "method": method, "ms": None, "peak_mib": None, "detail": ""}
    try:
        fresh_fp8_state()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model, opt = build(case)
        data = batches(case, 4)
        if method == "eager":
            step = make_step(model, model, opt, case)
        elif method == "te_graphed":
            # TE's documented way: the module graphed with its FP8 arguments (under bf16 autocast without
            # its cast cache, as TE requires), called under te.autocast; loss and AdamW stay eager.
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                graphed = te.make_graphed_callables(
                    model, (data[0][0],), enabled=case.fp8, recipe=recipe() if case.fp8 else None
                )
            opt.zero_grad(set_to_none=True)  # its warm-up's backward passes left gradients
            step = make_step(model, graphed, opt, case)
        else:
            step = graphstep.capture(
                make_step(model, model, opt, case),
                model=model,
                optimizer=opt,
                generators=model.generators() or None,
            )
        row["ms"], row["peak_mib"] = timed(step, data)
        if method == "graphstep":
            row["detail"] = json.dumps({k: v for k, v in stats_of(step).items() if isinstance(v, int)})
    except Exception:
        row["detail"] = traceback.format_exc()
    return row


# -- main --------------------------------------------------------------------------------------------


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    env["torch"] = torch.__version__
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    env["te"] = getattr(transformer_engine, "__version__", "?") if te is not None else "not importable"
    if te is not None:
        env["te_path"] = os.path.dirname(te.__file__)
        if f"{os.sep}site-packages{os.sep}" not in te.__file__:
            # graphstep takes code outside site-packages for the user's: TE's Python would be judged as the
            # step's own (its autocast's writes refused one by one, not by their net effect).
            print(f"WARNING: TE is not under a site-packages directory ({te.__file__}): install it into one")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true", help="the bitwise probe")
    parser.add_argument("--bench", action="store_true", help="timing rows")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per probe case")
    args = parser.parse_args()
    import_error = load_te()
    env = environment()
    print(json.dumps(env))
    if te is None:
        print("transformer_engine.pytorch does not import:\n" + import_error)
        report = {"env": env, "import_error": import_error, "probe": [], "bench": []}
        write(report, args.out, "te-bench" if args.bench and not args.quick else "te-probe")
        return
    fp8_ok, why = te.is_fp8_available(return_reason=True)
    env["fp8"] = f"{fp8_ok} {why}".strip()
    chosen = [c for c in cases(fp8_ok) if args.only in c.name]
    report: dict = {"env": env, "probe": [], "bench": []}
    if args.quick or not args.bench:
        for case in chosen:
            row = probe(case, args.calls)
            report["probe"].append(row)
            print(f"[probe] {row['case']}: {row['result']} {row['stats']}\n  {row['detail']}", flush=True)
            write(report, args.out)  # after every row: a crash later keeps what was found
    if args.bench:
        began = time.monotonic()
        for case in [c for c in BENCH_CASES if args.only in c.name and (fp8_ok or not c.fp8)]:
            for method in ("eager", "te_graphed", "graphstep"):
                if time.monotonic() - began > BENCH_BUDGET_S:  # a row that is slow: the rest say so
                    row = {"case": case.name, "method": method, "ms": None, "peak_mib": None}
                    row["detail"] = f"skipped: the bench ran past {BENCH_BUDGET_S} s"
                else:
                    row = bench_one(case, method)
                report["bench"].append(row)
                write(report, args.out, "te-bench")
                print(
                    f"[bench] {row['case']} {method}: {row['ms']} ms, {row['peak_mib']} MiB {row['detail']}",
                    flush=True,
                )
    if args.quick or not args.bench:
        write(report, args.out)
    if args.bench:
        write(report, args.out, "te-bench")
    counts = {}
    for row in report["probe"]:
        counts[row["result"]] = counts.get(row["result"], 0) + 1
    print("summary:", json.dumps(counts))


def write(report: dict, out: Path, kind: str = "te-probe") -> None:
    """`<out>/<gpu>_<date>_<kind>.{json,md}`: the probe's rows (te-probe) and the bench's (te-bench) in
    files of their own, so that a --bench run does not overwrite a --quick run's."""
    out.mkdir(parents=True, exist_ok=True)
    env = report["env"]
    card = re.search(r"\b[A-Z]\d{2,4}\b", env["gpu"])  # "NVIDIA H100 80GB HBM3" -> h100
    stem = f"{card.group(0).lower() if card else 'gpu'}_{env['date'][:10]}_{kind}"
    part = "bench" if kind == "te-bench" else "probe"
    kept = {k: v for k, v in report.items() if k not in ("probe", "bench") or k == part}
    (out / f"{stem}.json").write_text(json.dumps(kept, indent=1, default=str))
    lines = [f"# TE under graphstep ({part}): {env}", ""]
    if report.get("import_error"):
        lines += ["transformer_engine.pytorch does not import:", "", "```", report["import_error"], "```"]
    if part == "probe":
        lines += ["| case | result | detail |", "|---|---|---|"]
        for r in report["probe"]:
            said = r["detail"].strip().splitlines() or [""]
            said = said[-1] if r["result"] == "ERROR" else said[0]  # a traceback's last line, else the first
            lines.append(f"| {r['case']} | {r['result']} | {said.replace('|', '/')} |")
    else:
        lines += [
            f"hidden {BENCH_CASES[0].hidden}, {BENCH_CASES[0].layers} layers, seq {SEQ} x batch {BATCH}; "
            f"ms per step over {TIMED} steps after {WARMUP}; peak allocated over the run",
            "",
            "| case | method | ms/step | peak MiB | detail |",
            "|---|---|---|---|---|",
        ]
        for r in report["bench"]:
            ms = f"{r['ms']:.2f}" if r["ms"] is not None else "error"
            peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else ""
            said = (r["detail"].strip().splitlines() or [""])[-1].replace("|", "/")
            lines.append(f"| {r['case']} | {r['method']} | {ms} | {peak} | {said} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
