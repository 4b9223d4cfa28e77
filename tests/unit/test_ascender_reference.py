"""The dense reference against a per-row Python loop of the paper's formulas (float64), plus
its structural properties: omega = 0 is plain attention, the decomposition adds up, causal
mode leaks nothing from the future."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, reference_attention

torch.set_num_threads(1)
F64 = torch.float64


def make_inputs(b=1, nh=2, n=9, hd=6, dz=3, da=4, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, nh, n, d, generator=g, dtype=dtype) for d in (hd, hd, hd, dz, da)]


def make_params(hp, nh, dtype=F64, seed=1):
    p = AscenderHeadParams(hp, nh).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # distinct per-head values so head mix-ups show
        p.omega.copy_(0.5 + torch.rand(nh, 3, generator=g, dtype=dtype))
        p.lambdas.copy_(0.5 + torch.rand(nh, 3, generator=g, dtype=dtype))
        p.delta.copy_(0.1 * torch.rand(nh, generator=g, dtype=dtype))
        p.kappa.copy_(1.0 + torch.rand(nh, generator=g, dtype=dtype))
        p.tau_score.copy_(0.7 + 0.6 * torch.rand(nh, generator=g, dtype=dtype))
    return p


@dataclasses.dataclass
class LoopResult:
    """out [b, nh, n, hd]; stats: mass_moved_* [nh]; aux: compactness / crowding / alignment (floats)."""

    out: torch.Tensor
    stats: dict
    aux: dict


def loop_softmax(xs):
    """Softmax of a list of floats (plain Python, max-shifted)."""
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [x / sum(e) for x in e]


@torch.no_grad()
def loop_reference(q, k, v, z, h, p, hp, use_sep=True):
    """Paper sections 2-6 and 8, one (batch, head, row) at a time, with plain Python lists.

    Besides the output it computes, straight from docs/ascender.md: mass moved (per bias, the
    total-variation distance 0.5 * sum_j |A_ij - A'_ij| between the row's softmax of S / tau over
    its visible keys and the same softmax with that one bias term removed; "all": with all three
    removed, ALiBi kept; averaged over batch and rows per head) and the aux losses L_coh
    (E_{j~A_i} |z_j - c_i|^2), L_sep (sum_j A_ij phi_ij) and L_align ([N(i) non-empty]
    (1 - u_i . mean_{l in N(i)} u_l)), each averaged over batch, heads and rows."""
    b, nh, n, hd = q.shape
    out = torch.zeros_like(q)
    moved = {}  # name -> [nh] list of sums over (batch, row)
    aux_sums = {"compactness": 0.0, "crowding": 0.0, "alignment": 0.0}
    unit = lambda x: x / max(float(x.norm()), hp.eps)  # noqa: E731
    std = lambda xs: math.sqrt(  # noqa: E731
        sum((x - sum(xs) / len(xs)) ** 2 for x in xs)
        / (len(xs) if hp.std_form == "population" else max(len(xs) - 1, 1))
    )
    kd = lambda tau: tau if hp.kernel_tau_form == "tau" else tau * tau  # noqa: E731
    for bi in range(b):
        for hi in range(nh):
            Q, K, V, Z, H = (t[bi, hi] for t in (q, k, v, z, h))
            lam, om = p.lambdas[hi], p.omega[hi]
            headings, neighbourhoods = {}, {}
            for i in range(n):
                js = [j for j in range(n) if not hp.causal or j <= i]
                cos = {j: float(unit(H[i]) @ unit(H[j])) for j in range(n)}
                cands = [j for j in js if j != i]
                if hp.window:
                    cands = [j for j in cands if abs(i - j) <= hp.window or j < hp.num_global]
                nbrs = sorted(cands, key=lambda j: -cos[j])[: hp.k]
                neighbourhoods[i] = nbrs
                scores = {j: float(Q[i] @ K[j]) / math.sqrt(hd) for j in js}
                terms = {}
                if hp.use_align:
                    kh = [unit(K[l]) for l in nbrs]
                    u = unit(sum(kh)) if kh else torch.zeros(hd, dtype=q.dtype)
                    m = sum(kh) / len(kh) if kh else 0
                    var = sum(float(((x - m) ** 2).sum()) for x in kh) / max(len(kh), 1)
                    g = float(lam[0]) / (1 + math.exp(hp.alpha_align * var))
                    headings[i] = u
                    terms["align"] = (g, [float(u @ unit(K[j])) for j in js], om[0])
                d2 = {j: float(((Z[i] - Z[j]) ** 2).sum()) for j in js}
                if use_sep:
                    ws = {j: math.exp(-d2[j] / kd(hp.tau_sep)) for j in js}
                    rho = sum(ws[j] for j in js if j != i)
                    eta = min(1.0, rho / float(p.kappa[hi]))
                    phi = [ws[j] * max(0.0, cos[j] - float(p.delta[hi])) for j in js]
                    terms["sep"] = (-float(lam[1]) * eta, phi, om[1])
                if hp.use_coh:
                    wc = {j: math.exp(-d2[j] / kd(hp.tau_coh)) for j in js}
                    W = sum(wc.values())
                    c = sum(wc[j] * Z[j] for j in js) / W
                    lv = sum(wc[j] * float(((Z[j] - c) ** 2).sum()) for j in js) / W
                    g = float(lam[2]) / (1 + math.exp(hp.alpha_coh * lv)) / hp.tau_coh
                    terms["coh"] = (g, [-float(((Z[j] - c) ** 2).sum()) for j in js], om[2])
                added = {}  # name -> [omega * normalised beta_ij for j in js]
                for name, (g, r, w) in terms.items():
                    if hp.gate_placement == "pre_norm":
                        beta = [g * x for x in r]
                        mu, sd = sum(beta) / len(beta), std(beta)
                        normed = [(x - mu) / (sd + hp.eps) for x in beta]
                    else:
                        mu, sd = sum(r) / len(r), std(r)
                        normed = [g * (x - mu) / (sd + hp.eps) for x in r]
                    added[name] = [float(w) * x for x in normed]
                    for j, x in zip(js, added[name]):
                        scores[j] += x
                if hp.other_bias == "alibi":
                    for j in js:
                        scores[j] -= float(p.alibi_slope[hi]) * abs(i - j)
                tau = float(p.tau_score[hi])
                s = torch.tensor([scores[j] for j in js], dtype=q.dtype) / tau
                out[bi, hi, i] = torch.softmax(s, 0) @ V[js]
                A = loop_softmax([scores[j] / tau for j in js])
                removed = {name: [added[name]] for name in added}
                if added:
                    removed["all"] = list(added.values())
                for name, parts in removed.items():
                    without = [(scores[j] - sum(x[t] for x in parts)) / tau for t, j in enumerate(js)]
                    tv = 0.5 * sum(abs(x - y) for x, y in zip(A, loop_softmax(without)))
                    moved.setdefault(f"mass_moved_{name}", [0.0] * nh)[hi] += tv
                if hp.use_coh:
                    aux_sums["compactness"] += sum(a * float(((Z[j] - c) ** 2).sum()) for a, j in zip(A, js))
                if use_sep:
                    aux_sums["crowding"] += sum(a * x for a, x in zip(A, phi))
            if hp.use_align:
                for i, nbrs in neighbourhoods.items():
                    headed = [l for l in nbrs if neighbourhoods[l]]  # u_l is a heading only where N(l) is not empty
                    if headed:
                        u_bar = sum(headings[l] for l in headed) / len(headed)
                        aux_sums["alignment"] += 1.0 - float(headings[i] @ u_bar)
    stats = {name: torch.tensor(sums, dtype=q.dtype) / (b * n) for name, sums in moved.items()}
    aux = {name: total / (b * nh * n) for name, total in aux_sums.items()}
    return LoopResult(out=out, stats=stats, aux=aux)


CASES = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "causal_window_globals": dict(causal=True, window=3, num_global=2),
    "bidir_window": dict(causal=False, window=2, num_global=1),
    "sample_std_tau2_postnorm_alibi": dict(
        causal=True, std_form="sample", kernel_tau_form="tau2", gate_placement="post_norm", other_bias="alibi",
        alpha_align=3.0, alpha_coh=0.2,  # gates' sharpness away from 1: a dropped alpha factor fails here
    ),
    "no_align": dict(causal=True, use_align=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_per_row_loop(case):
    hp = AscenderHParams(d_z=3, d_a=4, k=2, window=0, num_global=0, tau_sep=2.0, tau_coh=1.5)
    hp = dataclasses.replace(hp, **CASES[case])
    q, k, v, z, h = make_inputs()
    p = make_params(hp, 2)
    ref = reference_attention(q, k, v, z, h, p, hp, use_sep=True).out
    loop = loop_reference(q, k, v, z, h, p, hp).out
    torch.testing.assert_close(ref, loop, rtol=1e-10, atol=1e-10)


def test_reference_without_separation_matches_loop():
    hp = AscenderHParams(d_z=3, d_a=4, k=2, window=0, num_global=0)
    q, k, v, z, h = make_inputs(seed=3)
    p = make_params(hp, 2)
    ref = reference_attention(q, k, v, z, h, p, hp, use_sep=False).out
    torch.testing.assert_close(ref, loop_reference(q, k, v, z, h, p, hp, use_sep=False).out, rtol=1e-10, atol=1e-10)


AUX_WEIGHTS = dict(aux_compactness_weight=0.3, aux_crowding_weight=0.5, aux_alignment_weight=0.2)
LOOP_CALLS = [(case, True) for case in CASES] + [("causal", False), ("bidirectional", False)]


def loop_case(case, use_sep):
    """Reference (with aux) and per-row loop on two batch entries (so the batch averaging shows); k = 3
    leaves causal row 2 two neighbours with headings, so a mean over k instead of |N(i)| shows."""
    hp = AscenderHParams(d_z=3, d_a=4, k=3, window=0, num_global=0, tau_sep=2.0, tau_coh=1.5, **AUX_WEIGHTS)
    hp = dataclasses.replace(hp, **CASES[case])
    q, k, v, z, h = make_inputs(b=2, seed=4)
    p = make_params(hp, 2)
    ref = reference_attention(q, k, v, z, h, p, hp, use_sep=use_sep, with_aux=True)
    return hp, ref, loop_reference(q, k, v, z, h, p, hp, use_sep=use_sep)


@pytest.mark.parametrize("case, use_sep", LOOP_CALLS)
def test_reference_aux_losses_match_per_row_loop(case, use_sep):
    """Each section 8 loss against the loop, and the total against the literal weighted sum of the
    loop's losses with distinct weights (a swapped or dropped weight shows)."""
    hp, ref, loop = loop_case(case, use_sep)
    torch.testing.assert_close(ref.out, loop.out, rtol=1e-10, atol=1e-10)
    expect = {"compactness": hp.use_coh, "crowding": use_sep, "alignment": hp.use_align}
    assert set(ref.aux) == {name for name, on in expect.items() if on} | {"total"}
    for name in set(ref.aux) - {"total"}:
        assert loop.aux[name] > 0, name  # not vacuous
        torch.testing.assert_close(ref.aux[name], torch.tensor(loop.aux[name], dtype=F64), rtol=1e-10, atol=1e-12,
                                   msg=name)  # fmt: skip
    total = (0.3 * loop.aux["compactness"] * hp.use_coh + 0.5 * loop.aux["crowding"] * use_sep
             + 0.2 * loop.aux["alignment"] * hp.use_align)  # fmt: skip
    torch.testing.assert_close(ref.aux["total"], torch.tensor(total, dtype=F64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case, use_sep", LOOP_CALLS)
def test_reference_mass_moved_matches_per_row_loop(case, use_sep):
    """stats.mass_moved_* against the documented definition computed row by row (docs/ascender.md:
    mean over rows and batch of TV(softmax(S / tau), softmax((S - bias) / tau)) over visible keys)."""
    hp, ref, loop = loop_case(case, use_sep)
    names = [name for name, on in (("align", hp.use_align), ("sep", use_sep), ("coh", hp.use_coh)) if on]
    assert set(loop.stats) == {f"mass_moved_{name}" for name in names + ["all"]}
    assert set(loop.stats) <= set(ref.stats)
    for name, want in loop.stats.items():
        assert torch.all(want > 1e-3), name  # not vacuous: every bias moves some mass
        torch.testing.assert_close(ref.stats[name], want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("causal", [True, False])
def test_zero_omega_is_plain_softmax_attention(causal):
    hp = AscenderHParams(d_z=3, d_a=4, k=2, window=0, num_global=0, causal=causal, omega_init=0.0)
    q, k, v, z, h = make_inputs(n=11, dtype=torch.float32)
    p = AscenderHeadParams(hp, 2)
    out = reference_attention(q, k, v, z, h, p, hp, use_sep=True).out
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, sdpa, rtol=1e-6, atol=1e-6)


def test_decomposition_adds_up_and_rows_are_normalised():
    hp = AscenderHParams(d_z=3, d_a=4, k=2, window=0, num_global=0, other_bias="alibi")
    q, k, v, z, h = make_inputs(n=10)
    p = make_params(hp, 2)
    res = reference_attention(q, k, v, z, h, p, hp, use_sep=True)
    m = res.maps
    vis = torch.ones(10, 10, dtype=torch.bool).tril()
    total = m["S_base"] + m["align"] + m["sep"] + m["coh"] + m["other"]
    torch.testing.assert_close(m["S"][..., vis], total[..., vis])
    assert torch.all(m["S"][..., ~vis] == float("-inf")) and torch.all(m["A"][..., ~vis] == 0)
    torch.testing.assert_close(m["A"].sum(-1), torch.ones(1, 2, 10, dtype=F64))
    # each normalised bias / omega has zero mean and unit population std over visible keys
    for col, name in enumerate(("align", "sep", "coh")):
        beta = m[name] / p.omega[:, col].view(1, -1, 1, 1)
        rows = beta[0, 0, 5, :6].detach()
        assert abs(float(rows.mean())) < 1e-12
        assert abs(float(rows.std(unbiased=False)) - 1) < 1e-4


def test_causal_reference_does_not_see_the_future():
    hp = AscenderHParams(d_z=3, d_a=4, k=3, window=0, num_global=0, other_bias="alibi")
    ins = make_inputs(n=12, seed=5)
    p = make_params(hp, 2)
    t = 6
    changed = [x.clone() for x in ins]
    for x in changed:
        x[..., t + 1 :, :] = torch.randn_like(x[..., t + 1 :, :]) * 3
    a = reference_attention(*ins, p, hp, use_sep=True)
    b = reference_attention(*changed, p, hp, use_sep=True)
    assert torch.equal(a.out[..., : t + 1, :], b.out[..., : t + 1, :])
    for name, ma in a.maps.items():
        assert torch.equal(ma[..., : t + 1, : t + 1], b.maps[name][..., : t + 1, : t + 1]), name
    for name in ("u", "gate_align", "rho", "eta", "centroid", "gate_coh", "neighbour_idx"):
        assert torch.equal(a.rows[name][:, :, : t + 1], b.rows[name][:, :, : t + 1]), name
    assert not torch.equal(a.out[..., t + 1 :, :], b.out[..., t + 1 :, :])  # the change mattered


def test_top_k_excludes_self_and_respects_window():
    hp = AscenderHParams(d_z=3, d_a=4, k=3, window=3, num_global=1, causal=False)
    ins = make_inputs(n=12)
    res = reference_attention(*ins, make_params(hp, 2), hp, use_sep=True)
    idx, valid = res.rows["neighbour_idx"], res.rows["neighbour_valid"]
    i = torch.arange(12).view(1, 1, 12, 1)
    assert torch.all(valid) and not torch.any(idx == i)
    assert torch.all(((idx - i).abs() <= 3) | (idx < 1))
    assert torch.any(((idx - i).abs() > 3) & (idx == 0))  # the global token is used from afar


@pytest.mark.parametrize("source", ["affinity", "base_scores"])
def test_neighbours_rank_what_neighbour_source_names(source):
    """N_k(i) is the top-k of the cosine affinity (section 2) or of the base scores q.k/sqrt(d)
    (section 9's reuse), over the same candidates (visible, not i)."""
    hp = AscenderHParams(d_z=3, d_a=4, k=3, window=0, num_global=0, causal=True, neighbour_source=source)
    q, k, v, z, h = make_inputs(n=10)
    res = reference_attention(q, k, v, z, h, make_params(hp, 2), hp, use_sep=True)
    hhat = F.normalize(h, dim=-1, eps=hp.eps)
    ranked = hhat @ hhat.transpose(-1, -2) if source == "affinity" else q @ k.transpose(-1, -2) / math.sqrt(6)
    cand = torch.ones(10, 10, dtype=torch.bool).tril(-1)  # causal, j != i
    for i in range(3, 10):  # rows with at least k candidates
        expect = torch.topk(ranked[..., i, :].masked_fill(~cand[i], float("-inf")), 3, dim=-1).indices
        got = res.rows["neighbour_idx"][..., i, :]
        assert torch.equal(got.sort(-1).values, expect.sort(-1).values), (source, i)


def test_gates_weaken_with_variance():
    """Paper text: higher neighbourhood variance -> weaker alignment (sigmoid(-alpha Var))."""
    hp = AscenderHParams(d_z=3, d_a=4, k=3, window=0, num_global=0, causal=False)
    q, k, v, z, h = make_inputs(n=8)
    p = make_params(hp, 2)
    coherent = k.clone()
    coherent[...] = 1.0 + 1e-3 * k  # all keys nearly parallel: variance ~ 0
    g_coh = reference_attention(q, coherent, v, z, h, p, hp, use_sep=True).rows["gate_align"]
    g_rand = reference_attention(q, k, v, z, h, p, hp, use_sep=True).rows["gate_align"]
    assert torch.all(g_coh > g_rand) and torch.allclose(g_coh, torch.full_like(g_coh, 0.5), atol=1e-4)


def test_alignment_loss_leaves_out_neighbours_without_a_heading():
    """Causal row 0 has no neighbours, so u_0 = 0 is no heading: it is left out of every ū (and of
    the count), and row 1, whose only neighbour is row 0, adds no term (it gave exactly 1 before,
    a constant with no gradient, and shrank the ū of every row next to row 0)."""
    hp = AscenderHParams(d_z=3, d_a=4, k=3, window=0, num_global=0, causal=True, aux_alignment_weight=1.0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    z, h = torch.randn(1, 1, 6, 3, generator=g, dtype=torch.float64), torch.randn(1, 1, 6, 4, generator=g, dtype=torch.float64)
    res = reference_attention(q, k, v, z, h, AscenderHeadParams(hp, 1).double(), hp, use_sep=True, with_aux=True)
    u, idx, valid = res.rows["u"][0, 0], res.rows["neighbour_idx"][0, 0], res.rows["neighbour_valid"][0, 0]
    assert float(u[0].norm()) == 0.0 and int(valid[0].sum()) == 0
    want = 0.0
    for i in range(2, 6):  # rows 0 and 1 add nothing
        others = [int(j) for j, ok in zip(idx[i], valid[i]) if ok and int(j) != 0]
        u_bar = sum(u[j] for j in others) / len(others)
        want += 1.0 - float(u[i] @ u_bar)
    assert float(res.aux["alignment"]) == pytest.approx(want / 6, rel=1e-12)
