"""The analytical parameter count print-config reports equals the real megatron model's count."""

import pytest

from ascender_dist.config.resolve import config_from_dict, derive
from ascender_dist.models.counting import count_model
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

VOCAB = 1000

CASES = {
    "debug": {"preset": "debug"},
    "swiglu_rms_gqa_nobias": {"preset": "debug", "activation": "swiglu", "normalization": "RMSNorm",
                              "num_query_groups": 2, "add_bias_linear": False},
    "learned_pos_untied": {"preset": "debug", "position_embedding_type": "learned_absolute",
                           "untie_embeddings_and_output_weights": True},
    "connection_bilinear": {"preset": "debug", "architecture": "connection"},
    "connection_linear_gqa": {"preset": "debug", "architecture": "connection", "num_query_groups": 2,
                              "connection": {"connection": "linear"}},
    "mixed_ascender_connection": {"preset": "debug", "architecture": "connection", "layer_pattern": "SC",
                                  "ascender": {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2}},
    "ascender_shared_omega_trainable_lambdas": {
        "preset": "debug", "architecture": "ascender",
        "ascender": {"share_omega_across_heads": True, "trainable_lambdas": True}},
}


@pytest.mark.parametrize("name", CASES)
def test_param_count_matches_built_model(single_rank_group, name):
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel

    cfg = config_from_dict({"model": CASES[name]})
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=1)
    model = build_run_model(cfg, derive(cfg, 1, VOCAB))
    assert count_model(cfg.model, VOCAB, 1).total_params == sum(p.numel() for p in model.parameters())


def test_gpt3_small_shape_is_about_125m():
    cfg = config_from_dict({"model": {"preset": "small", "position_embedding_type": "learned_absolute"}})
    counts = count_model(cfg.model, 50257, 1)
    # GPT-3 Small, 125M with tied embeddings: 12 layers, the vocabulary padded to 50304, 2048 positions, final norm
    assert counts.total_params == 12 * 7_087_872 + 50304 * 768 + 2048 * 768 + 2 * 768 == 125_262_336
    # 6 * N + attention term at the 2048-token context, N counted with the (tied) LM head as a matmul
    assert counts.flops_per_token == pytest.approx(
        6 * (12 * 7_087_872 + 50304 * 768) + 3 * 12 * 4 * 2048 * 768, rel=1e-3)


@pytest.mark.parametrize("kind, rank", [("linear", 4), ("bilinear", 4), ("bilinear", 8)])
def test_connection_flops_count_is_what_the_layer_runs(kind, rank):
    """The analytic forward FLOPs per token of a Connection layer equal torch's count of its matmuls
    (every step run: threshold 0), up to the slot keys computed once per forward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ascender_dist.models.connection import ConnectionHParams, ConnectionLayer
    from ascender_dist.models.counting import connection_layer_flops

    d, b = 32, 2
    for s, chunk in ((64, 16), (65, 16), (100, 64)):  # 65, 100: padded to whole chunks, which run too
        hp = ConnectionHParams(num_slots=6, connection=kind, rank=rank, max_steps=3, threshold=0.0,
                               causal_chunk_size=chunk)
        layer = ConnectionLayer(hp, d)
        x = torch.randn(s, b, d)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            layer(x)
        slot_keys = 2 * hp.num_slots * d * d  # once per forward, not per token
        measured = (counter.get_total_flops() - slot_keys) / (b * s)
        assert measured == pytest.approx(connection_layer_flops(hp, d, s), rel=1e-9), (s, chunk)


class GemmFlops:
    """2 m k n per matrix product the dispatcher runs, in-place and out= forms included (torch's
    FlopCounterMode skips baddbmm_ / addmm_, which the fast path accumulates its scores with)."""

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten, counter = torch.ops.aten, self
        products = {aten.mm: 0, aten.bmm: 0, aten.addmm: 1, aten.addmm_: 1, aten.baddbmm: 1, aten.baddbmm_: 1}
        self.flops = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                first = products.get(func._overloadpacket)
                if first is not None:
                    a, b = args[first], args[first + 1]
                    counter.flops += 2 * a.numel() * b.shape[-1]
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("flags", [dict(), dict(use_sep=False), dict(use_coh=False), dict(use_align=False),
                                   dict(neighbour_source="affinity")])
def test_ascender_pair_flops_are_what_the_fast_path_runs(flags):
    """The per-pair GEMM work of the counted ASCender layer equals torch's count of the fast path's
    matmuls: bidirectional with window 0, every per-pair GEMM grows with s per token, so the
    difference of per-token FLOPs between two lengths isolates it (per-token work cancels)."""
    import torch

    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, ascender_attention
    from ascender_dist.models.counting import ascender_pair_macs

    heads, hd = 2, 16
    hp = AscenderHParams(d_z=6, d_a=4, k=4, window=0, num_global=0, causal=False, chunk_size=32, **flags)

    def per_token(n: int) -> float:
        g = torch.Generator().manual_seed(0)
        q, k, v, z, h = (torch.randn(1, heads, n, d, generator=g) for d in (hd, hd, hd, hp.d_z, hp.d_a))
        with GemmFlops() as counter, torch.no_grad():
            ascender_attention(q, k, v, z, h, AscenderHeadParams(hp, heads), hp, step=10**6, impl="fast")
        return counter.flops / n

    n1, n2 = 64, 128
    search_dim = hp.d_a if hp.neighbour_source == "affinity" else hd
    slope = 2 * heads * (2 * hd + ascender_pair_macs(hp, hd) + search_dim)  # FLOPs per token per key
    assert (per_token(n2) - per_token(n1)) / (n2 - n1) == pytest.approx(slope, rel=1e-9)


def test_ascender_extra_flops_of_the_windowed_debug_layer_by_hand():
    """Every term of ascender_extra_layer_flops written out for the debug preset (h 64, 4 heads of 16,
    s 128, d_z = d_a = 8, window 16 + 2 globals, affinity search): a doubled projection term or a
    window counted once would pass the pair-GEMM test above (window 0) but not this."""
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.models.counting import ascender_extra_layer_flops

    m = config_from_dict({"model": {"preset": "debug", "vocab_size": 512, "architecture": "ascender"}}).model
    projections = 2 * 64 * 4 * (8 + 8)  # the U (d_z) and P (d_a) rows of the QKV projection: 8192
    pair_macs = (16 + 10) + 10 + 10 + 10  # folded khat (16) and Zr (8 + 2), distance on Zr, moments w Zr, Hr
    pairs = 2 * 128 * 4 * pair_macs  # 57344
    search = 2 * 4 * 8 * (2 * 16 + 2)  # affinities on d_a dims over the band of +-16 keys and 2 globals: 2176
    assert ascender_extra_layer_flops(m) == projections + pairs + search == 67712
