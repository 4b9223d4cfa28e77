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
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel

    cfg = config_from_dict(raw)
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=3)
    return cfg, build_run_model(cfg, derive(cfg, 1, VOCAB))


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
    assert count_model(cfg.model, VOCAB, 1).total_params == sum(p.numel() for p in model.parameters())


def test_per_head_gains_are_not_weight_decayed(single_rank_group):
    from ascender_dist.training.engine import weight_decay_groups

    _, model = _build({"model": {**MODEL, "architecture": "ascender", "ascender": ASC}})
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert not any("core_attention.params" in names[id(p)] for p in decay["params"])
    assert any(names[id(p)].endswith("params.omega") for p in no_decay["params"])
    assert any(names[id(p)].endswith("linear_qkv.weight") for p in decay["params"])
    # the whole partition: matrices decay; norms' weights, biases and other 1-D parameters and the tagged
    # gains do not (a lost `ndim < 2` rule put every layernorm weight into the decayed group unnoticed)
    want_no_decay = {n for n, p in model.named_parameters()
                     if p.ndim < 2 or n.endswith(".bias") or getattr(p, "no_weight_decay", False)}
    assert {names[id(p)] for p in no_decay["params"]} == want_no_decay
    assert {names[id(p)] for p in decay["params"]} == {n for n, _ in model.named_parameters()} - want_no_decay
    assert {n for n in want_no_decay if "layernorm.weight" in n} and all(
        p.ndim >= 2 and not n.endswith(".bias") and "layernorm" not in n for n, p in
        ((names[id(p)], p) for p in decay["params"]))


def test_shared_omega_in_megatron_counts_no_decay_and_replicated(single_rank_group):
    """share_omega_across_heads: one [1, 3] omega per layer, counted as 3, not weight decayed, not
    tagged as tensor-parallel (replicated) and with its gradient summed over the TP group."""
    from ascender_dist.training.engine import weight_decay_groups

    raw = {"model": {**MODEL, "architecture": "ascender", "ascender": {**ASC, "share_omega_across_heads": True}}}
    cfg, model = _build(raw)
    shared = {n: p for n, p in model.named_parameters() if n.endswith("params.omega_shared")}
    assert len(shared) == MODEL["num_layers"] and not any(n.endswith("params.omega") for n, _ in model.named_parameters())
    for param in shared.values():
        assert param.shape == (1, 3)
        assert not getattr(param, "tensor_model_parallel", False) and getattr(param, "_tp_grad_hooked", False)
    delta = next(p for n, p in model.named_parameters() if n.endswith("params.delta"))
    assert delta.tensor_model_parallel and delta.partition_dim == 0  # the rest stays per head
    assert count_model(cfg.model, VOCAB, 1).total_params == sum(p.numel() for p in model.parameters())
    per_head_cfg, _ = _build({"model": {**MODEL, "architecture": "ascender", "ascender": ASC}})
    heads, layers = MODEL["num_attention_heads"], MODEL["num_layers"]
    assert count_model(per_head_cfg.model, VOCAB, 1).total_params - count_model(cfg.model, VOCAB, 1).total_params == layers * 3 * (heads - 1)
    _, no_decay = weight_decay_groups(model, 0.1)
    assert {id(p) for p in shared.values()} <= {id(p) for p in no_decay["params"]}
    # gradients reach it through the whole model; dist-checkpointing saves [1, 3] per layer (the
    # TP=2 -> TP=1 reshard is in tests/distributed/test_model_parity.py)
    tokens = torch.randint(0, VOCAB, (2, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(MODEL["seq_length"]).unsqueeze(0).expand(2, -1)
    model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.values())
    sharded = model.sharded_state_dict()
    key = next(k for k in sharded if k.endswith("params.omega_shared"))
    assert sharded[key].global_shape == (layers, 1, 3)  # [layers (stacked by megatron), 1, 3]


def test_megatron_wiring_matches_the_float64_reference_with_the_biases_on(single_rank_group):
    """With omega != 0, grouped-query attention (4 heads, 2 groups) and RoPE, layer 0's core
    attention output equals reference_attention in float64 on q, k, v, z, h split by hand from its
    QKV projection as documented: [q | k | v | z | h] per query group, RoPE on q and k only, query
    head i reading group i // (heads / groups). (omega = 0 above hides z and h entirely.)"""
    import copy

    from ascender_dist.models.ascender import ascender_attention

    cfg, asc = _build({"model": {**MODEL, "architecture": "ascender", "ascender": ASC}})
    with torch.no_grad():
        for name, p in asc.named_parameters():
            if name.endswith("params.omega"):
                p.copy_(0.5 + torch.rand(p.shape, generator=torch.Generator().manual_seed(1)))
    attention = asc.decoder.layers[0].self_attention
    seen = {}

    def keep(name, pick):
        def hook(module, inputs, output):  # returns None: the output is left as it is
            seen[name] = pick(output).detach()
        return hook

    attention.linear_qkv.register_forward_hook(keep("mixed", lambda out: out[0]))  # (output, bias)
    attention.core_attention.register_forward_hook(keep("out", lambda out: out))
    # ten token values: a repeated token has the same h at layer 0, so the affinities tie exactly, and
    # both paths must pick the same neighbours among the ties (neighbour_rule)
    tokens = torch.randint(0, 10, (2, MODEL["seq_length"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        asc(tokens, torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens), None)

    m, hp = cfg.model, cfg.model.ascender
    heads, groups = m.num_attention_heads, m.num_query_groups
    hn, per = m.hidden_size // heads, heads // groups
    s, b = seen["mixed"].shape[:2]
    mixed = seen["mixed"].double().view(s, b, groups, -1)  # [s, b, ng, per_group]
    sizes = [per * hn, hn, hn, per * hp.d_z, per * hp.d_a]
    q, k, v, z, h = torch.split(mixed, sizes, dim=-1)
    q = q.reshape(s, b, heads, hn)  # [s, b, np, hn]
    z, h = z.reshape(s, b, heads, hp.d_z), h.reshape(s, b, heads, hp.d_a)
    inv_freq = 1.0 / m.rotary_base ** (torch.arange(0, hn, 2, dtype=torch.float64) / hn)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq  # [s, hn / 2]
    angle = torch.cat([angle, angle], -1)[:, None, None, :]  # [s, 1, 1, hn]

    def rope(t):  # rotate-half RoPE, megatron's default layout
        return t * angle.cos() + torch.cat([-t[..., hn // 2:], t[..., : hn // 2]], -1) * angle.sin()

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)  # [s, b, np, hn]
    to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731  [s, b, np, d] -> [b, np, s, d]
    params = copy.deepcopy(attention.core_attention.params).double()
    out = ascender_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), to_bhsd(z), to_bhsd(h), params, hp, step=0,
                             impl="reference")
    expected = out.permute(2, 0, 1, 3).reshape(s, b, heads * hn)  # [s, b, np * hn]
    error = (seen["out"].double() - expected).abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), error
    # not vacuous: the same split with z and h swapped between heads gives another output
    out_swapped = ascender_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), to_bhsd(z.roll(1, dims=2)), to_bhsd(h),
                                     params, hp, step=0, impl="reference")
    assert (out_swapped - out).abs().max().item() > 1e-3
