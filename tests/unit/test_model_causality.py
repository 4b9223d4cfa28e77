"""Whole decoders leak nothing from the future.

The layer tests (test_ascender_fast, test_ascender_reference, test_connection_layer) check the
pure-torch math with ``causal=True``. The megatron wiring around it ignores ``attention_mask``
(AscenderCoreAttention and ConnectionSelfAttention rely on ``hp.causal`` and on the [s, b, ...]
layout being permuted correctly), and the Hugging Face export re-implements the decoder. So here:
changing every token after position t must leave the logits at positions <= t unchanged to the
last bit, for the megatron model of every architecture, for the pipeline engine's layers (one stage;
tests/distributed/test_model_parity checks TP2 and sequence parallelism, test_pipeline_causality PP2)
and for the HF model; a non-causal layer
smuggled past the config check must be caught by the same comparison; and the config refuses
``causal: false`` for both custom layers.
"""

import pytest
import torch

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.resolve import config_from_dict, derive
from tests.helpers.causality import assert_gradients_causal, make_bidirectional, token_pair
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

VOCAB = 300
SEQ = 24
BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": SEQ}
# omega != 0 so the ASCender biases act; window/globals/alibi so every mask path is used; chunks of 8
ASC = {"d_z": 8, "d_a": 8, "k": 3, "window": 6, "num_global": 1, "chunk_size": 8, "omega_init": 0.5,
       "other_bias": "alibi"}
CONN = {"num_slots": 4, "rank": 4, "max_steps": 2, "causal_chunk_size": 8, "threshold": 0.0}
MODELS = {
    "gpt": {},
    "gpt_learned_pos_gqa_swiglu": {"position_embedding_type": "learned_absolute", "num_query_groups": 2,
                                   "activation": "swiglu"},
    "ascender": {"architecture": "ascender", "ascender": ASC},
    "ascender_gqa": {"architecture": "ascender", "ascender": ASC, "num_query_groups": 2},
    "connection": {"architecture": "connection", "connection": CONN},  # pattern AC
    "mixed_SC": {"architecture": "connection", "layer_pattern": "SC", "ascender": ASC, "connection": CONN},
}
POSITIONS = [5, 13]  # inside the first and the second chunk of 8 (megatron tests: also 16, see MOMENT_STRIDE)


def _build(model_cfg):
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel

    cfg = config_from_dict({"model": {**BASE, **model_cfg}})
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=5)
    model = build_run_model(cfg, derive(cfg, 1, VOCAB))
    model.eval()
    return model


def _token_pair(t: int):
    return token_pair(t, VOCAB, SEQ)


def _megatron_logits(model, tokens):
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)  # [b, s, vocab]


def _assert_causal(logits_fn, t: int):
    tokens, changed = _token_pair(t)
    a, b = logits_fn(tokens), logits_fn(changed)
    assert a.shape[:2] == (2, SEQ)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1]), \
        f"future leak: positions <= {t} changed by {(a[:, : t + 1] - b[:, : t + 1]).abs().max():.3g}"
    assert not torch.equal(a[:, t + 1:], b[:, t + 1:])  # the changed future does matter


@pytest.mark.parametrize("stride", [256, 8])
@pytest.mark.parametrize("t", POSITIONS + [16])
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_model_has_no_future_leak(single_rank_group, monkeypatch, name, t, stride):
    """Stride: ASCender's causal moment states every 256 rows (none inside SEQ) or every 8 (states
    at 8 and 16, t = 16 on a boundary, where a state holding a key after it would leak)."""
    from ascender_dist.models.ascender import fast_moments

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", stride)
    model = _build(MODELS[name])
    _assert_causal(lambda x: _megatron_logits(model, x), t)


def _embedding_forward(model):
    """(embeddings [s, b, h]) -> logits [s, b, vocab]: the model with its embedding output replaced
    by the given tensor, so a gradient can be taken with respect to it (token ids have none)."""
    tokens = _token_pair(0)[0]
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)

    def forward(embeddings):
        handle = model.embedding.register_forward_hook(lambda module, args, out: embeddings)
        try:
            return model(tokens, positions, None).transpose(0, 1)  # [b, s, vocab] -> [s, b, vocab]
        finally:
            handle.remove()

    with torch.no_grad():
        embeddings = model.embedding(input_ids=tokens, position_ids=positions)
    return forward, embeddings


