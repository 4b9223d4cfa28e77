"""Slow, obviously right ASCender attention (paper Method sections 2-8), dense n x n.

Every quantity is built as the paper writes it, as a full ``[b, np, s, s]`` matrix where it is a
pairwise quantity, then masked. It exists to be read and to test the fast path against; its
memory is O(s^2) per head. Inputs are already projected (the U and P projections of section 2
live in the fused QKV projection):

    q, k, v: [b, np, s, hd]    z: [b, np, s, d_z]    h: [b, np, s, d_a]

Masks. ``hp.causal=False``: every row sees every key, like the seed code. ``hp.causal=True``:
row i sees keys j <= i and EVERY statistic of row i (top-k neighbourhood with j < i, density,
centroid, gate variances, row mean/std of each bias) uses only those keys, so nothing leaks
from the future. Windowed neighbourhoods (``hp.window > 0``): the top-k candidates of row i
are the visible j != i with |i - j| <= window plus the global positions j < num_global
(section 9); densities, centroids and the attention itself still see all visible keys.

Resolutions of the seed's slips are documented in docs/ascender.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .common import safe_sqrt, total_variation, variance_denominator, weighted_aux_total
from ascender_dist.config.ascender_hparams import AscenderHParams
from .neighbour_rule import search_scores, search_vectors, top_k
from .params import ALIGN, COH, SEP, AscenderHeadParams

NAMES = ("align", "sep", "coh")


@dataclass
class AscenderResult:
    """What one attention call produced. maps: [b, np, s, s]; rows: [b, np, s(, e)]; stats: [np]."""

    out: torch.Tensor
    maps: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def visible_mask(n: int, causal: bool, device) -> torch.Tensor:
    """[s, s] bool: key j is visible to query i."""
    ones = torch.ones(n, n, dtype=torch.bool, device=device)
    return torch.tril(ones) if causal else ones


def candidate_mask(n: int, hp: AscenderHParams, device) -> torch.Tensor:
    """[s, s] bool: j may be a top-k neighbour of i (visible, j != i, in window or global)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    cand = visible_mask(n, hp.causal, device) & (i != j)
    if hp.window > 0:
        cand = cand & (((i - j).abs() <= hp.window) | (j < hp.num_global))
    return cand


def dense_neighbours(xq: torch.Tensor, xk: torch.Tensor, cand: torch.Tensor, k: int):
    """Top-k of the search scores xq_i . xk_j over the candidates, by the shared rule
    (neighbour_rule: float64 scores rounded to float32, ties to the lowest key index).
    Returns idx [b, np, s, k] (long) and valid [b, np, s, k].

    Rows with fewer than k candidates (sequence start, causal) get the ones they have;
    the other slots are marked invalid (idx 0).
    """
    return top_k(search_scores(xq, xk), cand, torch.arange(xk.shape[-2], device=xk.device), k)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [b, np, s, e], idx [b, np, m, k] -> x at those positions, [b, np, m, k, e]."""
    b, np_, _, _ = x.shape
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    hi = torch.arange(np_, device=x.device)[None, :, None, None]
    return x[bi, hi, idx]


def pairwise_sqdist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x_i - y_j|^2 [b, np, m, n] via |x|^2 + |y|^2 - 2 x.y, clamped at 0 (the expansion can dip below)."""
    d2 = (x * x).sum(-1)[..., :, None] + (y * y).sum(-1)[..., None, :] - 2 * x @ y.transpose(-1, -2)
    return d2.clamp(min=0)


def row_normalise(x: torch.Tensor, vis: torch.Tensor, hp: AscenderHParams):
    """Section 6 over the visible keys of each row: (x - mu) / (sigma + eps); 0 where invisible.

    Also returns sigma (std over the row, population or sample per hp.std_form).
    """
    count = vis.sum(-1).to(x.dtype)  # [s]
    mu = (x * vis).sum(-1) / count  # [b, np, s]
    dev = (x - mu[..., None]) * vis
    sigma = safe_sqrt((dev * dev).sum(-1) / variance_denominator(count, hp))
    return dev / (sigma[..., None] + hp.eps), sigma


def normalised_bias(g: torch.Tensor, r: torch.Tensor, vis: torch.Tensor, hp: AscenderHParams):
    """Normalised beta for beta_ij = g_i * r_ij; gate placement per hp.gate_placement."""
    if hp.gate_placement == "pre_norm":
        return row_normalise(g[..., None] * r, vis, hp)[0]
    return g[..., None] * row_normalise(r, vis, hp)[0]


