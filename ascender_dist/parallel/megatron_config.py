"""The one place that translates our RunConfig into megatron-core's TransformerConfig."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascender_dist.config.resolve import Derived
from ascender_dist.config.schema import RunConfig


def params_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


def to_transformer_config(cfg: RunConfig, derived: Derived):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ascender_dist.config.architectures import expand_layer_pattern

    m, p = cfg.model, cfg.parallel
    swiglu = m.activation == "swiglu"
    bf16 = cfg.train.precision == "bf16"
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if p.activation_checkpointing else {}
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=derived.num_query_groups,
        ffn_hidden_size=derived.ffn_hidden_size,
        kv_channels=m.hidden_size // m.num_attention_heads,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        layernorm_epsilon=m.layernorm_epsilon,
        normalization=m.normalization,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        init_method_std=m.init_method_std,
        bf16=bf16,
        params_dtype=params_dtype(cfg),
        pipeline_dtype=params_dtype(cfg),
        # DeepSpeed owns the optimizer and gradient reduction: megatron must not fuse or overlap them
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        # mixed layer kinds (e.g. "SC") cannot be stacked into one [num_layers, ...] tensor per key
        # in dist-checkpointing: give each layer its own keys then
        hetereogenous_dist_checkpoint=len(set(expand_layer_pattern(cfg))) > 1,
        perform_initialization=True,
        **recompute,
    )
