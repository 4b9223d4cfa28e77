"""The decoder block spec: one ModuleSpec per layer from ``model.layer_pattern``, for this PP stage."""

from __future__ import annotations

from ascender_dist.config.architectures import expand_layer_pattern
from ascender_dist.config.schema import ModelConfig
from ascender_dist.models.registry import layer_spec


def block_spec(model: ModelConfig, seed: int, transformer_config):
    """The layer specs of this pipeline stage; ``seed`` as in :func:`ascender_dist.models.registry.layer_spec`."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = expand_layer_pattern(model)
    offset = get_transformer_layer_offset(transformer_config)
    count = get_num_layers_to_build(transformer_config)
    specs = [layer_spec(letter, model, seed) for letter in pattern[offset:offset + count]]
    # the final norm is the same norm class every layer uses (megatron's local spec backend)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=specs[0].submodules.input_layernorm)