def alignment(k, idx, valid, params: AscenderHeadParams, hp: AscenderHParams):
    """Section 3: heading u_i, gate and raw score r_ij = khat_j . u_i. Returns (u, g, r, gate)."""
    khat = F.normalize(k, dim=-1, eps=hp.eps)
    nb = gather_rows(khat, idx) * valid[..., None]  # [b, np, s, k, hd]
    count = valid.sum(-1).to(k.dtype).clamp(min=1)[..., None]  # [b, np, s, 1]
    total = nb.sum(-2)  # [b, np, s, hd]
    u = F.normalize(total, dim=-1, eps=hp.eps)
    mean = total / count
    # Var_l[khat_l]: total variance (trace of the covariance) over the neighbours
    spread = ((nb - mean[..., None, :]) * valid[..., None]).pow(2).sum((-1, -2))
    gate = torch.sigmoid(-hp.alpha_align * spread / count[..., 0])
    g = params.lambdas[:, ALIGN].view(1, -1, 1) * gate
    r = u @ khat.transpose(-1, -2)  # [b, np, s, s]
    return u, g, r, gate


def kernels(z, vis, hp: AscenderHParams):
    """Gaussian kernels w_ij = exp(-d_ij^2 / tau or tau^2) on visible pairs, [b, np, s, s] each."""
    n = z.shape[-2]
    eye = torch.eye(n, dtype=torch.bool, device=z.device)
    d2 = pairwise_sqdist(z, z).masked_fill(eye, 0.0)  # d_ii = 0 exactly
    w_sep = torch.exp(-d2 / hp.kernel_denominator(hp.tau_sep)) * vis
    w_coh = torch.exp(-d2 / hp.kernel_denominator(hp.tau_coh)) * vis
    return w_sep, w_coh


def separation(w_sep, a, vis, params: AscenderHeadParams, hp: AscenderHParams):
    """Section 4: density rho_i (l != i), eta_i, phi_ij. Returns (g = -lambda*eta, phi, rho, eta)."""
    n = a.shape[-1]
    off_diag = vis & ~torch.eye(n, dtype=torch.bool, device=a.device)
    rho = (w_sep * off_diag).sum(-1)  # [b, np, s]
    eta = torch.clamp(rho / params.density_scale().view(1, -1, 1), max=1.0)
    phi = w_sep * F.relu(a - params.delta.view(1, -1, 1, 1))
    g = -params.lambdas[:, SEP].view(1, -1, 1) * eta
    return g, phi, rho, eta


def cohesion(z, w_coh, params: AscenderHeadParams, hp: AscenderHParams):
    """Section 5: centroid c_i (kernel-weighted, l = i included), gate, r_ij = -|z_j - c_i|^2."""
    weight = w_coh.sum(-1)  # [b, np, s], >= 1 because w_ii = 1
    c = (w_coh @ z) / weight[..., None]  # [b, np, s, dz]
    z2 = (z * z).sum(-1)  # [b, np, s]
    c2 = (c * c).sum(-1)
    local_var = ((w_coh * z2[..., None, :]).sum(-1) / weight - c2).clamp(min=0)
    gate = torch.sigmoid(-hp.alpha_coh * local_var)
    g = params.lambdas[:, COH].view(1, -1, 1) * gate / hp.tau_coh
    r = -(z2[..., None, :] - 2 * c @ z.transpose(-1, -2) + c2[..., :, None])  # [b, np, s, s]
    return c, g, r, gate


def other_bias(n: int, params: AscenderHeadParams, hp: AscenderHParams, device, dtype):
    """beta_other: ALiBi -m_h |i - j| ([1, np, s, s]) or None."""
    if hp.other_bias != "alibi":
        return None
    pos = torch.arange(n, device=device, dtype=dtype)
    dist = (pos[:, None] - pos[None, :]).abs()
    return -params.alibi_slope.to(dtype).view(1, -1, 1, 1) * dist


def mass_moved(S, terms: dict, vis, tau):
    """Per head [np]: mean over rows of TV(A, A without term), and TV(A, A of base+other)."""
    neg = float("-inf")
    A = torch.softmax((S / tau).masked_fill(~vis, neg), -1)
    stats = {}
    for name, term in terms.items():
        A_wo = torch.softmax(((S - term) / tau).masked_fill(~vis, neg), -1)
        stats[f"mass_moved_{name}"] = total_variation(A, A_wo).mean((0, 2))
    if terms:
        S_base = S - sum(terms.values())
        A_base = torch.softmax((S_base / tau).masked_fill(~vis, neg), -1)
        stats["mass_moved_all"] = total_variation(A, A_base).mean((0, 2))
    return stats


