"""The one place that translates a model section, its layout and the precision into megatron-core's
TransformerConfig (no run config: see :mod:`ascender_dist.config.layout`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascender_dist.config.layout import ModelLayout
from ascender_dist.config.schema import ModelConfig


def params_dtype(precision: str) -> torch.dtype:
    """The parameter dtype of ``train.precision`` ("bf16" or "fp32")."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


class WordTableInit:
    """Initialises the word-embedding table [padded vocab, h] with the random numbers the TP=1 model
    draws for it, whatever the tensor-parallel size.

    The padded vocabulary grows with TP (a multiple of ``make_vocab_size_divisible_by`` x TP), and CPU
    initialisation draws the whole table from the global stream before the transformer layers: a
    larger table left every layer after it with other weights than the same seed gives at TP=1. Here
    only the TP=1 table's rows are drawn (row-major, so the same numbers) and the extra padding rows,
    ids the tokenizer never emits, are zero. Any other table (a learned position table) is drawn as
    ``init`` draws it."""

    def __init__(self, init, drawn_rows: int, table_rows: int):
        self.init, self.drawn_rows, self.table_rows = init, drawn_rows, table_rows

    def __call__(self, weight: torch.Tensor):
        if weight.shape[0] != self.table_rows or self.drawn_rows == self.table_rows:
            return self.init(weight)
        with torch.no_grad():
            self.init(weight[: self.drawn_rows])
            weight[self.drawn_rows:].zero_()
        return weight


def embedding_init(m: ModelConfig, layout: ModelLayout):
    """megatron's embedding initialisation (N(0, init_method_std)), TP-invariant for the word table
    (:class:`WordTableInit`), or megatron's own when a learned position table has the word table's
    row count (the two could not be told apart by shape)."""
    from megatron.core.utils import init_method_normal

    from ascender_dist.config.resolve import pad_vocab_size

    init = init_method_normal(m.init_method_std)
    if m.position_embedding_type == "learned_absolute" and m.seq_length == layout.padded_vocab_size:
        return init
    return WordTableInit(init, pad_vocab_size(layout.vocab_size, m.make_vocab_size_divisible_by, 1),
                         layout.padded_vocab_size)


def to_transformer_config(m: ModelConfig, layout: ModelLayout, precision: str):
    """``precision`` is ``train.precision`` ("bf16" or "fp32")."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ascender_dist.config.architectures import expand_layer_pattern

    swiglu = m.activation == "swiglu"
    bf16 = precision == "bf16"
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if layout.activation_checkpointing else {}
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        kv_channels=m.hidden_size // m.num_attention_heads,
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        sequence_parallel=layout.sequence_parallel,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        layernorm_epsilon=m.layernorm_epsilon,
        normalization=m.normalization,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        init_method_std=m.init_method_std,
        embedding_init_method=embedding_init(m, layout),
        bf16=bf16,
        params_dtype=params_dtype(precision),
        pipeline_dtype=params_dtype(precision),
        # DeepSpeed owns the optimizer and gradient reduction: megatron must not accumulate weight
        # gradients into its own main_grad buffers
        gradient_accumulation_fusion=False,
        # megatron's kernel fusions (bias + activation, masked softmax, persistent LayerNorm, bias +
        # dropout, RoPE; several need apex or TransformerEngine) are code paths no test here runs: off
        # on every device, so a GPU run computes what the CPU tests check (a path no test has run is
        # never reachable from a config). The cost is speed on GPUs.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        # on a GPU too: megatron's GPU initialisation draws each TP shard from a generator seeded by
        # (seed, tp_rank), so a model built at TP=2 started from other weights than at TP=1 (TP ablations
        # compared different initialisations), and it is the path no CPU test runs; the CPU path draws
        # every weight whole and keeps the rank's shard (TP-invariant, tested by the TP parity tests).
        # DeepSpeed's engine moves the module to the GPU.
        use_cpu_initialization=True,
        # mixed layer kinds (e.g. "SC") cannot be stacked into one [num_layers, ...] tensor per key
        # in dist-checkpointing: give each layer its own keys then
        hetereogenous_dist_checkpoint=len(set(expand_layer_pattern(m))) > 1,
        perform_initialization=True,
        **recompute,
    )
