"""Layer kind ``C`` (Connection layer in place of attention) and ``architecture: connection``
(default pattern ``AC``: attention and Connection layers alternate)."""

from __future__ import annotations

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.presets import register_architecture_presets
from ascender_dist.models.connection import connection_param_count
from ascender_dist.models.registry import ArchitectureEntry, LayerKind, expand_layer_pattern, register, register_layer_kind


def check_connection_hparams(cfg) -> None:
    m = cfg.model
    if "C" not in expand_layer_pattern(cfg):
        return
    m.connection.validate("model.connection", m.hidden_size, cfg.parallel.tensor_model_parallel_size)
    if not m.connection.causal:
        raise ConfigError("model.connection.causal", "must be true: the model is a causal decoder")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", "not supported with Connection layers ('C' in the pattern)")


def attention_params_per_layer(cfg) -> int:
    """QKV + output projection parameters of one softmax-attention block."""
    m = cfg.model
    h = m.hidden_size
    kv = (m.num_query_groups or m.num_attention_heads) * (h // m.num_attention_heads)
    bias = 1 if m.add_bias_linear else 0
    return h * (h + 2 * kv) + bias * (h + 2 * kv) + h * h + bias * h


def connection_extra_layer_params(cfg) -> int:
    """The Connection layer replaces the attention projections (QKV and output)."""
    return connection_param_count(cfg.model.connection, cfg.model.hidden_size) - attention_params_per_layer(cfg)


def connection_extra_layer_flops(cfg) -> float:
    """Forward FLOPs per token: six D x D projections, token<->slot scores and mixing (4 N D),
    own-chunk causal mixing (2 c (N + D)), and max_steps reasoning steps on one prefix state per
    chunk, amortised over the chunk's c tokens (an upper bound: converged samples stop early).
    Minus the attention layer it replaces (QKV + output projections and the s x s scores)."""
    m, hp = cfg.model, cfg.model.connection
    d, n, c = m.hidden_size, hp.num_slots, min(hp.causal_chunk_size, m.seq_length)
    step = 2 * n * n * d if hp.connection == "linear" else 2 * 2 * n * (n - 1) * d * hp.rank
    connection = 2 * 6 * d * d + 4 * 2 * n * d + 2 * 2 * c * (n + d) + hp.max_steps * step / c
    attention = 2 * attention_params_per_layer(cfg) + 2 * 2 * m.seq_length * d
    return connection - attention


def connection_spec(cfg, layer_number: int):
    from ascender_dist.models.specs.connection import connection_layer_spec

    return connection_layer_spec(cfg.model.connection, cfg.model.normalization, init_seed=cfg.train.seed)


register_layer_kind(LayerKind(letter="C", description="Connection layer", spec=connection_spec,
                              extra_params=connection_extra_layer_params, extra_flops=connection_extra_layer_flops))
register(ArchitectureEntry(name="connection", default_pattern="AC", required_letter="C",
                           checks=[check_connection_hparams]))

# The bilinear term 2 N^2 D r dominates quickly (N=64, D=1536, r=16 would add 200M parameters per
# Connection layer); rank 4 with 32 slots keeps each size within ~1.3x of the GPT backbone.
register_architecture_presets("connection", {
    "debug": {"connection": {"num_slots": 8, "rank": 4, "max_steps": 3, "causal_chunk_size": 16}},
    "small": {"connection": {"num_slots": 32, "rank": 4, "max_steps": 4, "causal_chunk_size": 128}},
    "medium": {"connection": {"num_slots": 32, "rank": 4, "max_steps": 4, "causal_chunk_size": 128}},
    "large": {"connection": {"num_slots": 32, "rank": 4, "max_steps": 4, "causal_chunk_size": 256}},
})
