"""Tensor-parallel communication that is safe for non-contiguous tensors.

megatron-core's ``reduce_from_tensor_model_parallel_region`` / ``copy_to_...`` all-reduce
``t.contiguous()`` in place and return ``t``: a non-contiguous input (a transposed bmm result, a
permuted gradient) silently comes back UN-reduced (seen: TP=2 logits off by 0.08). These always
reduce into a fresh contiguous tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def all_reduce_tp(t: torch.Tensor) -> torch.Tensor:
    """All-reduce SUM over the TP group into a fresh contiguous tensor (identity at TP=1)."""
    group = _tp_group()
    if dist.get_world_size(group) == 1:
        return t
    out = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum partial results over TP ranks. Backward: identity."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce_tp(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _CopyToTP(torch.autograd.Function):
    """Forward: identity (a replicated tensor enters sharded math). Backward: sum grads over TP."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_tp(grad)


def reduce_from_tp(t: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTP.apply(t)


def copy_to_tp(t: torch.Tensor) -> torch.Tensor:
    return _CopyToTP.apply(t)
