"""Baseline GPT: megatron-core's own local (non-Transformer-Engine) layer, layer kind ``A``."""

from __future__ import annotations

from ascender_dist.config.presets import register_architecture_presets
from ascender_dist.models.registry import ArchitectureEntry, LayerKind, register, register_layer_kind


def gpt_layer_spec(cfg, layer_number: int):
    from ascender_dist.models.specs.norm import local_layer_spec

    return local_layer_spec(cfg.model.normalization)


register_layer_kind(LayerKind(letter="A", description="softmax attention", spec=gpt_layer_spec))
register(ArchitectureEntry(name="gpt", default_pattern="A", required_letter="A"))
register_architecture_presets("gpt", {"debug": {}, "small": {}, "medium": {}, "large": {}})
