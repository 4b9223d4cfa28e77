"""Baseline GPT: megatron-core's own local (non-Transformer-Engine) layer spec."""

from __future__ import annotations

from ascender_dist.models.registry import ArchitectureEntry, register


def gpt_layer_spec(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization=cfg.model.normalization)


def gpt_block_spec(cfg, derived):
    return gpt_layer_spec(cfg)


register(ArchitectureEntry(name="gpt", block_spec=gpt_block_spec))
