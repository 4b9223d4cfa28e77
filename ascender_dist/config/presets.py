"""The one registry of model sizes.

A preset fixes the transformer shape (layers, width, heads, FFN, context). Layer-kind-specific
hyperparameters (ASCender, Connection) are layered on top by ``ARCHITECTURE_PRESETS`` for every
kind the layer pattern uses (a mixed pattern gets both), so ``debug``/``small``/``medium``/``large``
mean the same backbone for every architecture and runs compare like with like. Shapes follow
GPT-3's table (Brown et al. 2020) for small/medium/large, its 2048-token context included.
"""

from __future__ import annotations

from ascender_dist.config.architectures import get_architecture
from ascender_dist.config.errors import ConfigError

MODEL_PRESETS: dict[str, dict] = {
    # fits a 2-core CPU: the default demo and the tests
    "debug": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128),
    # GPT-3 Small (125M)
    "small": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, seq_length=2048),
    # GPT-3 Medium (350M)
    "medium": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=2048),
    # GPT-3 Large (760M)
    "large": dict(num_layers=24, hidden_size=1536, num_attention_heads=16, ffn_hidden_size=6144, seq_length=2048),
}

# Per-architecture additions, keyed by preset name: {architecture: {preset: {model-field: value}}}.
ARCHITECTURE_PRESETS: dict[str, dict[str, dict]] = {
    "gpt": {"debug": {}, "small": {}, "medium": {}, "large": {}},
    # Paper section 12: k in {8,16,32}, w in {64,128,256}. Its Separation after ~10% of training is a
    # fraction of the run, not of the model: the scaling runs set separation_start_step (make_configs.py).
    "ascender": {
        "debug": {"ascender": {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2, "chunk_size": 64}},
        "small": {"ascender": {"d_z": 32, "d_a": 32, "k": 16, "window": 128, "num_global": 4}},
        "medium": {"ascender": {"d_z": 32, "d_a": 32, "k": 16, "window": 128, "num_global": 4}},
        "large": {"ascender": {"d_z": 48, "d_a": 48, "k": 32, "window": 256, "num_global": 8}},
    },
    # The bilinear term 2 N^2 D r dominates quickly (N=64, D=1536, r=16 would add 200M parameters per
    # Connection layer); rank 4 with 32 slots gives 1.41x / 1.38x / 1.28x the GPT model's parameters at
    # small / medium / large (the scaling runs' budgets are per parameter, so compare per FLOP too).
    "connection": {
        "debug": {"connection": {"num_slots": 8, "rank": 4, "max_steps": 3, "causal_chunk_size": 16}},
        "small": {"connection": {"num_slots": 32, "rank": 4, "max_steps": 4, "causal_chunk_size": 128}},
        "medium": {"connection": {"num_slots": 32, "rank": 4, "max_steps": 4, "causal_chunk_size": 128}},
        "large": {"connection": {"num_slots": 32, "rank": 4, "max_steps": 4, "causal_chunk_size": 256}},
    },
}


def preset_model_fields(preset: str, architecture: str, path: str = "model.preset",
                        layer_pattern: str | None = None) -> dict:
    """Model fields a preset sets (the YAML's own fields are merged over these): the backbone, plus
    the preset fields of every layer kind in ``layer_pattern`` (default: the architecture's own
    pattern), so ``architecture: connection, layer_pattern: SC`` gets ASCender's sizes too."""
    for where, value in ((path, preset), ("model.architecture", architecture)):
        if not isinstance(value, str):  # a YAML list or mapping would be unhashable in the lookups below
            raise ConfigError(where, f"expected str, got {type(value).__name__} {value!r}")
    get_architecture(architecture)  # unknown name -> ConfigError
    if preset not in MODEL_PRESETS:
        raise ConfigError(path, f"unknown preset {preset!r}; known: {', '.join(MODEL_PRESETS)}")
    if architecture not in ARCHITECTURE_PRESETS:
        raise ConfigError("model.architecture", f"no presets for architecture {architecture!r}")
    letters = layer_pattern if isinstance(layer_pattern, str) and layer_pattern else \
        get_architecture(architecture).default_pattern
    fields = dict(MODEL_PRESETS[preset])
    for name in ARCHITECTURE_PRESETS:  # the architecture's own kind, and any other kind the pattern mixes in
        if name == architecture or get_architecture(name).required_letter in letters:
            fields.update(ARCHITECTURE_PRESETS[name][preset])
    return fields
