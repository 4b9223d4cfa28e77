"""Analytical parameter and FLOP counts (what ``print-config`` reports and MFU is computed from).

FLOPs per token follow Megatron-LM / PaLM: every weight matmul costs 2 FLOPs per parameter per
token forward and 4 backward (6 in all), and attention scores + weighted values cost 2 * 2 * s * h
per layer forward (x3 with backward), counted over the full s x s square like Megatron-LM
(causal masking is not subtracted). Each layer kind's terms beyond a GPT layer are here too, so
every parameter and FLOP formula of the project lives in this one file (norm and bias parameters
are counted as matmul parameters: a < 0.1% overcount).
"""

from __future__ import annotations

from dataclasses import dataclass

from ascender_dist.config.architectures import expand_layer_pattern
from ascender_dist.config.resolve import pad_vocab_size
from ascender_dist.config.schema import ModelConfig


@dataclass(frozen=True)
class ModelCounts:
    total_params: int
    embedding_params: int
    non_embedding_params: int
    flops_per_token: float  # training (forward + backward)


def attention_params(m: ModelConfig) -> int:
    """QKV + output projection parameters (and biases) of one softmax-attention block."""
    h = m.hidden_size
    kv = (m.num_query_groups or m.num_attention_heads) * (h // m.num_attention_heads)
    bias = 1 if m.add_bias_linear else 0
    return h * (h + 2 * kv) + bias * (h + 2 * kv) + h * h + bias * h


def attention_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of one softmax-attention block: its projections, then scores and
    weighted values over the full s x s square (2 * 2 * s * h)."""
    return 2 * attention_params(m) + 2 * 2 * m.seq_length * m.hidden_size


def connection_param_count(hp, hidden_size: int) -> int:
    """Trainable parameters of one unsharded layer, equal to ``sum(p.numel())`` at TP=1.

    * six projections, D x D each (compression q/k/v, expansion q/k/v): ``6 * D^2``;
    * linear connection: ``N^2`` (C includes its diagonal, as in the seed);
    * bilinear connection: ``2 * N^2 * D * r``. The diagonal pairs (i == j) are stored in the
      stacked [N, N, D, r] / [N, N, r, D] weights but masked to zero in use, so they are counted
      here (this matches the stored weights and the optimizer state); the effective count is
      ``2 * N * (N - 1) * D * r``.
    The fixed slots are a buffer, not a parameter. Under TP each rank holds ``1/tp`` of the six
    projections and of the bilinear weights; the linear C is replicated.
    """
    d, n, r = hidden_size, hp.num_slots, hp.rank
    projections = 6 * d * d
    if hp.connection == "linear":
        return projections + n * n
    return projections + 2 * n * n * d * r


def gpt_layer_params(m: ModelConfig) -> int:
    h = m.hidden_size
    ffn = m.ffn_hidden_size or 4 * h
    bias = 1 if m.add_bias_linear else 0
    fc1_out = 2 * ffn if m.activation == "swiglu" else ffn
    mlp = h * fc1_out + bias * fc1_out + ffn * h + bias * h
    norms = 2 * (2 * h if m.normalization == "LayerNorm" else h)
    return attention_params(m) + mlp + norms


def ascender_extra_layer_params(m: ModelConfig) -> int:
    """U and P rows in the fused QKV projection (+ their biases) and the per-head learned tensors
    (omega: 3 per head, or 3 per layer when shared across heads)."""
    hp = m.ascender
    extra_out = m.num_attention_heads * (hp.d_z + hp.d_a)
    per_head = (0 if hp.share_omega_across_heads else 3) + (3 if hp.trainable_lambdas else 0) \
        + (3 if hp.trainable_delta_kappa_temp else 0)
    shared = 3 if hp.share_omega_across_heads else 0  # one omega for the whole layer
    return (m.hidden_size * extra_out + (extra_out if m.add_bias_linear else 0)
            + m.num_attention_heads * per_head + shared)


def ascender_pair_macs(hp, head_dim: int) -> int:
    """Multiply-adds per (query, key) pair that ASCender's fast path runs in GEMMs on top of softmax
    attention's q.k and A v (docs/ascender.md, "Cost"): the folded scores (Alignment's khat, head_dim
    wide; Cohesion's Zr = [z, 1, |z|^2 term], d_z + 2 wide), and when Separation or Cohesion is on
    the kernel tile's distance on Zr, Cohesion's moments w Zr and Separation's affinity on
    Hr = [h, 1, delta term] (d_a + 2 wide)."""
    zr, hr = hp.d_z + 2, hp.d_a + 2
    folded = (head_dim if hp.use_align else 0) + (zr if hp.use_coh else 0)
    kernel = zr if (hp.use_sep or hp.use_coh) else 0
    return folded + kernel + (zr if hp.use_coh else 0) + (hr if hp.use_sep else 0)


def ascender_extra_layer_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token per layer on top of softmax attention: the U/P rows of the QKV
    projection, the pair GEMMs over the s keys (ascender_pair_macs), and the neighbourhood search
    over the window (or all keys when window == 0): affinities on d_a dims, or base scores on
    head_dim dims when the neighbours are reused from them (neighbour_source). Leaves out the
    per-token moment statistics (O(e^2) per token and head, e = head_dim or d_z + 2: a few % at
    s = 1024, less at longer s)."""
    hp = m.ascender
    heads, s, head_dim = m.num_attention_heads, m.seq_length, m.hidden_size // m.num_attention_heads
    projections = 2 * m.hidden_size * heads * (hp.d_z + hp.d_a)
    pairs = 2 * s * heads * ascender_pair_macs(hp, head_dim)
    search_dim = hp.d_a if hp.neighbour_source == "affinity" else head_dim
    neighbours = 2 * heads * search_dim * ((2 * hp.window + hp.num_global) if hp.window else s)
    return projections + pairs + neighbours


def connection_extra_layer_params(m: ModelConfig) -> int:
    """The Connection layer replaces the attention projections (QKV and output)."""
    return connection_param_count(m.connection, m.hidden_size) - attention_params(m)


def connection_layer_flops(hp, d: int, seq_length: int) -> float:
    """Forward FLOPs per token of one Connection layer (causal chunked form, TP=1), as it runs:
    four D x D token projections (compression query and values, expansion query, the own-chunk
    values' output), the token<->slot scores and mixing (8 N D), the own-chunk causal mixing
    (2 c (N + D)), and per chunk of c tokens the keys and values of the reasoned state (4 N D^2)
    and max_steps reasoning steps (2 N^2 D linear, 4 N^2 D r bilinear; the masked i == j pairs
    run too), amortised over the chunk's tokens (an upper bound: converged samples stop early).
    A sequence that is not a whole number of chunks is padded to one and the padding runs too.
    Leaves out the slot keys, computed once per forward (2 N D^2 per batch)."""
    n, c = hp.num_slots, min(hp.causal_chunk_size, seq_length)
    step = 2 * n * n * d if hp.connection == "linear" else 4 * n * n * d * hp.rank
    per_chunk = 4 * n * d * d + hp.max_steps * step
    per_token = 2 * 4 * d * d + 8 * n * d + 2 * c * (n + d) + per_chunk / c
    padded = -(-seq_length // c) * c
    return per_token if padded == seq_length else per_token * padded / seq_length


def connection_extra_layer_flops(m: ModelConfig) -> float:
    """The Connection layer's forward FLOPs per token minus the attention layer it replaces (QKV
    and output projections and the s x s scores)."""
    return connection_layer_flops(m.connection, m.hidden_size, m.seq_length) - attention_flops(m)


# per layer-kind letter (see models.registry): parameters and forward FLOPs per token beyond a GPT
# layer of the same width (``A``, megatron's own attention layer, is that GPT layer)
EXTRA_PARAMS = {"A": lambda m: 0, "S": ascender_extra_layer_params, "C": connection_extra_layer_params}
EXTRA_FLOPS = {"A": lambda m: 0.0, "S": ascender_extra_layer_flops, "C": connection_extra_layer_flops}


def layer_params(m: ModelConfig, letter: str) -> int:
    return gpt_layer_params(m) + EXTRA_PARAMS[letter](m)


def mixing_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs per token of the token-mixing blocks (attention, ASCender or Connection) of all layers."""
    return float(sum(attention_flops(m) + EXTRA_FLOPS[letter](m) for letter in expand_layer_pattern(m)))


def count_model(m: ModelConfig, vocab_size: int, tensor_parallel: int) -> ModelCounts:
    """Counts of the model section ``m`` with the tokenizer's ``vocab_size`` ids, padded as a run
    with ``tensor_parallel`` TP ranks pads them (:func:`ascender_dist.config.resolve.pad_vocab_size`)."""
    h = m.hidden_size
    vocab = pad_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tensor_parallel)
    embedding = vocab * h + (m.seq_length * h if m.position_embedding_type == "learned_absolute" else 0)
    output = vocab * h if m.untie_embeddings_and_output_weights else 0
    final_norm = 2 * h if m.normalization == "LayerNorm" else h
    letters = expand_layer_pattern(m)
    layers = sum(layer_params(m, letter) for letter in letters)
    non_embedding = layers + final_norm
    total = embedding + output + non_embedding
    gpt_layer_forward = 2 * gpt_layer_params(m) + 2 * 2 * m.seq_length * h
    lm_head = 2 * vocab * h  # the LM head is a matmul even when tied
    forward = lm_head + sum(gpt_layer_forward + EXTRA_FLOPS[letter](m) for letter in letters)
    return ModelCounts(total, embedding + output, non_embedding, 3.0 * forward)
