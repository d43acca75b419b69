"""What does watching the step's Python writes cost a capture?

At capture graphstep takes a census of the collector's objects and traces the step's user frames
(see src/graphstep/effects/writes.py). This times whole captures (`StepStats.capture_s`) of the demo GPT
and a small transformers GPT-2 with the watch and with it switched off, each on a fresh step, plus the
census alone and how many objects it holds. Steady-state replays are untouched (the watch runs at
capture only). Writes benchmarks/results/<gpu>_<date>_capture_watch_cost.{json,md}.
Run: `python benchmarks/capture_watch_cost.py [--repeats 3] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import graphstep
from graphstep import effects
from graphstep.bench.report import gpu_slug
from graphstep.demo.gpt import GPT, TINY, make_batches
from graphstep.effects.values import Census


def demo_gpt(device: str):
    model = GPT(TINY).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    graphstep.optim.make_capturable(opt, device)
    x, y = make_batches(TINY, batch_size=8, n_batches=1, seed=0, device=device)[0]

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, model, opt, (x, y)


def gpt2(device: str):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    graphstep.optim.make_capturable(opt, device)
    ids = torch.randint(512, (4, 64), device=device)
    mask = torch.ones_like(ids)

    def step(ids, mask):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, model, opt, (ids, mask)


def capture_seconds(make, device: str, config: graphstep.Config, watched: bool) -> float:
    step, model, opt, batch = make(device)
    original = effects.watch_writes
    if not watched:
        effects.watch_writes = lambda name, *, allow_writes, graphs: original(
            name, allow_writes=allow_writes, graphs=False
        )
    try:
        captured = graphstep.capture(step, model=model, optimizer=opt, config=config)
        for _ in range(config.warmup_steps + 1):
            captured(*batch)
        seconds = captured.stats.capture_s
        captured.close()
    finally:
        effects.watch_writes = original
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = graphstep.Config(backend="auto" if cuda else "recording")
    makers = {"demo GPT (TINY)": demo_gpt}
    try:
        import transformers  # noqa: F401

        makers["transformers GPT-2 (2 layers, 64 wide)"] = gpt2
    except ImportError:
        pass
    rows = []
    for name, make in makers.items():
        capture_seconds(make, device, config, True)  # first capture: imports, cuBLAS, caches
        with_watch = [capture_seconds(make, device, config, True) for _ in range(args.repeats)]
        without = [capture_seconds(make, device, config, False) for _ in range(args.repeats)]
        rows.append(
            {
                "model": name,
                "capture_ms_watched": 1e3 * statistics.median(with_watch),
                "capture_ms_unwatched": 1e3 * statistics.median(without),
            }
        )
    census_objects = len(gc.get_objects())  # what the census goes through (tensors it leaves out included)
    start = time.perf_counter()
    census = Census()
    census_ms = 1e3 * (time.perf_counter() - start)
    result = {
        "question": "What does watching the step's Python writes cost a capture?",
        "gpu": torch.cuda.get_device_name() if cuda else "none (recording backend on CPU)",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
        "config": {"backend": config.backend, "warmup_steps": config.warmup_steps, "repeats": args.repeats},
        "census_objects": census_objects,
        "census_ms": census_ms,
        "rows": rows,
    }
    census.drop()
    slug = (gpu_slug(torch.cuda.get_device_name()) if cuda else "cpu") + "_" + result["date"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{slug}_capture_watch_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Capture cost of the write watch: {result['gpu']}, Python {result['python']}, "
        f"torch {result['torch']}, {result['date']}",
        "",
        f"Census: {result['census_objects']} objects in {census_ms:.1f} ms (medians of {args.repeats} captures).",
        "",
        "| model | capture, watched (ms) | capture, unwatched (ms) |",
        "|---|---|---|",
        *(
            f"| {r['model']} | {r['capture_ms_watched']:.1f} | {r['capture_ms_unwatched']:.1f} |"
            for r in rows
        ),
    ]
    (out / f"{slug}_capture_watch_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
