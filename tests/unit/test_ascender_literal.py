"""ASCender attention on a case small enough to work out by hand, against the literal numbers.

Every other numeric test compares two implementations (fast vs reference, reference vs a per-row
loop of the same formulas): a misreading they share would pass them all. Here the expected values
are numbers derived on paper from docs/ascender.md ("The math, as implemented"), so a change of a
sign, a normaliser, a gate or a kernel shows up as a wrong number. Two settings: the defaults (every
width and strength 1, gates before the row normalisation, where they cancel), then gates after it
with widths, strengths and the score temperature away from 1 (`test_post_norm_...`), where the
Cohesion gate, the lambdas, tau vs tau^2 and the temperature each move the numbers. With k = 1 the
Alignment gate sees one neighbour (no spread): sigmoid(0) = 1/2 in both, so its variance term is
not checked here (test_ascender_reference.py's per-row loop covers it).

The case: one head, two tokens, causal, hd = 2, d_z = d_a = 1, k = 1, full neighbourhood, the
default hyperparameters otherwise (pre-norm gates, population std, eps = 1e-6, tau_sep = tau_coh =
tau_score = 1, lambdas 1, delta 0.2, kappa 32), omega = (align, sep, coh) = (0.1, 0.2, 0.3):

    q_1 = (1, 2), k_0 = (1, 0), k_1 = (0, 1), v_0 = (1, 0), v_1 = (0, 1), z = (0, 1), h = (2, 3)

Row 0 sees only itself: every bias is a single entry, its row-normalised value 0, and out_0 = v_0.
Row 1 sees keys 0 and 1. With two visible keys a row-normalised bias is +-sigma / (sigma + eps),
sigma being half the gap between the two raw values (population std), the sign that of the gap:

* Alignment: N(1) = {0}, so u_1 = khat_0 = (1, 0); r_1. = (khat_0 . u_1, khat_1 . u_1) = (1, 0); one
  neighbour has no spread, gate sigmoid(0) = 1/2; beta = (1/2, 0), sigma 1/4:
  align = (+n_a, -n_a), n_a = 0.25 / (0.25 + 1e-6) = 0.99999600001600.
* Separation: hhat = (1, 1), so a_10 = a_11 = 1; w_10 = exp(-(0 - 1)^2) = e^-1, w_11 = 1;
  rho_1 = e^-1 (l != i), eta_1 = e^-1 / 32 = 0.011496232536608; phi = (0.8 e^-1, 0.8);
  beta = -eta phi = (-0.0033834, -0.0091970), sigma 0.0029068: the row's own key, nearest in z, is
  pushed down: sep = (+n_s, -n_s), n_s = 0.99965609762670.
* Cohesion: c_1 = (e^-1 * 0 + 1 * 1) / (1 + e^-1) = 0.73105857863000; local variance c (1 - c)
  = 0.19661193; gate sigmoid(-0.19661193) = 0.45100474617159; r = -(z_j - c)^2 = (-c^2, -(1 - c)^2):
  key 1, nearer the centroid, is pulled up: coh = (-n_c, +n_c), n_c = 0.99999040394733.
* Scores: S_10 = 1/sqrt(2) + 0.1 n_a + 0.2 n_s - 0.3 n_c = 0.70704047952929,
  S_11 = 2/sqrt(2) - 0.1 n_a - 0.2 n_s + 0.3 n_c = 1.41427986403035;
  A_1 = softmax = (0.33020912199772, 0.66979087800228) = out_1 (v is the identity).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, ascender_attention

F64 = torch.float64
TOL = 1e-12  # float64; the literals carry 14 significant digits

A_1 = (0.33020912199772, 0.66979087800228)
CENTROID_1 = 0.73105857863000
GATE_COH_1 = 0.45100474617159
ETA_1 = 0.011496232536608
RHO_1 = 0.36787944117144  # e^-1


def _case():
    hp = AscenderHParams(d_z=1, d_a=1, k=1, window=0, num_global=0, causal=True, chunk_size=8)
    params = AscenderHeadParams(hp, 1).to(F64)
    with torch.no_grad():
        params.omega.copy_(torch.tensor([[0.1, 0.2, 0.3]], dtype=F64))
    rows = lambda *r: torch.tensor(r, dtype=F64).view(1, 1, len(r), -1)  # noqa: E731  [b, np, s, d]
    q = rows((0.5, -0.5), (1.0, 2.0))  # q_0 reaches no score that differs between keys
    k = rows((1.0, 0.0), (0.0, 1.0))
    v = rows((1.0, 0.0), (0.0, 1.0))
    z = rows((0.0,), (1.0,))
    h = rows((2.0,), (3.0,))
    return (q, k, v, z, h), params, hp


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_two_tokens_match_the_hand_computed_output_and_row_statistics(impl):
    inputs, params, hp = _case()
    out, info = ascender_attention(*inputs, params, hp, step=0, return_decomposition=True, impl=impl)
    expected = torch.tensor([[[[1.0, 0.0], A_1]]], dtype=F64)  # out_0 = v_0, out_1 = A_1 (v = identity)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    r = info["rows"]
    assert r["centroid"][0, 0, 1, 0].item() == pytest.approx(CENTROID_1, abs=TOL)
    assert r["gate_coh"][0, 0, 1].item() == pytest.approx(GATE_COH_1, abs=TOL)
    assert r["eta"][0, 0, 1].item() == pytest.approx(ETA_1, abs=TOL)
    assert r["rho"][0, 0, 1].item() == pytest.approx(RHO_1, abs=TOL)
    assert r["gate_align"][0, 0, 1].item() == pytest.approx(0.5, abs=TOL)
    torch.testing.assert_close(r["u"][0, 0, 1], torch.tensor([1.0, 0.0], dtype=F64), atol=TOL, rtol=0)


def test_each_bias_moves_the_row_the_way_worked_out_by_hand():
    """The decomposition maps of row 1: each omega times its +-n (signs as in the module docstring)."""
    inputs, params, hp = _case()
    _, info = ascender_attention(*inputs, params, hp, step=0, return_decomposition=True, impl="reference")
    n_a, n_s, n_c = 0.99999600001600, 0.99965609762670, 0.99999040394733
    maps = info["maps"]
    for name, omega, n, sign_of_key0 in (("align", 0.1, n_a, +1), ("sep", 0.2, n_s, +1), ("coh", 0.3, n_c, -1)):
        row = maps[name][0, 0, 1]
        torch.testing.assert_close(row, torch.tensor([sign_of_key0, -sign_of_key0], dtype=F64) * omega * n,
                                   atol=TOL, rtol=0, msg=name)
        assert maps[name][0, 0, 0, 0].item() == 0.0, name  # one visible key: nothing to normalise
    torch.testing.assert_close(maps["S"][0, 0, 1], torch.tensor([0.70704047952929, 1.41427986403035], dtype=F64),
                               atol=TOL, rtol=0)


def test_separation_before_its_start_step_leaves_only_align_and_coh():
    """At a step before separation_start_step the Separation term is absent: S_10 and S_11 lose
    their +-0.2 n_s."""
    inputs, params, hp = _case()
    hp = dataclasses.replace(hp, separation_start_step=5)
    n_a, n_c = 0.99999600001600, 0.99999040394733
    out = ascender_attention(*inputs, params, hp, step=4, impl="fast")
    s10, s11 = 2 ** -0.5 + 0.1 * n_a - 0.3 * n_c, 2 ** 0.5 - 0.1 * n_a + 0.3 * n_c
    a10 = 1 / (1 + torch.exp(torch.tensor(s11 - s10, dtype=F64)))
    torch.testing.assert_close(out[0, 0, 1], torch.stack([a10, 1 - a10]), atol=TOL, rtol=0)


def test_post_norm_gates_with_widths_and_strengths_away_from_one_match_the_hand_computed_output():
    """The case above with gate_placement post_norm, lambdas (align, sep, coh) = (1.5, 0.5, 2), tau_sep 2,
    tau_coh 0.5, alpha_coh 2, tau_score 0.8. Row 1, by hand:

    * Alignment: r = (1, 0), sigma 1/2, the gate scales the normalised row: g = 1.5 * 1/2 = 0.75,
      align = 0.1 * 0.75 * (+n_a, -n_a), n_a = 0.5 / (0.5 + 1e-6).
    * Separation: w_10 = exp(-1 / 2) = 0.60653065971263 = rho_1, eta_1 = rho / 32 = 0.01895408311602;
      phi = (0.8 w_10, 0.8) normalised (-n_s, +n_s), n_s = 0.99999364630516 (sigma 0.4 (1 - w_10));
      g = -0.5 eta: sep = 0.2 * 0.5 eta * (+n_s, -n_s), i.e. +-0.001895396268756.
    * Cohesion: w_10 = exp(-1 / 0.5) = e^-2, c_1 = 1 / (1 + e^-2) = 0.88079707797788, local variance
      c (1 - c), gate sigmoid(-2 c (1 - c)) = 0.44769526262387, g = 2 * gate / 0.5 = 1.7907810504955;
      r normalised (-n_c, +n_c), n_c = 0.99999737393633: coh = 0.3 g (-n_c, +n_c), i.e. -+0.53723290433713.
    * S_1 = (1/sqrt(2), sqrt(2)) + the three: (0.24676912311848, 1.8745512204412); A_1 = softmax(S_1 / 0.8)
      = (0.11560468978898, 0.88439531021102) = out_1.
    """
    inputs, params, hp = _case()
    hp = dataclasses.replace(hp, gate_placement="post_norm", tau_sep=2.0, tau_coh=0.5, alpha_coh=2.0)
    with torch.no_grad():
        params.lambdas.copy_(torch.tensor([[1.5, 0.5, 2.0]], dtype=F64))
        params.tau_score.fill_(0.8)
    for impl in ("reference", "fast"):
        out, info = ascender_attention(*inputs, params, hp, step=0, return_decomposition=True, impl=impl)
        torch.testing.assert_close(out[0, 0, 1], torch.tensor([0.11560468978898, 0.88439531021102], dtype=F64),
                                   atol=TOL, rtol=0, msg=impl)
        r = info["rows"]
        assert r["centroid"][0, 0, 1, 0].item() == pytest.approx(0.88079707797788, abs=TOL), impl
        assert r["gate_coh"][0, 0, 1].item() == pytest.approx(0.44769526262387, abs=TOL), impl
        assert r["rho"][0, 0, 1].item() == pytest.approx(0.60653065971263, abs=TOL), impl
        assert r["eta"][0, 0, 1].item() == pytest.approx(0.01895408311602, abs=TOL), impl
    maps = ascender_attention(*inputs, params, hp, step=0, return_decomposition=True, impl="reference")[1]["maps"]
    for name, key0 in (("align", 0.0749998500003), ("sep", 0.001895396268756), ("coh", -0.53723290433713)):
        torch.testing.assert_close(maps[name][0, 0, 1], torch.tensor([key0, -key0], dtype=F64), atol=TOL, rtol=0,
                                   msg=name)
