"""The shared neighbour rule (neighbour_rule): top-k by (score, lowest key index) against a brute-force
sort, scores that do not depend on the layout, and what that buys on repeated tokens, where exact
ties are the rule: the same neighbours and outputs for a prefix and the whole sequence, for heads in
one call or split across calls (tensor parallelism), for any rows per chunk, in the reference and
the fast path alike."""

import dataclasses

import pytest
import torch

from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, ascender_attention
from ascender_dist.models.ascender.fast_neighbours import chunk_bounds, neighbours
from ascender_dist.models.ascender.neighbour_rule import search_scores, search_vectors, top_k

torch.set_num_threads(1)
F64 = torch.float64


def brute_top_k(scores, cand, cols, k):
    """Row by row: candidates sorted by (-score, key index), the first k."""
    out_idx = torch.zeros(*scores.shape[:-1], k, dtype=torch.long)
    out_valid = torch.zeros(*scores.shape[:-1], k, dtype=torch.bool)
    for row in torch.cartesian_prod(*(torch.arange(d) for d in scores.shape[:-1])).view(-1, scores.dim() - 1):
        r = tuple(row.tolist())
        pairs = sorted((-float(scores[r][m]), int(cols[m])) for m in range(scores.shape[-1]) if cand[r][m])
        for t, (_, col) in enumerate(pairs[:k]):
            out_idx[r + (t,)], out_valid[r + (t,)] = col, True
    return out_idx, out_valid


@pytest.mark.parametrize("every_row", [False, True], ids=["cpu_way", "cuda_way"])
@pytest.mark.parametrize("seed", range(4))
def test_top_k_is_score_then_lowest_key_index(seed, every_row):
    g = torch.Generator().manual_seed(seed)
    m = 23
    # few distinct values (many exact ties), both signs, -0.0 beside +0.0, columns in any order
    values = torch.tensor([-2.5, -1.0, -0.0, 0.0, 0.5, 3.0])
    scores = values[torch.randint(0, len(values), (2, 3, 5, m), generator=g)]
    cand = torch.rand(2, 3, 5, m, generator=g) < 0.8
    cols = torch.randperm(m, generator=g) + 7
    for k in (1, 4, 22, 23, 30):
        idx, valid = top_k(scores, cand, cols, k, every_row=every_row)
        want_idx, want_valid = brute_top_k(scores, cand, cols, k)
        assert torch.equal(valid, want_valid)
        assert torch.equal(idx, want_idx)


@pytest.mark.parametrize("every_row", [False, True], ids=["cpu_way", "cuda_way"])
def test_top_k_ranks_negative_scores_and_infinities_correctly(every_row):
    scores = torch.tensor([[-1e-30, -3.0, float("-inf"), 2.0, -0.0, 1e30, 0.0]])
    cols = torch.arange(7)
    idx, valid = top_k(scores, torch.ones_like(scores, dtype=torch.bool), cols, 7, every_row=every_row)
    assert idx.tolist() == [[5, 3, 4, 6, 0, 1, 0]]  # -0.0 and +0.0 tie: lower index first
    assert valid.tolist() == [[True] * 6 + [False]]


def test_top_k_refuses_scores_wider_than_float32():
    """Its keys hold float32 bits: float64 scores 1e-12 apart would tie there and pick by index."""
    with pytest.raises(TypeError, match="float32"):
        top_k(torch.tensor([[1.0, 1.0, 1.0 + 1e-12]], dtype=torch.float64), torch.tensor(True), torch.arange(3), 2)


def test_search_scores_do_not_depend_on_the_tile_shape():
    """Equal vectors get bit-equal scores however the rows and keys are cut (a float32 GEMM of
    the same numbers varies in the last bit with the shape)."""
    g = torch.Generator().manual_seed(0)
    vocab = torch.nn.functional.normalize(torch.randn(5, 32, generator=g), dim=-1)
    x = vocab[torch.randint(0, 5, (257,), generator=g)]  # [s, e], repeated rows
    whole = search_scores(x, x)
    for rows in (1, 16, 63, 100):
        for keys in (7, 128, 257):
            for r0 in range(0, 257, rows):
                for k0 in range(0, 257, keys):
                    part = search_scores(x[r0 : r0 + rows], x[k0 : k0 + keys])
                    assert torch.equal(part, whole[r0 : r0 + rows, k0 : k0 + keys])
    same = (x[:, None, :] == x[None, :, :]).all(-1)  # [s, s] rows i, j hold the same vector
    for i in range(0, 257, 17):
        assert torch.unique(whole[i][same[0]]).numel() == 1  # every copy of token 0 scores alike


