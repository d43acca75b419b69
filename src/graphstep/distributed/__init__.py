"""Distributed steps: the ranks of a process group warm up, capture and re-capture together.

- `ranks.py`: `Ranks`, their agreement on each call's phase, and DDP / NCCL preparation.
- `collectives.py`: while eager or capturing, ranks go collective by collective together.
- `p2p.py`: steps with sends and receives (pipeline parallelism): what each group and pair exchanged,
  compared at the end of each call instead.
- `vote.py`: the transport of the ranks' vote (shared memory on one host, the process group across hosts).
- `breaks.py`: after a capture failed, every rank makes the same graph breaks (the union of what each needs).
"""

from .ranks import (
    DDP_WARMUP_STEPS,
    Agreement,
    Phase,
    Ranks,
    check_nccl_graph_registration,
    close_before_destroy,
    expandable_segments,
    prepare_ddp,
    ranks_for,
    recover_ddp,
    set_nccl_graph_registration,
)

__all__ = [
    "DDP_WARMUP_STEPS",
    "Agreement",
    "Phase",
    "Ranks",
    "check_nccl_graph_registration",
    "close_before_destroy",
    "expandable_segments",
    "prepare_ddp",
    "ranks_for",
    "recover_ddp",
    "set_nccl_graph_registration",
]
