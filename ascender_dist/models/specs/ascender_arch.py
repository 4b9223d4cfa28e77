"""Layer kind ``S`` (ASCender attention) and ``architecture: ascender`` (every layer ``S``)."""

from __future__ import annotations

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.presets import register_architecture_presets
from ascender_dist.models.registry import ArchitectureEntry, LayerKind, expand_layer_pattern, register, register_layer_kind


def check_ascender_hparams(cfg) -> None:
    m = cfg.model
    if "S" not in expand_layer_pattern(cfg):
        return
    m.ascender.validate("model.ascender", m.hidden_size // m.num_attention_heads)
    if not m.ascender.causal:
        raise ConfigError("model.ascender.causal", "must be true: the model is a causal decoder (a bidirectional "
                          "ASCender would let every position read the tokens it must predict)")
    if m.attention_dropout:
        raise ConfigError("model.attention_dropout", "ASCender attention has no attention dropout; set 0.0")


def ascender_extra_layer_params(cfg) -> int:
    """U and P rows in the fused QKV projection (+ their biases) and the per-head learned tensors
    (omega: 3 per head, or 3 per layer when shared across heads)."""
    m, hp = cfg.model, cfg.model.ascender
    extra_out = m.num_attention_heads * (hp.d_z + hp.d_a)
    per_head = (0 if hp.share_omega_across_heads else 3) + (3 if hp.trainable_lambdas else 0) \
        + (3 if hp.trainable_delta_kappa_temp else 0)
    shared = 3 if hp.share_omega_across_heads else 0  # one omega for the whole layer
    return (m.hidden_size * extra_out + (extra_out if m.add_bias_linear else 0)
            + m.num_attention_heads * per_head + shared)


def ascender_extra_layer_flops(cfg) -> float:
    """Forward FLOPs per token per layer on top of softmax attention (documented in docs/ascender.md):
    U/P projections; the folded Alignment+Cohesion dot product widens each score by d + d_z + 1
    channels over the s keys; Separation's per-pair kernel on d_z + d_a dims; neighbourhood
    search over the window (or all keys when window == 0): affinities on d_a dims, or base scores
    on head_dim dims when the neighbours are reused from them (neighbour_source)."""
    m, hp = cfg.model, cfg.model.ascender
    heads, s, head_dim = m.num_attention_heads, m.seq_length, m.hidden_size // m.num_attention_heads
    projections = 2 * m.hidden_size * heads * (hp.d_z + hp.d_a)
    folded = 2 * s * heads * (head_dim + hp.d_z + 1) if (hp.use_align or hp.use_coh) else 0
    separation = 2 * s * heads * (hp.d_z + hp.d_a) if hp.use_sep else 0
    search_dim = hp.d_a if hp.neighbour_source == "affinity" else head_dim
    neighbours = 2 * heads * search_dim * ((2 * hp.window + hp.num_global) if hp.window else s)
    return projections + folded + separation + neighbours


def ascender_spec(cfg, layer_number: int):
    from ascender_dist.models.specs.ascender import ascender_layer_spec

    return ascender_layer_spec(cfg.model.ascender, cfg.model.normalization)


register_layer_kind(LayerKind(letter="S", description="ASCender attention", spec=ascender_spec,
                              extra_params=ascender_extra_layer_params, extra_flops=ascender_extra_layer_flops))
register(ArchitectureEntry(name="ascender", default_pattern="S", required_letter="S",
                           checks=[check_ascender_hparams]))

# Paper section 12: k in {8,16,32}, w in {64,128,256}, Separation after ~10% of training.
register_architecture_presets("ascender", {
    "debug": {"ascender": {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2, "chunk_size": 64}},
    "small": {"ascender": {"d_z": 32, "d_a": 32, "k": 16, "window": 128, "num_global": 4}},
    "medium": {"ascender": {"d_z": 32, "d_a": 32, "k": 16, "window": 128, "num_global": 4}},
    "large": {"ascender": {"d_z": 48, "d_a": 48, "k": 32, "window": 256, "num_global": 8}},
})
