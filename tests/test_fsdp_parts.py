"""What graphstep finds in FSDP2's state to keep a capture split by graph breaks legal on CUDA
(distributed/fsdp_parts.py): the events it holds, wherever in its contexts, groups and parameters. The
CUDA side (side streams joined to each part, events recorded again) runs in
tests/gpu/test_distributed_gpu.py; here the recording backend captures nothing and needs neither."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import torch

from graphstep.distributed.fsdp_parts import held_events

Held = namedtuple("Held", ["tensor", "event"])


def test_every_event_fsdp2_holds_is_found_once_and_nothing_else():
    events = [torch.Event(device="cpu") for _ in range(6)]
    shared = events[0]
    param = SimpleNamespace(grad_offload_event=events[1], _sharded_param_data=torch.zeros(2))
    group = SimpleNamespace(
        fsdp_params=[param],
        _post_reduce_event=None,
        _reshard_after_forward_event=events[2],
        _all_gather_result=Held(torch.zeros(2), events[3]),
    )
    comm = SimpleNamespace(
        _last_post_reduce_events={"stream": events[4]},
        reduce_scatter_states=[Held(torch.zeros(2), events[5]), Held(torch.zeros(2), shared)],
        all_gather_state=SimpleNamespace(all_gather_result=Held(torch.zeros(2), shared), event=shared),
    )
    state = SimpleNamespace(_comm_ctx=comm, _fsdp_param_group=group)
    # FSDP2's state context lists every state: the communication context is reached deep from there first.
    state._state_ctx = SimpleNamespace(post_optim_event=shared, all_states=[state])
    found = held_events([state, state])
    assert len(found) == len(events) and all(any(f is e for f in found) for e in events)


def test_fsdp2_on_newer_torch_holds_a_list_of_parameter_groups():
    event = torch.Event(device="cpu")
    group = SimpleNamespace(fsdp_params=[], _post_reduce_event=event)
    state = SimpleNamespace(_state_ctx=None, _comm_ctx=None, _fsdp_param_groups=[group])
    assert held_events([state]) == [event]
    assert held_events([SimpleNamespace()]) == []