def aux_losses(A, z, c, phi, u, idx, valid, hp: AscenderHParams, use_sep: bool):
    """Section 8 losses, each averaged over batch, heads and rows, plus the weighted total."""
    aux = {}
    if hp.aux_compactness_weight > 0 and c is not None:
        d2c = ((z[..., None, :, :] - c[..., :, None, :]) ** 2).sum(-1)  # [b, np, s, s]
        aux["compactness"] = (A * d2c).sum(-1).mean()
    if hp.aux_crowding_weight > 0 and use_sep:
        aux["crowding"] = (A * phi).sum(-1).mean()
    if hp.aux_alignment_weight > 0 and u is not None:
        # neighbours with a heading only: u_l = 0 where l has no neighbours (row 0, causal) is no heading
        headed = valid & gather_rows(valid.any(-1, keepdim=True), idx)[..., 0]  # [b, np, s, k]
        count = headed.sum(-1)
        u_bar = (gather_rows(u, idx) * headed[..., None]).sum(-2) / count.clamp(min=1)[..., None]
        aux["alignment"] = ((1 - (u * u_bar).sum(-1)) * (count > 0)).mean()
    aux["total"] = weighted_aux_total(aux, hp)
    return aux


def reference_attention(
    q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
    with_aux: bool = False,
) -> AscenderResult:  # fmt: skip
    """ASCender attention for a group of heads, dense. Returns out [b, np, s, hd] and all maps.

    maps: S_base, align/sep/coh (each omega * normalised beta, 0 when off), other, S (their
    sum, pre-temperature) and A, all [b, np, s, s] with invisible entries S=-inf, others 0.
    """
    n, hd = q.shape[-2], q.shape[-1]
    vis = visible_mask(n, hp.causal, q.device)
    tau = params.score_temperature().view(1, -1, 1, 1)
    omega = params.omega
    S_base = q @ k.transpose(-1, -2) / math.sqrt(hd)  # [b, np, s, s]
    terms, rows, maps = {}, {}, {"S_base": S_base}
    hhat = F.normalize(h, dim=-1, eps=hp.eps)
    a = hhat @ hhat.transpose(-1, -2)  # cosine affinity, [b, np, s, s]
    # N_k(i) ranks the affinity or the base scores (hp.neighbour_source), by the shared rule
    idx, valid = dense_neighbours(*search_vectors(q, k, h, hp), candidate_mask(n, hp, q.device), hp.k)
    rows["neighbour_idx"], rows["neighbour_valid"] = idx, valid
    u = phi = c = None
    if hp.use_align:
        u, g, r, gate = alignment(k, idx, valid, params, hp)
        terms["align"] = omega[:, ALIGN].view(1, -1, 1, 1) * normalised_bias(g, r, vis, hp)
        rows["u"], rows["gate_align"] = u, gate
    if use_sep or hp.use_coh:
        w_sep, w_coh = kernels(z, vis, hp)
    if use_sep:
        g, phi, rho, eta = separation(w_sep, a, vis, params, hp)
        terms["sep"] = omega[:, SEP].view(1, -1, 1, 1) * normalised_bias(g, phi, vis, hp)
        rows["rho"], rows["eta"] = rho, eta
    if hp.use_coh:
        c, g, r, gate = cohesion(z, w_coh, params, hp)
        terms["coh"] = omega[:, COH].view(1, -1, 1, 1) * normalised_bias(g, r, vis, hp)
        rows["centroid"], rows["gate_coh"] = c, gate
    S = S_base + sum(terms.values()) if terms else S_base
    other = other_bias(n, params, hp, q.device, q.dtype)
    if other is not None:
        S = S + other
    A = torch.softmax((S / tau).masked_fill(~vis, float("-inf")), -1)
    out = A @ v  # [b, np, s, hd]
    for name in NAMES:
        maps[name] = terms[name] * vis if name in terms else torch.zeros_like(S_base)
    maps["other"] = other * vis if other is not None else torch.zeros_like(S_base)
    maps["S"], maps["A"] = S.masked_fill(~vis, float("-inf")), A
    with torch.no_grad():
        stats = mass_moved(S.detach(), {n_: t.detach() for n_, t in terms.items()}, vis, tau)
    aux = aux_losses(A, z, c, phi, u, idx, valid, hp, use_sep) if with_aux else {}
    return AscenderResult(out=out, maps=maps, rows=rows, stats=stats, aux=aux)
