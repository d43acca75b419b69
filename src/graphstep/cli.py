"""The `graphstep` command line: `graphstep demo` and `graphstep bench`.

The only place in graphstep that configures logging: the library logs under the "graphstep"
logger and leaves handlers to the application, and here the command line is the application.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable, Sequence

_HANDLER_MARK = "_graphstep_cli"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]) and return the exit code."""
    args = _parser().parse_args(argv)
    _setup_logging(verbose=args.verbose)
    if args.command == "demo":
        from .demo.train import run_demo

        return run_demo(steps=args.steps, device=args.device)
    from .bench.runner import run_bench

    command = shlex.join(["graphstep", *(sys.argv[1:] if argv is None else argv)])
    return run_bench(
        suite=args.suite, configs=args.configs, methods=args.methods, out_dir=args.out, quick=args.quick,
        steps=args.steps, budget_s=args.budget, row_timeout_s=args.row_timeout, isolate=not args.in_process,
        command=command, warm_cache=args.warm_cache,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    from .bench.runner import METHODS, ROW_TIMEOUT_S
    from .bench.suites import SUITE_METHODS, suites

    all_suites = suites()
    config_names = [name for table in all_suites.values() for name in table]

    parser = argparse.ArgumentParser(
        prog="graphstep", description="Capture a whole PyTorch training step into CUDA graphs."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train a tiny GPT eagerly and with graphstep; compare losses, weights and speed",
        description="Train the built-in tiny GPT twice from the same weights, eagerly and with graphstep, "
        "then print both loss curves and step times and check that every loss and final parameter is "
        "bitwise equal. Exit code 1 when they are not.",
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="training steps per run (default: 300 on CUDA, 200 on CPU)",
    )
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")

    bench = commands.add_parser(
        "bench",
        help="time every method (eager, torch.compile, reduce-overhead, hand-written graph, graphstep) on the GPU",
        description="Run every method side by side on one GPU, each (config, method) in a fresh process, and "
        "write <gpu>_<date>_<suite>[_quick].json, .md and .png to --out (JSON and Markdown after every row). "
        "Needs CUDA (exit code 2 without). Exit code 1 when some row failed; its row records the error and "
        "the other rows still run.",
    )
    bench.add_argument(
        "--suite",
        choices=list(all_suites),
        default="gpt",
        help="gpt: the built-in GPT at two sizes (default); models: ResNet-50, ViT-S/16, BERT-base, a 127M "
        "Llama, a PPO update, a GCN (optional packages: pip install 'graphstep[bench]')",
    )
    bench.add_argument("--quick", action="store_true", help="fewer timed steps: a few minutes per suite")
    bench.add_argument(
        "--configs",
        type=_names(config_names),
        default=None,
        help="comma-separated configs of the suite (default: all; "
        + "; ".join(f"{s}: {','.join(t)}" for s, t in all_suites.items())
        + ")",
    )
    bench.add_argument(
        "--methods",
        type=_names(METHODS),
        default=None,
        help="comma-separated methods (default: all of the suite's; "
        + "; ".join(f"{s}: {','.join(m)}" for s, m in SUITE_METHODS.items())
        + ")",
    )
    bench.add_argument(
        "--steps", type=_positive_int, default=None, help="timed steps per method (default: per config)"
    )
    bench.add_argument(
        "--out", default="benchmarks/results", help="directory for the result files (default: %(default)s)"
    )
    bench.add_argument(
        "--budget",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop starting rows after this many seconds; rows not run say so (default: no limit). "
        "Rows run by priority: eager, graphstep, hand-written graph; then graphstep with a compiled "
        "model, reduce-overhead; then torch.compile",
    )
    bench.add_argument(
        "--row-timeout",
        type=_positive_float,
        default=ROW_TIMEOUT_S,
        metavar="SECONDS",
        help="kill a row's process after this many seconds (default: %(default)s)",
    )
    bench.add_argument(
        "--warm-cache",
        action="store_true",
        help="reuse the environment's inductor and triton compile caches (default: each row's process "
        "compiles from fresh, empty cache directories, as on a new machine); the result says which",
    )
    bench.add_argument(
        "--in-process",
        action="store_true",
        help="run every row in this process: quicker, but a row's memory peak then includes what earlier "
        "rows left behind, and a crash ends the run",
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of names from `allowed`."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; choose from {','.join(allowed)}"
            )
        return names

    return parse


def _setup_logging(*, verbose: bool) -> None:
    logger = logging.getLogger("graphstep")
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Replace, not add: main() may run more than once per process (tests), and a handler keeps the
    # stderr it was created with.
    for handler in [h for h in logger.handlers if getattr(h, _HANDLER_MARK, False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    setattr(handler, _HANDLER_MARK, True)
    logger.addHandler(handler)


class _Formatter(logging.Formatter):
    """Notices print as they are (they name graphstep already); warnings and errors say so."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname}: {text}"
