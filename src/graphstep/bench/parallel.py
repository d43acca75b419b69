"""The demo GPT under each kind of data and model parallelism, for tests and benchmarks.

Each function takes a GPT on this rank's device (identical on every rank) and returns the
module to train: DDP-wrapped, FSDP2-sharded in place, or tensor-parallel in place.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends.cuda import capture_stream
from ..demo.gpt import GPT

KINDS = ("ddp", "fsdp", "fsdp_keep", "tp")
"""`fsdp`: FSDP2 resharding after forward; `fsdp_keep`: keeping parameters gathered until backward."""
KINDS_2D = ("fsdp_tp",)
"""FSDP2 over the data-parallel dimension of a 2-D mesh, tensor parallel over the other (`parallelize_2d`)."""


def parallelize(model: GPT, kind: str, mesh: object | None = None) -> nn.Module:
    """`model` under `kind` (one of KINDS) over all ranks, or over `mesh` (a 1-D DeviceMesh)."""
    if kind == "ddp":
        return data_parallel(model)
    if kind in ("fsdp", "fsdp_keep"):
        return shard(model, mesh or default_mesh(model), reshard_after_forward=kind == "fsdp")
    if kind == "tp":
        return tensor_parallel(model, mesh or default_mesh(model))
    raise ValueError(f"unknown parallelism {kind!r}; choose one of {', '.join(KINDS)}")


def data_parallel(model: GPT) -> nn.Module:
    """DDP, constructed on graphstep's capture stream: DDP keeps each parameter's gradient
    accumulator for good, and autograd runs it on the stream it was made on; a graph cannot
    capture work on the default stream."""
    if not model.head.weight.is_cuda:
        return nn.parallel.DistributedDataParallel(model)
    device = model.head.weight.device
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    torch.cuda.current_stream(device).wait_stream(stream)
    return ddp


def default_mesh(model: GPT) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    device = model.head.weight.device.type
    return init_device_mesh(device, (torch.distributed.get_world_size(),))


def shard(model: GPT, mesh: object, *, reshard_after_forward: bool) -> GPT:
    """FSDP2: each block its own unit, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def tensor_parallel(model: GPT, mesh: object) -> GPT:
    """Megatron-style: qkv and fc column-wise, proj and fc_out row-wise; every other parameter
    a replicated DTensor, so that clip_grad_norm_ and foreach optimizers see DTensors only.

    Every rank sees the same tokens, so replicated parameters get equal grads with no
    communication; each block's attention and MLP end in one all-reduce.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if model.cfg.n_head % mesh.size():
        raise ValueError(
            f"tensor parallel needs n_head ({model.cfg.n_head}) divisible by {mesh.size()} ranks"
        )
    plan = {
        "qkv": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "fc_out": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, mesh, plan)

    def replicated_inputs(module: nn.Module, inputs: tuple, mesh: object) -> tuple:
        return tuple(DTensor.from_local(t, mesh, [Replicate()]) for t in inputs)

    def local_output(module: nn.Module, output: torch.Tensor, mesh: object) -> torch.Tensor:
        return output.to_local()

    replicated = [model.tok, model.pos, model.ln_f, model.head]
    replicated += [norm for block in model.blocks for norm in (block.ln1, block.ln2)]
    for module in replicated:
        distribute_module(module, mesh, input_fn=replicated_inputs, output_fn=local_output)
    return model


def mesh_2d(device_type: str, tp: int = 2) -> object:
    """A ("dp", "tp") DeviceMesh of every rank: `tp` ranks tensor-parallel (neighbours: on one host
    their all-reduces stay on the closest links), the rest data-parallel."""
    from torch.distributed.device_mesh import init_device_mesh

    size = torch.distributed.get_world_size()
    if size % tp:
        raise ValueError(
            f"a 2-D mesh with {tp}-way tensor parallelism needs a multiple of {tp} ranks, not {size}"
        )
    return init_device_mesh(device_type, (size // tp, tp), mesh_dim_names=("dp", "tp"))


def parallelize_2d(model: GPT, mesh: object) -> GPT:
    """FSDP2 over the mesh's "dp" dimension of a tensor-parallel model over its "tp" dimension."""
    return shard(tensor_parallel(model, mesh["tp"]), mesh["dp"], reshard_after_forward=True)
