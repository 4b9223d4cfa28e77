"""Turn tensor-parallel shards back into full tensors (and full tensors into shards).

megatron-core marks every sharded parameter with ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``. A stride > 1 (gated MLP ``linear_fc1``: [gate | up] per rank) means each rank
holds ``stride`` interleaved blocks, so a plain concatenation would scramble the halves.
Used by the TP parity tests and by checkpoint consolidation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_partition(param: torch.Tensor) -> tuple[bool, int, int]:
    """(is_sharded, partition_dim, partition_stride) of a megatron parameter."""
    sharded = bool(getattr(param, "tensor_model_parallel", False))
    return sharded, int(getattr(param, "partition_dim", -1)), int(getattr(param, "partition_stride", 1))


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`split_full`: rank-ordered shards -> the full tensor."""
    if stride == 1:
        return torch.cat(shards, dim=dim)
    blocks = [s.chunk(stride, dim=dim) for s in shards]  # [tp][stride]
    return torch.cat([blocks[r][i] for i in range(stride) for r in range(len(shards))], dim=dim)


def split_full(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, stride: int = 1) -> torch.Tensor:
    """The shard rank ``tp_rank`` holds of ``full`` (megatron's layout, stride-aware)."""
    if stride == 1:
        return full.chunk(tp_size, dim=dim)[tp_rank].clone()
    pieces = full.chunk(stride * tp_size, dim=dim)  # ordered [stride][tp]
    return torch.cat([pieces[i * tp_size + tp_rank] for i in range(stride)], dim=dim).clone()


def gather_tp_tensor(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``local`` (a parameter or its gradient) over the TP group into the full tensor."""
    sharded, dim, stride = tp_partition(param)
    world = dist.get_world_size(group)
    if not sharded or world == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return merge_shards(parts, dim, stride)


def gather_full_state(model: torch.nn.Module, group, grads: bool = False) -> dict[str, torch.Tensor]:
    """name -> full (unsharded) parameter, or its gradient with ``grads=True``. Collective over ``group``."""
    out = {}
    for name, param in model.named_parameters():
        local = param.grad if grads else param.data
        if local is None:
            continue
        out[name] = gather_tp_tensor(local, param, group)
    return out


@torch.no_grad()
def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> None:
    """Copy full tensors into a (possibly TP-sharded) model, taking this rank's shard of each."""
    for name, param in model.named_parameters():
        if name not in full:
            raise KeyError(f"parameter {name} missing from the full state")
        sharded, dim, stride = tp_partition(param)
        value = split_full(full[name], dim, tp_size, tp_rank, stride) if sharded and tp_size > 1 else full[name]
        if value.shape != param.shape:
            raise ValueError(f"{name}: shard shape {tuple(value.shape)} != parameter shape {tuple(param.shape)}")
        param.copy_(value)
