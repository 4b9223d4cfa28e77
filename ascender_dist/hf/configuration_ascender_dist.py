"""Hugging Face configuration of an ascender-dist decoder (gpt, ascender, connection or a mix).

This file is copied into every remote-code export (``ascender-dist export-hf``) and loaded by
``AutoConfig.from_pretrained(dir, trust_remote_code=True)``; it imports only ``transformers``.
Field names follow our YAML config (``model.*``) so the mapping is one to one; the Hugging Face
standard names (``num_hidden_layers``, ``max_position_embeddings``, ...) are the attributes that
``transformers`` and lm-evaluation-harness read.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class AscenderDistConfig(PretrainedConfig):
    """One letter per layer in ``layer_pattern``: ``A`` softmax attention (RoPE), ``S`` ASCender
    attention, ``C`` Connection layer. ``ascender`` / ``connection`` hold the hyper-parameter
    dataclasses of those layers as plain dicts (``AscenderHParams`` / ``ConnectionHParams`` fields).
    """

    model_type = "ascender_dist"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_query_groups: int | None = None,
        ffn_hidden_size: int | None = None,
        max_position_embeddings: int = 128,
        layer_pattern: str = "A",
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        add_bias_linear: bool = True,
        layernorm_epsilon: float = 1e-5,
        position_embedding_type: str = "rope",
        rotary_base: float = 10000.0,
        ascender: dict | None = None,
        connection: dict | None = None,
        ascender_step: int = 0,
        ascender_impl: str = "auto",
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 2,
        eos_token_id: int | None = 3,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_query_groups = num_query_groups or num_attention_heads
        self.ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        # one letter per layer (a shorter pattern is repeated, as model.layer_pattern in training)
        self.layer_pattern = (layer_pattern * (num_hidden_layers // max(1, len(layer_pattern)) + 1))[:num_hidden_layers]
        self.normalization = normalization
        self.activation = activation
        self.add_bias_linear = add_bias_linear
        self.layernorm_epsilon = layernorm_epsilon
        self.position_embedding_type = position_embedding_type
        self.rotary_base = rotary_base
        self.ascender = dict(ascender or {})
        self.connection = dict(connection or {})
        # the optimizer step the weights were saved at: ASCender's Separation (and aux losses) are
        # on from their warm-up step, so inference reproduces the model as it was trained last
        self.ascender_step = ascender_step
        self.ascender_impl = ascender_impl  # "auto": Triton kernels on CUDA, chunked fast path on CPU (models/ascender/attention.py)
        self.initializer_range = initializer_range
        self.use_cache = False  # no KV cache: every forward recomputes the whole prefix
        super().__init__(tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
