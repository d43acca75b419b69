"""What watching for host random draws adds to a capture: capture time of the demo GPT (with
dropout, so the watch compares generator states around every dropout call) with the watch on and
off (a pass-through in its place), several captures each. Replays are untouched by the watch.

    python benchmarks/host_random_cost.py --out benchmarks/results/h100_2026-11-24_host-random.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics

import torch

import graphstep
from graphstep.demo.gpt import GPT, GPTConfig, make_batches
from graphstep.effects import host_random

CFG = GPTConfig(n_layer=4, n_embd=128, dropout=0.1)


@contextlib.contextmanager
def _watch_off(name, backend, fn, splitter, args, kwargs):
    yield splitter


def capture_seconds(device: str, watched: bool, repeats: int) -> list[float]:
    original = host_random.refusing
    if not watched:
        host_random.refusing = _watch_off
    try:
        times = []
        for _ in range(repeats):
            torch.manual_seed(0)
            model = GPT(CFG).to(device)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

            def step(x, y, model=model, opt=opt):
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss

            config = graphstep.Config(backend="auto" if device == "cuda" else "recording")
            captured = graphstep.capture(step, model=model, optimizer=opt, config=config)
            for x, y in make_batches(CFG, batch_size=8, n_batches=5, seed=0, device=device):
                captured(x, y)
            times.append(captured.stats.capture_s)
            captured.close()
        return times
    finally:
        host_random.refusing = original


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    capture_seconds(device, True, 1)  # first use: imports, cuBLAS handles, the pool
    result = {
        "question": "capture time with and without the host random watch",
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "config": {**vars(CFG), "batch_size": 8, "optimizer": "SGD momentum", "repeats": args.repeats},
    }
    for watched in (False, True, False, True):  # interleaved against drift
        key = "watched_s" if watched else "unwatched_s"
        result.setdefault(key, []).extend(capture_seconds(device, watched, args.repeats))
    for key in ("unwatched_s", "watched_s"):
        result[key.replace("_s", "_median_ms")] = 1e3 * statistics.median(result[key])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
