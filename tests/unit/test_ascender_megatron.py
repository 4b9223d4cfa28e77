"""ASCender inside megatron-core: omega = 0 reproduces megatron's own attention; counts match."""

import torch

from ascender_dist.config.resolve import config_from_dict, derive
from ascender_dist.models.counting import count_model
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

VOCAB = 300
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 128, "seq_length": 40}
ASC = {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2, "chunk_size": 16}


def _build(raw):
    from ascender_dist.models.build import build_model
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel

    cfg = config_from_dict(raw)
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=3)
    return cfg, build_model(cfg, derive(cfg, 1, VOCAB))


def _copy_gpt_into_ascender(gpt, asc, cfg):
    """Same weights; the ascender QKV rows per query group are [q | k | v | z | h]."""
    m, hp = cfg.model, cfg.model.ascender
    hn = m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups
    per_group_heads = m.num_attention_heads // groups
    qkv = (per_group_heads + 2) * hn
    asc_params = dict(asc.named_parameters())
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            target = asc_params[name]
            if "linear_qkv" in name:
                src = p.view(groups, qkv, *p.shape[1:])  # [ng, qkv, ...]
                dst = target.view(groups, qkv + per_group_heads * (hp.d_z + hp.d_a), *p.shape[1:])
                dst[:, :qkv].copy_(src)
            else:
                target.copy_(p)
        for name, p in asc.named_parameters():
            if name.endswith("params.omega"):
                p.zero_()


def test_zero_omega_reproduces_megatron_attention(single_rank_group):
    tokens = torch.randint(0, VOCAB, (2, MODEL["seq_length"]), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    cfg_gpt, gpt = _build({"model": MODEL})
    cfg_asc, asc = _build({"model": {**MODEL, "architecture": "ascender", "ascender": ASC}})
    _copy_gpt_into_ascender(gpt, asc, cfg_asc)
    with torch.no_grad():
        expected = gpt(tokens, positions, None)
        got = asc(tokens, positions, None)
    assert (expected - got).abs().max().item() < 1e-5
    # and the biases do act once omega is non-zero (the test above is not vacuous)
    with torch.no_grad():
        for name, p in asc.named_parameters():
            if name.endswith("params.omega"):
                p.fill_(1.0)
        biased = asc(tokens, positions, None)
    assert (expected - biased).abs().max().item() > 1e-3


def test_ascender_param_count_matches_built_model(single_rank_group):
    cfg, model = _build({"model": {**MODEL, "architecture": "ascender", "ascender": ASC}})
    assert count_model(cfg, VOCAB).total_params == sum(p.numel() for p in model.parameters())


def test_per_head_gains_are_not_weight_decayed(single_rank_group):
    from ascender_dist.training.engine import weight_decay_groups

    _, model = _build({"model": {**MODEL, "architecture": "ascender", "ascender": ASC}})
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert not any("core_attention.params" in names[id(p)] for p in decay["params"])
    assert any(names[id(p)].endswith("params.omega") for p in no_decay["params"])
    assert any(names[id(p)].endswith("linear_qkv.weight") for p in decay["params"])
