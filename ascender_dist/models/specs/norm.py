"""Sequence parallelism under DeepSpeed: the norm every layer kind uses, and the gradient fix.

Under sequence parallelism each TP rank applies the norms and the row-parallel biases to a
different slice of the sequence, so those parameters' gradients are partial sums that must be
added up over the TP group. megatron tags them ``sequence_parallel=True`` and sums them in
``finalize_model_grads``, which DeepSpeed never calls. :func:`reduce_sequence_parallel_grads`
registers a gradient hook on every tagged parameter that all-reduces it over TP as it is produced,
before DeepSpeed's accumulation hooks see it (:func:`sum_grad_over_tp`, also used by ASCender's
omega when it is shared across heads). megatron's local ``WrappedTorchNorm`` refuses
sequence parallelism outright; :class:`TPSafeNorm` is the same torch norm, tagged.
"""

from __future__ import annotations

import torch

from ascender_dist.parallel.mappings import all_reduce_tp


class TPSafeNorm:
    """Factory with megatron's norm-module signature: ``build_module(spec, config=, hidden_size=, eps=)``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True  # megatron's tag: reduced by reduce_sequence_parallel_grads
        return norm


def sum_grad_over_tp(param: torch.nn.Parameter) -> bool:
    """Make ``param``'s gradient the sum over the TP group as it is produced (a hook that runs before
    DeepSpeed's accumulation hooks). For a parameter replicated on every TP rank whose gradient is a
    partial sum per rank (sequence-parallel norms, ASCender's shared omega). False if already hooked."""
    if getattr(param, "_tp_grad_hooked", False):
        return False
    param.register_hook(all_reduce_tp)
    param._tp_grad_hooked = True
    return True


def reduce_sequence_parallel_grads(model: torch.nn.Module) -> int:
    """Hook every ``sequence_parallel``-tagged parameter; returns how many were hooked."""
    hooked = 0
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and sum_grad_over_tp(param):
            hooked += 1
    return hooked


def local_layer_spec(normalization: str):
    """megatron's local (non-Transformer-Engine) GPT layer spec with the TP-safe norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=normalization)
    spec.submodules.input_layernorm = TPSafeNorm
    spec.submodules.pre_mlp_layernorm = TPSafeNorm
    return spec
