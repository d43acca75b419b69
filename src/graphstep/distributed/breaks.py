"""Automatic graph breaks with ranks: every rank breaks at the same modules.

A graph break (`backends/graph_breaks.py`) makes the module a capture stopped in an eager segment, and the
step warms up once more and captures again. With ranks, that decision must be the same everywhere: a rank
that runs a module eagerly while another captures it issues that module's collectives (FSDP2's
all-gathers, tensor parallelism's all-reduces) and the gradient reductions of its parameters (DDP's
buckets) at other points than its peer, and their collectives pair up wrongly. And the ranks see
different failures: the first rank whose capture stops (a host sync its data reaches, a branch only it
takes) stops the others at their next collective, or at the end of their capture, with its error, so only
that rank knows the line.

So once the ranks have agreed that a capture failed (`Ranks.capture_failure`), and not because a rank ran
out of memory (every rank then steps eagerly, see ranks.py), each rank says what its own failure calls
for, in one exchange of short texts over the vote's group (this path only; a replay never pays for it):

- a break: the module (its qualified name in the model, the same on every rank) or known function around
  the line its capture stopped at;
- "again": its capture reached eager segments its last warm-up did not (a break moved out, say);
- "none": its capture was stopped by another rank's failure (or succeeded);
- "refuse": its failure is not one a break can take (an error in the step, a host sync in the step
  function itself), or its graph breaks are off.

If no rank refuses and some rank asks for a break or another warm-up, every rank makes the union of the
breaks (the module and every module of its class, as one process does) and runs this call as one more
warm-up, together; all capture on the next call, with the same breaks and the same warm-up count. Else
every rank raises as before: the agreed error, and a failing rank its own.
"""

from __future__ import annotations

import json
from typing import Any

from ..backends.graph_breaks import GraphBreaks
from ..diagnostics import log
from ..errors import CaptureError, CompileAtCaptureError, GraphStepError, WarmUpAgain
from .ranks import Ranks, ddp_modules

_WHY_CHARS = 300
"""Of the error a break names, the part sent to the other ranks (the exchange carries 2,000 characters)."""


def proposal(breaks: GraphBreaks, own: BaseException | None) -> dict[str, Any]:
    """What this rank's failed capture calls for. `own`: its own error (None when another rank's
    failure stopped it, or it succeeded)."""
    if breaks.mode != "auto":
        return {"do": "refuse"}  # breaks off (or the eager backend): its error stands, as everywhere
    if own is None:
        return {"do": "none"}
    if isinstance(own, WarmUpAgain):
        compiling = isinstance(own, CompileAtCaptureError)
        text = str(own)[:_WHY_CHARS]
        return {
            "do": "again",
            "after_break": own.after_break or breaks.moved,
            "compile": compiling,
            "why": text,
        }
    target = breaks.target_for(own) if isinstance(own, Exception) else None
    if target is None:
        return {"do": "refuse", "why": breaks.refused} if breaks.refused else {"do": "refuse"}
    kind, _, name, line, why = target
    return {"do": "break", "kind": kind, "name": name, "line": line, "why": why[:_WHY_CHARS]}


def agree_on_breaks(ranks: Ranks, breaks: GraphBreaks, own: BaseException | None) -> GraphStepError | None:
    """After a capture every rank agreed failed: the ranks' proposals exchanged, the breaks made on every
    rank (the same ones), and the `WarmUpAgain` this rank raises (this call is one more warm-up on every
    rank); a `CaptureError` every rank raises when a rank found a module around its line where no break
    can be made (saying why); None when some rank refuses otherwise: every rank's error stands. `own`: as
    in `proposal`."""
    mine = proposal(breaks, own)
    texts = ranks.gather_text(json.dumps(mine))
    try:
        proposals = [json.loads(text) for text in texts]
    except ValueError:  # a rank's text did not come through: no rank can tell what the others do
        return None
    reason = next(
        ((r, p["why"]) for r, p in enumerate(proposals) if p.get("do") == "refuse" and p.get("why")), None
    )
    if reason is not None:
        return CaptureError(
            f"capturing {breaks.step_name} stopped on rank {reason[0]} and no rank breaks: {reason[1]}"
        )
    if any(p.get("do") not in ("break", "again", "none") for p in proposals):
        return None
    wanted = [p for p in proposals if p["do"] == "break"]
    after_break = bool(wanted) or any(p.get("after_break") for p in proposals if p["do"] == "again")
    if not wanted and not any(p["do"] == "again" for p in proposals):
        return None
    target = breaks.target_for(own) if mine["do"] == "break" else None
    for rank, p in enumerate(proposals):
        if p["do"] != "break":
            continue
        if rank == ranks.rank and target is not None:  # its own: with its frame (a known function's caller)
            if target[2] not in {s for made in breaks.made for s in made.segments}:
                breaks.make(*target)
            continue
        line = p["line"] if rank == ranks.rank else f"{p['line']} on rank {rank}"
        breaks.make_named(p["kind"], p["name"], line, p["why"])
    breaks.moved = False
    asking = [(rank, p) for rank, p in enumerate(proposals) if p["do"] in ("break", "again")]
    log.info(
        "graphstep: %s: rank(s) %s asked for %s; every rank warms up once more with the same breaks (%d)",
        breaks.step_name,
        [rank for rank, _ in asking],
        "a graph break" if wanted else "another warm-up",
        len(breaks.made),
    )
    # The same error on every rank, so that every rank's next steps (`lifecycle._warm_up_again`) agree:
    # a compiled frame that would compile at capture gives way as one process does, on every rank.
    compiling = any(p.get("compile") for _, p in asking)
    first, said = next((r, p) for r, p in asking if p["do"] == "break") if wanted else asking[0]
    message = (
        f"a graph break was made in {breaks.step_name} at {said['name']} (rank {first}'s capture stopped "
        "inside it), on every rank"
        if wanted
        else f"rank {first}: {said['why']} (every rank warms up once more)"
    )
    return (CompileAtCaptureError if compiling else WarmUpAgain)(message, after_break=after_break)


DDP_BUCKETS_AROUND_A_BREAK = (
    "With graph breaks under DistributedDataParallel this is what happens when a gradient bucket's "
    "all-reduce is issued in the backward before a break's segment and waited for after it (DDP with "
    "several buckets; seen on H100s, not yet supported). One bucket avoids it: "
    "DistributedDataParallel(..., bucket_cap_mb=) above the size of the parameters' gradients in MiB."
)


def split_capture_hint(error: BaseException, modules: list) -> str | None:
    """What to add to the error of a capture split by graph breaks that CUDA stopped with "invalid
    argument": a wait in one part of the capture on work recorded in another, which DDP's buckets make
    (seen on H100s; FSDP2's events are kept inside each part, fsdp_parts.py); None for any other error
    or model."""
    if "invalid argument" in str(error) and ddp_modules(modules):
        return DDP_BUCKETS_AROUND_A_BREAK
    return None
