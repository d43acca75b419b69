"""What does each watch's hook cost a call-heavy piece of Python, per tracer path?

The capture's watches (src/graphstep/guards/tracing.py) run on every frame the step starts (reads),
every C call (host random draws) and every instruction of the frames that can write (writes). This
times a stand-in for library code — many small Python functions and C calls, a few frames that
write — bare, under each legacy hook (`sys.settrace`, `sys.setprofile`) and under its
`sys.monitoring` counterpart (`Monitoring`, `Starts`; for host draws, a CALL/C_RETURN hook that
graphstep does not use, being slower than the profile function), with do-nothing clients. It needs
the standard library only (tracing.py is loaded by its path), so it runs on any Python, 3.12 and
3.13 included, with or without torch.
Run: `python3.12 benchmarks/tracer_cost.py [--out DIR]` (prints a table; with --out writes
<out>/py<version>_tracer_cost.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
import types
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "src" / "graphstep" / "guards" / "tracing.py"
_spec = importlib.util.spec_from_file_location("graphstep_tracing_timed", _PATH)
tracing = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tracing
_spec.loader.exec_module(tracing)


class Box:
    pass


def small(i: int) -> int:  # library-like: not traced
    x = i * 2
    return abs(x) + 1


def library(n: int, rng: random.Random) -> int:
    total = 0
    for i in range(n):
        total += small(i) + len(str(i))
    return total + int(rng.random() > 2)


def w_user(box: Box, n: int) -> None:  # the user's frame: traced (it writes)
    box.total = library(n, random.Random(0))
    for i in range(50):
        box.last = i


class Client:
    def frame_kind(self, frame):
        return tracing.Kind.TRACE if frame.f_code.co_name.startswith("w_") else tracing.Kind.SKIP

    def logging_call(self, frame):
        pass

    def opcode(self, frame, offset):
        pass

    def finish(self, frame):
        pass


def profile(frame, event, arg):
    if event == "call":
        frame.f_code.co_name  # noqa: B018  (the read watch's look, in its least)


def c_profile(frame, event, arg):
    if event[0] == "c":
        getattr(arg, "__self__", None)


class _CCalls:
    """What a host random watch on `sys.monitoring` would need: CALL (every call, Python functions'
    included: no DISABLE, a call site's callee may change), C_RETURN and C_RAISE, with the least a
    callback can do. Timed to show why it stays on `sys.setprofile`, which filters C calls in C: this
    costs as much on 3.12 and 3.13, and a callback that does the watch's checks (thread, bound
    methods) cost twice as much."""

    def start(self) -> bool:
        events = sys.monitoring.events
        sys.monitoring.use_tool_id(3, "tracer_cost")
        sys.monitoring.register_callback(3, events.CALL, self._call)
        sys.monitoring.register_callback(3, events.C_RETURN, self._call)
        sys.monitoring.register_callback(3, events.C_RAISE, self._call)
        sys.monitoring.set_events(3, events.CALL | events.C_RETURN | events.C_RAISE)
        return True

    def stop(self) -> None:
        events = sys.monitoring.events
        sys.monitoring.set_events(3, 0)
        sys.monitoring.register_callback(3, events.CALL, None)
        sys.monitoring.register_callback(3, events.C_RETURN, None)
        sys.monitoring.register_callback(3, events.C_RAISE, None)
        sys.monitoring.free_tool_id(3)

    def _call(self, code, offset, function, first):
        if isinstance(function, types.BuiltinFunctionType):
            getattr(function, "__self__", None)


def hooks() -> dict[str, tuple]:
    """name -> (start, stop) of each hook (None: bare)."""
    found: dict[str, tuple] = {"bare": (lambda: None, lambda: None)}
    settrace = tracing.Settrace(Client())
    found["writes: sys.settrace"] = (settrace.start, settrace.stop)
    found["reads: sys.setprofile"] = (lambda: sys.setprofile(profile), lambda: sys.setprofile(None))
    found["host draws: sys.setprofile"] = (lambda: sys.setprofile(c_profile), lambda: sys.setprofile(None))
    if hasattr(sys, "monitoring"):
        monitoring = tracing.Monitoring(Client())
        found["writes: sys.monitoring (Monitoring)"] = (monitoring.start, monitoring.stop)
        starts = tracing.Starts(lambda frame: frame.f_code.co_name.startswith("w_"), lambda f: f)
        found["reads: sys.monitoring (Starts)"] = (starts.start, starts.stop)
        calls = _CCalls()
        found["host draws: sys.monitoring CALL/C_RETURN (not used)"] = (calls.start, calls.stop)
    return found


def timed(start, stop, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start()
        began = time.perf_counter()
        w_user(Box(), n)
        took = time.perf_counter() - began
        stop()
        best = min(best, took)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = {name: 1e3 * timed(*pair, args.calls, args.repeats) for name, pair in hooks().items()}
    version = sys.version.split()[0]
    print(f"Python {version}: {args.calls} library calls (best of {args.repeats}), ms")
    for name, ms in rows.items():
        print(f"  {name:40s} {ms:8.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"python": version, "calls": args.calls, "repeats": args.repeats, "ms": rows}
        (out / f"py{version}_tracer_cost.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
