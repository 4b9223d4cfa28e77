"""The one registry of model sizes.

A preset fixes the transformer shape (layers, width, heads, FFN, context). Architecture-specific
hyperparameters (ASCender, Connection) are layered on top by each architecture's own preset table,
so ``debug``/``small``/``medium``/``large`` mean the same backbone for every architecture and runs
compare like with like. Shapes follow GPT-3's table (Brown et al. 2020) for small/medium/large.
"""

from __future__ import annotations

from ascender_dist.config.errors import ConfigError

MODEL_PRESETS: dict[str, dict] = {
    # fits a 2-core CPU: the default demo and the tests
    "debug": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128),
    # GPT-3 Small (125M)
    "small": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, seq_length=1024),
    # GPT-3 Medium (350M)
    "medium": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=2048),
    # GPT-3 Large (760M)
    "large": dict(num_layers=24, hidden_size=1536, num_attention_heads=16, ffn_hidden_size=6144, seq_length=2048),
}

# Per-architecture additions, keyed by preset name: {architecture: {preset: {model-field: value}}}.
ARCHITECTURE_PRESETS: dict[str, dict[str, dict]] = {}


def register_architecture_presets(architecture: str, table: dict[str, dict]) -> None:
    missing = set(MODEL_PRESETS) - set(table)
    if missing:
        raise ValueError(f"architecture {architecture!r} presets lack sizes {sorted(missing)}")
    ARCHITECTURE_PRESETS[architecture] = table


def preset_model_fields(preset: str, architecture: str, path: str = "model.preset") -> dict:
    """Model fields a preset sets for an architecture (the YAML's own fields are merged over these)."""
    from ascender_dist.models.registry import get_architecture

    for where, value in ((path, preset), ("model.architecture", architecture)):
        if not isinstance(value, str):  # a YAML list or mapping would be unhashable in the lookups below
            raise ConfigError(where, f"expected str, got {type(value).__name__} {value!r}")
    get_architecture(architecture)  # loads every architecture's presets; unknown name -> ConfigError
    if preset not in MODEL_PRESETS:
        raise ConfigError(path, f"unknown preset {preset!r}; known: {', '.join(MODEL_PRESETS)}")
    if architecture not in ARCHITECTURE_PRESETS:
        raise ConfigError("model.architecture", f"no presets for architecture {architecture!r}")
    return {**MODEL_PRESETS[preset], **ARCHITECTURE_PRESETS[architecture][preset]}
