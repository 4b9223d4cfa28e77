"""The exported (remote-code) model computes the megatron model's function for the settings the
integration test's two trained exports do not reach: learned positions, ALiBi, ASCender with
grouped-query attention and one omega per layer, no linear biases with RMSNorm and an untied head,
the linear connection, per-slot adaptive stops and a mixed S/C/A pattern. Same weights (drawn at
random, then passed through the exporter's own state conversion), logits within float32 rounding."""

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict, derive
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

VOCAB = 100
BASE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "seq_length": 48}
ASC = {"d_z": 4, "d_a": 4, "k": 3, "window": 8, "num_global": 2, "chunk_size": 16}
CONN = {"num_slots": 4, "rank": 4, "max_steps": 3, "causal_chunk_size": 16}
CASES = {
    "gpt learned positions, LayerNorm, swiglu": {"position_embedding_type": "learned_absolute",
                                                 "activation": "swiglu"},
    "ascender GQA, ALiBi, one omega per layer": {
        "architecture": "ascender", "num_attention_heads": 8, "num_query_groups": 4,
        "ascender": {**ASC, "other_bias": "alibi", "share_omega_across_heads": True}},
    "ascender no biases, RMSNorm, untied, learned positions": {
        "architecture": "ascender", "add_bias_linear": False, "normalization": "RMSNorm",
        "untie_embeddings_and_output_weights": True, "position_embedding_type": "learned_absolute",
        "ascender": ASC},
    "connection linear, per-slot stops, pattern SCA": {
        "architecture": "connection", "num_layers": 3, "layer_pattern": "SCA", "ascender": ASC,
        "connection": {**{k: v for k, v in CONN.items() if k != "rank"}, "connection": "linear",
                       "stop_granularity": "slot", "threshold": 0.5}},
}


def _megatron(model: dict):
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel
    from ascender_dist.training.engine import build_run_model

    cfg = config_from_dict({"name": "hf", "model": {**BASE, **model}})
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=0)
    net = build_run_model(cfg, derive(cfg, 1, VOCAB)).eval()
    with torch.no_grad():  # matrices well away from their init scale, so every term moves the logits
        for p in net.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return cfg, net


def _exported(cfg, net, step: int):
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.hf_export import remote_code_config, remote_code_state
    from ascender_dist.training.weights import gather_canonical_state, strip_vocab_padding

    state = strip_vocab_padding(gather_canonical_state(net, cfg), VOCAB)
    tied = not cfg.model.untie_embeddings_and_output_weights
    config = remote_code_config(cfg, {"step": step, "architecture": cfg.model.architecture, "vocab_size": VOCAB},
                                VOCAB, tied)
    hf = AscenderDistForCausalLM(config)
    missing, unexpected = hf.load_state_dict(remote_code_state(state, config), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), (missing, unexpected)
    if tied:
        hf.tie_weights()
    return hf.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_exported_logits_equal_megatron(single_rank_group, name):  # noqa: F811
    from ascender_dist.training.layer_stats import last_training_step, set_training_step

    cfg, net = _megatron(CASES[name])
    step = 3  # past ASCender's Separation warm-up in none of these: the step the weights last ran with
    hf = _exported(cfg, net, step)
    tokens = torch.randint(0, VOCAB, (2, BASE["seq_length"]), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        set_training_step(net, last_training_step(step))
        reference = net(tokens, positions, None)[..., :VOCAB].float()
        logits = hf(tokens).logits.float()
    scale = reference.abs().max().item()
    assert scale > 1.0  # logits that carry signal
    assert (logits - reference).abs().max().item() <= 1e-5 * scale, name
