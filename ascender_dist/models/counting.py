"""Analytical parameter and FLOP counts (what ``print-config`` reports and MFU is computed from).

FLOPs per token follow Megatron-LM / PaLM: every weight matmul costs 2 FLOPs per parameter per
token forward and 4 backward (6 in all), and attention scores + weighted values cost 2 * 2 * s * h
per layer forward (x3 with backward), counted over the full s x s square like Megatron-LM
(causal masking is not subtracted). Each layer kind adds its own terms through the registry
(norm and bias parameters are counted as matmul parameters: a < 0.1% overcount).
"""

from __future__ import annotations

from dataclasses import dataclass

from ascender_dist.config.resolve import pad_vocab_size
from ascender_dist.config.schema import RunConfig
from ascender_dist.models.registry import expand_layer_pattern, get_layer_kind


@dataclass(frozen=True)
class ModelCounts:
    total_params: int
    embedding_params: int
    non_embedding_params: int
    flops_per_token: float  # training (forward + backward)


def gpt_layer_params(cfg: RunConfig) -> int:
    m = cfg.model
    h = m.hidden_size
    head_dim = h // m.num_attention_heads
    kv = (m.num_query_groups or m.num_attention_heads) * head_dim
    ffn = m.ffn_hidden_size or 4 * h
    bias = 1 if m.add_bias_linear else 0
    attention = h * (h + 2 * kv) + bias * (h + 2 * kv) + h * h + bias * h
    fc1_out = 2 * ffn if m.activation == "swiglu" else ffn
    mlp = h * fc1_out + bias * fc1_out + ffn * h + bias * h
    norms = 2 * (2 * h if m.normalization == "LayerNorm" else h)
    return attention + mlp + norms


def count_model(cfg: RunConfig, vocab_size: int) -> ModelCounts:
    m = cfg.model
    h = m.hidden_size
    vocab = pad_vocab_size(vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    embedding = vocab * h + (m.seq_length * h if m.position_embedding_type == "learned_absolute" else 0)
    output = vocab * h if m.untie_embeddings_and_output_weights else 0
    final_norm = 2 * h if m.normalization == "LayerNorm" else h
    kinds = [get_layer_kind(letter) for letter in expand_layer_pattern(cfg)]
    layers = sum(gpt_layer_params(cfg) + kind.extra_params(cfg) for kind in kinds)
    non_embedding = layers + final_norm
    total = embedding + output + non_embedding
    gpt_layer_forward = 2 * gpt_layer_params(cfg) + 2 * 2 * m.seq_length * h
    lm_head = 2 * vocab * h  # the LM head is a matmul even when tied
    forward = lm_head + sum(gpt_layer_forward + kind.extra_flops(cfg) for kind in kinds)
    return ModelCounts(total, embedding + output, non_embedding, 3.0 * forward)