@pytest.mark.parametrize("t", POSITIONS + [16])
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_model_has_no_future_leak_in_gradients(single_rank_group, monkeypatch, name, t):
    """The backward is causal too (ASCender's fast path differentiates by hand): for a loss on the
    logits at <= t, the embeddings after t get exactly zero gradient, and the gradients of the
    embeddings at <= t and of every weight are bit-for-bit unchanged when the embeddings after t
    are rewritten. ASCender's causal moment states every 256 rows are shrunk to every 8 (states at
    8 and 16 of the 24 positions; t = 16 on a boundary)."""
    from ascender_dist.models.ascender import fast_moments

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", 8)
    model = _build(MODELS[name])
    forward, embeddings = _embedding_forward(model)
    assert embeddings.shape == (SEQ, 2, BASE["hidden_size"])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert_gradients_causal(forward, [embeddings], t, dim=0, names=["embeddings"], params=[p for _, p in named],
                            param_names=[n for n, _ in named])  # fmt: skip


@pytest.mark.parametrize("name", ["ascender", "connection"])
def test_the_leak_check_catches_a_bidirectional_layer(single_rank_group, name):
    """The comparison above is not vacuous: with one layer kind made bidirectional it fails."""
    model = _build(MODELS[name])
    assert make_bidirectional(model) > 0
    with pytest.raises(AssertionError, match="future leak: positions <= "):  # the leak, not another assert
        _assert_causal(lambda x: _megatron_logits(model, x), POSITIONS[0])


@pytest.mark.parametrize("section", ["ascender", "connection"])
def test_non_causal_custom_layers_are_refused_at_config_load(section):
    model = {**BASE, **MODELS["mixed_SC"]}
    model[section] = {**model[section], "causal": False}
    with pytest.raises(ConfigError, match=rf"model\.{section}\.causal: must be true"):
        config_from_dict({"model": model})


@pytest.mark.parametrize("t", POSITIONS)
def test_hf_model_has_no_future_leak(t):
    """The Hugging Face decoder (all three layer kinds) is causal too; right padding relies on it."""
    from ascender_dist.hf.configuration_ascender_dist import AscenderDistConfig
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM

    torch.manual_seed(0)
    config = AscenderDistConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=SEQ,
                                layer_pattern="ASC", ascender=ASC, connection=CONN, ascender_impl="fast")
    model = AscenderDistForCausalLM(config).eval()

    def logits(x):
        with torch.no_grad():
            return model(input_ids=x).logits

    _assert_causal(logits, t)


def _build_pipeline(model_cfg):
    """The model as the pipeline engine runs it (deepspeed's PipelineModule of EmbeddingPipe,
    TransformerLayerPipe with attention_mask=None, FinalNormPipe, the tied head), one stage."""
    from ascender_dist.models.pipeline import build_pipeline_module
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel
    from ascender_dist.training.engine import model_layout

    cfg = config_from_dict({"model": {**BASE, **model_cfg}})
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=5)
    module = build_pipeline_module(cfg.model, model_layout(cfg, derive(cfg, 1, VOCAB)), cfg.train.precision, seed=5)
    module.eval()
    return module


@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_layers_have_no_future_leak(single_rank_group, monkeypatch, name):
    """The pipeline's own layer classes (used under pipeline_model_parallel_size > 1) pass no mask:
    they must be causal by themselves, as the GPTModel's are. One module per model for every t:
    each PipelineModule registers process groups that deepspeed never ends."""
    from ascender_dist.models.ascender import fast_moments

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", 8)
    module = _build_pipeline(MODELS[name])

    def logits(tokens):
        with torch.no_grad():
            return module(tokens).transpose(0, 1)  # [s, b, v] -> [b, s, v]

    for t in POSITIONS + [16]:
        _assert_causal(logits, t)


@pytest.mark.parametrize("name", ["ascender", "connection"])
def test_the_pipeline_leak_check_catches_a_bidirectional_layer(single_rank_group, name):
    module = _build_pipeline(MODELS[name])
    assert make_bidirectional(module) > 0

    def logits(tokens):
        with torch.no_grad():
            return module(tokens).transpose(0, 1)

    with pytest.raises(AssertionError, match="future leak: positions <= "):
        _assert_causal(logits, POSITIONS[0])