def repeated_token_inputs(seed, b, nh, n, hd, dz, da, vocab_size=5):
    """q, v, z, h from a few token values (exact repeats, as at a model's first layer; h is not rotated),
    k random (RoPE makes a repeated token's key differ per position)."""
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randn(vocab_size, hd, generator=g, dtype=F64)
    ids = torch.randint(0, vocab_size, (n,), generator=g)

    def rep(d):
        return (vocab[ids] @ torch.randn(hd, d, generator=g, dtype=F64)).expand(b, nh, n, d).contiguous()

    return rep(hd), torch.randn(b, nh, n, hd, generator=g, dtype=F64), rep(hd), rep(dz), rep(da)


def tied_rows(h, hp):
    """Number of rows whose k-th and (k+1)-th candidates tie exactly: the inputs must have them."""
    xq, xk = search_vectors(h, h, h, hp)
    from ascender_dist.models.ascender.reference import candidate_mask

    s = search_scores(xq, xk).masked_fill(~candidate_mask(h.shape[-2], hp, h.device), float("-inf"))
    top = torch.topk(s, hp.k + 1, dim=-1).values
    return int((torch.isfinite(top[..., hp.k]) & (top[..., hp.k - 1] == top[..., hp.k])).sum())


HP = AscenderHParams(d_z=8, d_a=8, k=3, window=8, num_global=2, causal=True, chunk_size=8, omega_init=0.5)


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("window", [8, 0], ids=["windowed", "full"])
def test_a_prefix_computes_what_the_whole_sequence_does_on_repeated_tokens(impl, window):
    hp = dataclasses.replace(HP, window=window, num_global=2 if window else 0)
    ties = 0
    for seed in range(5):
        q, k, v, z, h = repeated_token_inputs(seed, 1, 2, 40, 16, 8, 8)
        ties += tied_rows(h, hp)
        params = AscenderHeadParams(hp, 2).double()
        full = ascender_attention(q, k, v, z, h, params, hp, step=0, impl=impl)
        for t in range(9, 40, 3):
            prefix = ascender_attention(q[:, :, :t], k[:, :, :t], v[:, :, :t], z[:, :, :t], h[:, :, :t], params, hp,
                                        step=0, impl=impl)  # fmt: skip
            torch.testing.assert_close(prefix, full[:, :, :t], rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"seed {seed}, prefix {t}: {m}")  # fmt: skip
    assert ties > 20  # the inputs do tie across the k-th place


@pytest.mark.parametrize("window", [12, 0], ids=["windowed", "full"])
def test_heads_split_across_calls_and_other_chunk_rows_compute_the_same(window):
    """4 heads in one call against 2 + 2 (tensor parallelism), where the tile cap also gives the
    halves other rows per chunk (chunk_bounds reads b * np), and the reference."""
    hp = AscenderHParams(d_z=8, d_a=8, k=3, window=window, num_global=2 if window else 0, causal=True,
                         chunk_size=64, max_tile_elems=4 * 16 * 96, omega_init=0.5)  # fmt: skip
    assert chunk_bounds(96, 4, hp) != chunk_bounds(96, 2, hp)
    for seed in range(4):
        q, k, v, z, h = repeated_token_inputs(seed, 1, 4, 96, 16, 8, 8)
        assert tied_rows(h, hp) > 0
        params = AscenderHeadParams(hp, 4).double()
        whole = ascender_attention(q, k, v, z, h, params, hp, step=0, impl="fast")
        halves = []
        for sl in (slice(0, 2), slice(2, 4)):
            half = AscenderHeadParams(hp, 2).double()
            with torch.no_grad():
                for name, p in half.named_parameters():
                    p.copy_(getattr(params, name)[sl])
            halves.append(ascender_attention(*(t[:, sl] for t in (q, k, v, z, h)), half, hp, step=0, impl="fast"))
        torch.testing.assert_close(torch.cat(halves, 1), whole, rtol=1e-9, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
        ref = ascender_attention(q, k, v, z, h, params, hp, step=0, impl="reference")
        torch.testing.assert_close(whole, ref, rtol=1e-9, atol=1e-10, msg=lambda m: f"seed {seed}, reference: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_neighbours_do_not_depend_on_the_rows_per_chunk(dtype):
    hp = dataclasses.replace(HP, k=4, window=16, num_global=2)
    q, k, v, z, h = (t.to(dtype) for t in repeated_token_inputs(3, 2, 3, 300, 16, 8, 8, vocab_size=7))
    xq, xk = search_vectors(q, k, h, hp)
    whole = neighbours(xq, xk, hp, [(0, 300)])
    for rows in (1, 16, 37, 128):
        chunks = [(c0, min(c0 + rows, 300)) for c0 in range(0, 300, rows)]
        got = neighbours(xq, xk, hp, chunks)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1]), rows
