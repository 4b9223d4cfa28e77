"""The seed's ASCenderHead as written (benchmarks/seed_reference.py): it runs, it reduces to softmax
attention with zero omega, and its Alignment gathers the query's own key k_hat_i (top-k unused), as
the seed's expand-then-gather does. Ours averages the true neighbours' keys instead (pinned by
tests/unit/test_ascender_reference.py::test_reference_matches_per_row_loop)."""

import math

import torch
import torch.nn.functional as F

from benchmarks.seed_reference import row_norm, seed_attention, seed_params


def _inputs(n=10, nh=2, hd=6, dz=3, da=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, nh, n, d, generator=g) for d in (hd, hd, hd, dz, da)]


def test_seed_reference_runs_and_reduces_to_sdpa_with_zero_omega():
    q, k, v, z, h = _inputs()
    p = seed_params()
    with torch.no_grad():
        for name in ("omega_a", "omega_s", "omega_c"):
            p[name].zero_()
    y, A, parts = seed_attention(q, k, v, z, h, p, k_top=3)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, scale=1 / (math.sqrt(6) * (1 + 1e-6))),
                               rtol=1e-5, atol=1e-5)
    assert set(parts) == {"S_base", "b_align", "b_sep", "b_coh"}


def test_seed_alignment_gathers_the_querys_own_key_and_ignores_the_top_k():
    q, k, v, z, h = _inputs()
    p = seed_params()
    _, _, parts = seed_attention(q, k, v, z, h, p, k_top=3)
    k_hat = F.normalize(k, dim=-1)
    # u_i = normalize(3 * k_hat_i) = k_hat_i, so the seed's r_align is K_hat @ K_hat^T
    expected = row_norm(p["lambda_align"] * (k_hat @ k_hat.transpose(-2, -1)))
    torch.testing.assert_close(parts["b_align"], expected, rtol=1e-5, atol=1e-5)
    # other semantic vectors h -> other top-k neighbours, same Alignment bias
    _, _, other = seed_attention(q, k, v, z, torch.randn_like(h), p, k_top=3)
    torch.testing.assert_close(other["b_align"], parts["b_align"])
