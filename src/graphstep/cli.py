"""The `graphstep` command line: `graphstep demo` and `graphstep bench`.

The only place in graphstep that configures logging: the library logs under the "graphstep"
logger and leaves handlers to the application, and here the command line is the application.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

_HANDLER_MARK = "_graphstep_cli"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]) and return the exit code."""
    args = _parser().parse_args(argv)
    _setup_logging(verbose=args.verbose)
    if args.command == "demo":
        from graphstep.demo.train import run_demo

        return run_demo(steps=args.steps, device=args.device)
    from graphstep.demo.bench import run_bench

    return run_bench(
        configs=args.configs, methods=args.methods, out_dir=args.out, quick=args.quick, steps=args.steps
    )


def _parser() -> argparse.ArgumentParser:
    from graphstep.demo.bench import CONFIGS, METHODS

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
        description="Run every method side by side on one GPU and write <gpu>_<date>.json, .md and .png "
        "to --out. Needs CUDA (exit code 2 without). Exit code 1 when some method failed; its row "
        "records the error and the other methods still run.",
    )
    bench.add_argument("--quick", action="store_true", help="fewer timed steps: a few minutes in all")
    bench.add_argument(
        "--configs",
        type=_names(CONFIGS),
        default=list(CONFIGS),
        help=f"comma-separated model sizes (default: {','.join(CONFIGS)})",
    )
    bench.add_argument(
        "--methods",
        type=_names(METHODS),
        default=list(METHODS),
        help=f"comma-separated methods, run in this order (default: {','.join(METHODS)})",
    )
    bench.add_argument(
        "--steps", type=_positive_int, default=None, help="timed steps per method (default: per config)"
    )
    bench.add_argument(
        "--out", default="benchmarks/results", help="directory for the result files (default: %(default)s)"
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
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
