"""`graphstep bench`'s result files: `<gpu>_<date>_<suite>[_quick]` .json (meta + rows), .md (the
tables, the targets, a table to paste into the README, configs, how each number is measured) and,
with matplotlib, .png. Rewritten after every row, so a run cut short still leaves its files."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("graphstep")

METHOD_ORDER = (
    "eager", "compile", "reduce_overhead", "compiled_step", "compiled_step_ro", "manual_graph", "graphstep",
    "graphstep_compiled",
)  # fmt: skip
README_NAMES = {
    "eager": "eager",
    "compile": "torch.compile",
    "reduce_overhead": "compile reduce-overhead",
    "compiled_step": "whole step compiled (compiled autograd, optimizer inside; default mode)",
    "compiled_step_ro": "whole step compiled (compiled autograd, optimizer inside; reduce-overhead)",
    "manual_graph": "hand-written whole-step graph",
    "graphstep": "**graphstep**",
    "graphstep_compiled": "**graphstep + compiled model**",
}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Set each row's `ratio_to_graphstep` (step_ms over graphstep's, same config) and
    `pipelined_ratio_to_graphstep` (pipelined_ms over graphstep's); None without both numbers."""
    for key, ratio in (("step_ms", "ratio_to_graphstep"), ("pipelined_ms", "pipelined_ratio_to_graphstep")):
        ref = {r["config"]: r.get(key) for r in rows if r["method"] == "graphstep" and r.get(key)}
        for r in rows:
            base = ref.get(r["config"])
            r[ratio] = r[key] / base if base and r.get(key) is not None else None


def gpu_slug(name: str) -> str:
    """A short file-name-safe GPU name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090"."""
    words = [w for w in re.split(r"[\s_-]+", name) if w.lower() not in ("nvidia", "geforce", "tesla", "")]
    if not words:
        return "gpu"
    slug = words[0] + (words[1] if len(words) > 1 and words[0].isalpha() else "")
    return re.sub(r"[^a-z0-9]", "", slug.lower()) or "gpu"


def stem(meta: dict[str, Any]) -> str:
    return f"{meta['gpu']}_{meta['date']}_{meta.get('suite', 'gpt')}" + (
        "_quick" if meta.get("quick") else ""
    )


def sorted_rows(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows by config (the suite's order), then method (METHOD_ORDER), whatever order they ran in."""
    configs = list(meta.get("configs") or {})

    def key(r: dict[str, Any]) -> tuple[int, int]:
        c = configs.index(r["config"]) if r["config"] in configs else len(configs)
        m = METHOD_ORDER.index(r["method"]) if r["method"] in METHOD_ORDER else len(METHOD_ORDER)
        return c, m

    return sorted(rows, key=key)


def write_results(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path, *, chart: bool = True
) -> list[Path]:
    """Write `<stem>.json`, `.md` and, with `chart` and matplotlib, `.png` to `out_dir`. Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted_rows(rows, meta)
    paths = [out / f"{stem(meta)}.json", out / f"{stem(meta)}.md"]
    paths[0].write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str) + "\n")
    paths[1].write_text(markdown(rows, meta))
    if not chart:
        return paths
    try:
        import matplotlib
    except ImportError:
        log.warning(
            "graphstep bench: matplotlib is not installed: no chart written (pip install 'graphstep[bench]')"
        )
        return paths
    matplotlib.use("Agg")  # files only, no display needed
    paths.append(out / f"{stem(meta)}.png")
    try:
        plot(rows, meta, paths[2])
    except Exception as e:  # a chart must never cost the numbers
        log.warning("graphstep bench: drawing the chart failed: %s: %s", type(e).__name__, e)
        paths.pop()
    return paths


# ---------------------------------------------------------------- markdown


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:.{digits}f}"


def _note(r: dict[str, Any]) -> str:
    text = r.get("error") or (f"skipped: {r['skipped']}" if r.get("skipped") else "")
    return text.replace("|", "/").replace("\n", " ")


def _gs(r: dict[str, Any]) -> str:
    g = r.get("graphstep")
    if not g:
        return ""
    host = g.get("host_us_per_replay")
    text = f"{g.get('captures')} / {g.get('variants')} / {g.get('replays')}"
    if g.get("eager_calls"):
        text += f", {g['eager_calls']} eager"
    text += f", {host:.0f} µs" if host is not None else ""
    if g.get("graph_breaks"):  # what the breaks cost the host: their segments' eager time per call
        segments = g.get("segments_host_ms")
        text += f"; {g['graph_breaks']} breaks" + (
            f", segments {segments:.2f} ms" if segments is not None else ""
        )
    return text


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | method | step ms | pipelined ms | kernel ms | pipelined / kernel | × graphstep | host µs/call "
        "pipelined | host µs/call in bursts | peak reserved GiB | to steady state s "
        "| graphstep captures / variants / replays, host µs/replay; breaks, segments' host ms/call | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['method']} | {_fmt(r.get('step_ms'))} | {_fmt(r.get('pipelined_ms'))} | "
            f"{_fmt(r.get('kernel_ms'))} | {_fmt(r.get('pipelined_over_kernel'))} | "
            f"{_fmt(r.get('ratio_to_graphstep'))} | {_fmt(r.get('host_us'), 0)} | {_fmt(r.get('host_burst_us'), 0)} | "
            f"{_fmt(r.get('peak_reserved_gib'))} | {_fmt(r.get('capture_s'), 1)} | {_gs(r)} | {_note(r)} |"
        )
    return "\n".join(lines)


def readme_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The README's Measured table: friendly names, one config label per group."""
    labels = {name: d.get("label", name) for name, d in (meta.get("configs") or {}).items()}
    lines = [
        "| config | method | step ms | pipelined ms | × graphstep | kernel ms | peak reserved GiB "
        "| warm-up incl. compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    last = None
    for r in rows:
        label = labels.get(r["config"], r["config"]) if r["config"] != last else ""
        last = r["config"]
        name = README_NAMES.get(r["method"], r["method"])
        step = _fmt(r.get("step_ms"))
        if r["method"].startswith("graphstep") and r.get("step_ms") is not None:
            step = f"**{step}**"
        if r.get("error") or r.get("skipped"):
            step = f"{step} ({'failed' if r.get('error') else 'skipped'})"
        lines.append(
            f"| {label} | {name} | {step} | {_fmt(r.get('pipelined_ms'))} | {_fmt(r.get('ratio_to_graphstep'))} | "
            f"{_fmt(r.get('kernel_ms'))} | {_fmt(r.get('peak_reserved_gib'))} | {_fmt(r.get('capture_s'), 1)} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 13's targets per config, each with its measured value (— where a number is missing)."""
    by = {(r["config"], r["method"]): r for r in rows}
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        g = by.get((config, "graphstep"), {})
        e = by.get((config, "eager"), {})
        gc = by.get((config, "graphstep_compiled"), {})
        ro = by.get((config, "reduce_overhead"), {})
        cs = [by[config, m] for m in ("compiled_step", "compiled_step_ro") if (config, m) in by]
        best_cs = min((r["pipelined_ms"] for r in cs if r.get("pipelined_ms")), default=None)
        checks = [
            ("graphstep pipelined / kernel", g.get("pipelined_over_kernel"), 1.03),
            ("graphstep pipelined / its graph launched alone", _div(g.get("pipelined_ms"), g.get("graph_floor_ms")), 1.03),
            ("graphstep / eager, pipelined", _div(g.get("pipelined_ms"), e.get("pipelined_ms")), 1.0),
            ("graphstep / eager, step", _div(g.get("step_ms"), e.get("step_ms")), 1.0),
            ("graphstep+compiled / reduce-overhead, pipelined", _div(gc.get("pipelined_ms"), ro.get("pipelined_ms")), 1.0),
            ("graphstep peak reserved / eager", _div(g.get("peak_reserved_gib"), e.get("peak_reserved_gib")), 1.05),
        ]  # fmt: skip
        if cs:  # the gpt suite: the whole step compiled, the better of its two modes; like for like,
            # graphstep with the model compiled too
            checks.append(
                (
                    "graphstep+compiled / whole step compiled (best mode), pipelined",
                    _div(gc.get("pipelined_ms"), best_cs),
                    1.0,
                )
            )
        parts = [
            f"{name} {_fmt(v)} (≤ {limit:g}{'' if v is None else ' ✓' if v <= limit else ' ✗'})"
            for name, v, limit in checks
        ]
        if cs:
            parts.append(
                f"graphstep (model not compiled) / whole step compiled {_fmt(_div(g.get('pipelined_ms'), best_cs))}"
            )
        parts += _host_targets(g, by.get((config, "manual_graph"), {}))
        out.append(f"- **{config}**: " + "; ".join(parts) + ".")
    return out


def _host_targets(g: dict[str, Any], hand: dict[str, Any]) -> list[str]:
    """Issue 24: graphstep's host time per call at most 15 µs over the hand-written graph's, in bursts
    (the host's own time) and as the pipelined median (the GPU's time once most calls wait for a
    full launch queue: it says which of the two a run measured). Where the hand-written graph's calls
    take at least half its GPU time per step, its calls wait for the GPU (a large model's graph
    launch blocks until the previous step is done): the difference is not host time and is shown
    without a verdict."""
    out = []
    for key, how in (("host_burst_us", "in bursts"), ("host_us", "pipelined")):
        mine, theirs = g.get(key), hand.get(key)
        if mine is not None and theirs is not None:
            over = mine - theirs
            text = (
                f"graphstep host µs per call over the hand-written graph's ({how}, medians) "
                f"{over:+.0f} = {mine:.0f} − {theirs:.0f}"
            )
            if _waits_for_gpu(theirs, hand):
                out.append(f"{text} (calls wait for the GPU: no host-time verdict)")
            else:
                out.append(f"{text} (≤ 15{' ✓' if over <= 15 else ' ✗'})")
        elif mine is not None:
            out.append(f"graphstep host µs per call ({how}, median) {mine:.0f}")
    return out


def _waits_for_gpu(host_us: float, row: dict[str, Any]) -> bool:
    gpu_ms = row.get("kernel_ms") or row.get("pipelined_ms")
    return gpu_ms is not None and host_us >= 0.5 * gpu_ms * 1e3


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    isolation = (
        meta["isolate"]  # rows of runs merged by `main`: the merger says which ran where
        if isinstance(meta.get("isolate"), str)
        else "Each row ran in a fresh process: its memory peak is the method's own."
        if meta.get("isolate")
        else "All rows ran in one process (--in-process): memory peaks may include earlier rows' leftovers."
    )
    cache = {
        "cold": " Every row compiled from a cold cache (fresh inductor and triton cache directories).",
        "warm": " Rows reused the environment's compile caches (--warm-cache).",
    }.get(meta.get("compile_cache"), "")
    isolation += cache
    counts = meta.get("counts") or {}
    parts = [
        f"# graphstep bench, suite {meta.get('suite', 'gpt')}: {meta['gpu_name']}, {meta['date']}"
        + (" (quick run)" if meta.get("quick") else ""),
        f"torch {meta['torch']}, CUDA {meta['cuda']}, graphstep {meta.get('graphstep')}, Python {meta.get('python')}. "
        f"{isolation} Methods ran in this order (it decides whose compilation warms inductor's cache): "
        f"{', '.join(meta.get('order') or [])}. Command: `{meta.get('command', '')}`.",
        f"Per method: {counts.get('warmup_calls')} warm-up calls, the timed steps of its config (below), "
        f"{counts.get('pipelined_calls')} pipelined calls, {counts.get('bursts', 0)} bursts of "
        f"{counts.get('burst_calls', 0)} calls, {counts.get('profiled_steps')} profiled steps.",
        markdown_table(rows),
        "## Targets (issues 13 and 24)",
        "\n".join(targets(rows)) or "(no rows)",
        "## For the README (Measured)",
        readme_table(rows, meta),
        "## Configs",
        *(
            f"- **{name}**: {d.get('label', name)}; {_fmt((d.get('parameters') or 0) / 1e6, 2)}M parameters; "
            f"{d.get('timed_steps')} timed steps; "
            + ", ".join(f"{k}={v}" for k, v in (d.get("details") or {}).items())
            for name, d in (meta.get("configs") or {}).items()
        ),
        "## How each number is measured",
        *(f"- `{k}`: {v}" for k, v in (meta.get("measurement") or {}).items()),
    ]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------- chart


def plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    ncols = min(3, max(1, len(configs)))
    nrows = math.ceil(len(configs) / ncols) if configs else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.5 * nrows), squeeze=False)
    series = (
        ("step_ms", "step ms (synchronised)", "#4c72b0"),
        ("pipelined_ms", "pipelined ms (100 calls, 1 sync)", "#55a868"),
        ("kernel_ms", "GPU kernel ms (profiler)", "#dd8452"),
    )
    for i, ax in enumerate(axes.flat):
        if i >= len(configs):
            ax.axis("off")
            continue
        sub = [r for r in rows if r["config"] == configs[i]]
        width = 0.27
        for j, (key, label, color) in enumerate(series):
            xs = [x + (j - 1) * width for x in range(len(sub))]
            ax.bar(xs, [r.get(key) or 0.0 for r in sub], width=width, color=color, label=label)
        for x, r in enumerate(sub):
            text = (
                "failed" if r.get("error") else "skipped" if r.get("skipped") else _fmt(r.get("pipelined_ms"))
            )
            top = max((r.get(k) or 0.0) for k, _, _ in series)
            ax.text(x, top, text, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(range(len(sub))), [r["method"] for r in sub], rotation=30, ha="right")
        ax.set_ylabel("ms per step")
        values = [r.get(k) for r in sub for k, _, _ in series if r.get(k)]
        if values and max(values) > 30 * min(values):  # eager or a slow anchor would flatten the rest
            ax.set_yscale("log")
            ax.set_ylabel("ms per step (log scale)")
        ax.set_title(configs[i])
        ax.legend(fontsize=7)
    fig.suptitle(
        f"graphstep bench ({meta.get('suite', 'gpt')}): {meta['gpu_name']}, torch {meta['torch']}, {meta['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`python -m graphstep.bench.report FILE.json [OUT_DIR]`: write the .json, .md and .png again
    from FILE into OUT_DIR (default: FILE's folder): a run cut short before its chart, tables changed, or
    rows of two runs merged into one file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m graphstep.bench.report RESULTS.json [OUT_DIR]", file=sys.stderr)
        return 2
    data = json.loads(Path(args[0]).read_text())
    rows = data.pop("rows")
    add_ratios(rows)  # rows merged from several runs get their ratios to the graphstep row
    for path in write_results(rows, data, args[1] if len(args) == 2 else Path(args[0]).parent):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
