"""ASCender attention without any n x n tensor per head: memory O(s * (window + chunk)).

Same inputs and outputs as ``reference.py`` (q, k, v: [b, np, s, hd]; z: [b, np, s, d_z];
h: [b, np, s, d_a]) and the same math, rearranged (docs/ascender.md, "Fast path"):

* Alignment and Cohesion are bilinear in a per-query and a per-key vector, so they fold into
  one dot product with an augmented head dim (shared/design/ascender-math.md section 2):
      q_aug_i = [q_i / sqrt(hd), w_a s_a(i) u_i, 2 w_c s_c(i) [c_i, 1]] / tau_score
      k_aug_j = [k_j,            khat_j,         [z_j, -|z_j|^2 / 2]]
  Their row means are row constants (softmax ignores them) and their row stds come from the
  covariance of khat_j (resp. [z_j, -|z_j|^2/2]) over the visible keys: a global covariance
  (bidirectional) or running per-chunk states plus an in-chunk triangle (causal), see
  PrefixMoments. No statistic of row i ever reads a key j > i in causal mode.
* Separation (not low-rank), the densities rho_i, the centroids c_i and the row statistics of
  Separation are built per query chunk on a [chunk, keys] tile; the tile is the float
  ``attn_mask`` of scaled_dot_product_attention for that chunk. Each chunk runs under
  activation checkpointing, so backward holds one tile at a time, not all of them.
* Neighbourhoods (no gradient flows through the choice of neighbours) are found chunk by
  chunk over a band of +-window keys plus the globals (O(s * window)), or over all visible
  keys when window == 0 (O(s * chunk) memory). Headings u_i sum k neighbours with k gathers of
  [s, hd] instead of one [s, k, hd] tensor.

``flex_attention_path`` is the GPU variant (FlexAttention score_mod for Separation). It only
runs when CUDA is available; on CPU torch 2.13 has no FlexAttention backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .common import row_scale, safe_sqrt, total_variation, variance_denominator
from .hparams import AscenderHParams
from .params import ALIGN, COH, SEP, AscenderHeadParams
from .reference import AscenderResult, mass_moved

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- chunking
def chunk_bounds(n: int, batch_heads: int, hp: AscenderHParams) -> list[tuple[int, int]]:
    """Query chunks [c0, c1): at most hp.chunk_size rows, and at most hp.max_tile_elems
    entries in a [b*np, rows, s] tile (long sequences get shorter chunks, floor 16 rows)."""
    rows = max(1, min(hp.chunk_size, max(16, hp.max_tile_elems // max(1, batch_heads * n))))
    return [(c0, min(c0 + rows, n)) for c0 in range(0, n, rows)]


def tile_visibility(c0: int, c1: int, n_keys: int, causal: bool, device) -> torch.Tensor:
    """[c1-c0, n_keys] bool: key j visible to query row i (absolute positions)."""
    i = torch.arange(c0, c1, device=device)[:, None]
    j = torch.arange(n_keys, device=device)[None, :]
    return j <= i if causal else torch.ones(c1 - c0, n_keys, dtype=torch.bool, device=device)


# ----------------------------------------------------------------------------- neighbours
def _topk_masked(scores, cand, cols, k: int):
    """Top-k of scores over cand; returns absolute column idx and a valid mask, both [.., k]."""
    scores = scores.masked_fill(~cand, NEG_INF)
    kk = min(k, scores.shape[-1])
    val, pos = torch.topk(scores, kk, dim=-1)
    valid = torch.isfinite(val)
    idx = cols[pos]
    if kk < k:
        idx, valid = F.pad(idx, (0, k - kk)), F.pad(valid, (0, k - kk))
    return idx.masked_fill(~valid, 0), valid


@torch.no_grad()
def neighbours(hhat: torch.Tensor, hp: AscenderHParams, chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantic top-k N_k(i), j != i, j visible (and in window or global), chunk by chunk.

    hhat: unit h [b, np, s, d_a]. Returns idx [b, np, s, k] (long), valid [b, np, s, k].
    Windowed: each chunk scores a band of keys [c0 - w, c1 + w) plus the globals, O(s * w).
    """
    n, dev = hhat.shape[-2], hhat.device
    out_idx, out_valid = [], []
    for c0, c1 in chunks:
        hq = hhat[..., c0:c1, :]  # [b, np, C, da]
        i = torch.arange(c0, c1, device=dev)[:, None]
        if hp.window == 0:
            hi = c1 if hp.causal else n
            cols = torch.arange(hi, device=dev)
            cand = (cols[None, :] != i) & ((cols[None, :] < i) if hp.causal else True)
            scores = hq @ hhat[..., :hi, :].transpose(-1, -2)
        else:
            lo, hi = max(0, c0 - hp.window), (c1 if hp.causal else min(n, c1 + hp.window))
            band = torch.arange(lo, hi, device=dev)
            glob = torch.arange(min(hp.num_global, n), device=dev)
            cols = torch.cat([band, glob])
            j = cols[None, :]
            in_band = torch.cat(
                [((band[None, :] - i).abs() <= hp.window) & (band[None, :] >= hp.num_global),
                 torch.ones(len(i), len(glob), dtype=torch.bool, device=dev)], dim=1)  # fmt: skip
            cand = in_band & (j != i) & ((j < i) if hp.causal else True)
            scores = torch.cat(
                [hq @ hhat[..., lo:hi, :].transpose(-1, -2), hq @ hhat[..., glob, :].transpose(-1, -2)],
                dim=-1,
            )  # [b, np, C, band + g]
        idx, valid = _topk_masked(scores, cand, cols, hp.k)
        out_idx.append(idx)
        out_valid.append(valid)
    return torch.cat(out_idx, dim=-2), torch.cat(out_valid, dim=-2)


def gather_sum(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over valid slots t of x[idx[..., t]]: [b, np, s, e], one [s, e] gather per slot."""
    total = torch.zeros_like(x)
    e = x.shape[-1]
    for t in range(idx.shape[-1]):
        sel = torch.gather(x, 2, idx[..., t, None].expand(*idx.shape[:-1], e))  # [b, np, s, e]
        total = total + sel * valid[..., t, None]
    return total


def headings(khat, idx, valid, hp: AscenderHParams):
    """u_i = normalise(sum of neighbour khat) and Var_l[khat_l] (total variance) per row.

    For unit vectors the total variance is mean |khat_l|^2 - |mean khat_l|^2.
    """
    count = valid.sum(-1).to(khat.dtype)  # [b, np, s]
    total = gather_sum(khat, idx, valid)  # [b, np, s, hd]
    sq = gather_sum((khat * khat).sum(-1, keepdim=True), idx, valid)[..., 0]  # [b, np, s]
    c1 = count.clamp(min=1)
    spread = (sq / c1 - (total * total).sum(-1) / (c1 * c1)).clamp(min=0)
    return F.normalize(total, dim=-1, eps=hp.eps), spread, count


# ----------------------------------------------------------------------------- moments
class PrefixMoments:
    """Mean and population variance over visible j of p_ij = x_i . y_j, without the n x n p.

    Bidirectional: var = x^T Cov(y) x with the global (centred) covariance. Causal: for the
    chunk [c0, c1), the keys j < c0 enter through a running (count, mean, centred scatter)
    state merged chunk by chunk (Chan et al.), the keys c0 <= j <= i through the in-chunk
    triangle; p is shifted by x . s with s the running mean (or y_0 in chunk 0) so that
    E[p^2] - E[p]^2 does not cancel catastrophically. y: [b, np, s, e].
    """

    def __init__(self, y: torch.Tensor, causal: bool, chunks):
        self.y, self.causal = y, causal
        if not causal:
            self.mean = y.mean(-2, keepdim=True)  # [b, np, 1, e]
            yc = y - self.mean
            self.cov = yc.transpose(-1, -2) @ yc / y.shape[-2]  # [b, np, e, e]
            return
        self.states = []
        count, mean, scatter = 0, None, None
        for c0, c1 in chunks:
            self.states.append((count, mean, scatter))
            yb = y[..., c0:c1, :]
            mb = yb.mean(-2, keepdim=True)  # [b, np, 1, e]
            sb = (yb - mb).transpose(-1, -2) @ (yb - mb)  # [b, np, e, e]
            nb = c1 - c0
            if count == 0:
                mean, scatter = mb, sb
            else:
                delta = mb - mean
                tot = count + nb
                scatter = scatter + sb + delta.transpose(-1, -2) @ delta * (count * nb / tot)
                mean = mean + delta * (nb / tot)
            count += nb

    def state(self, ci: int):
        """Tensors a chunk needs (passed explicitly through checkpoint)."""
        if not self.causal:
            return (self.mean, self.cov)
        count, mean, scatter = self.states[ci]
        return (mean, scatter) if count > 0 else ()

    def row_moments(self, x, state, c0: int, c1: int, y):
        """x: [b, np, C, e] for rows c0..c1-1. Returns mean, var_pop [b, np, C], count [C]."""
        if not self.causal:
            mean, cov = state
            n = y.shape[-2]
            count = torch.full((c1 - c0,), float(n), dtype=x.dtype, device=x.device)
            return (x * mean).sum(-1), ((x @ cov) * x).sum(-1), count
        yb = y[..., c0:c1, :]
        shift = state[0] if state else yb[..., :1, :]  # [b, np, 1, e], causal-safe
        tri = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=x.device).tril()
        p = (x @ (yb - shift).transpose(-1, -2)) * tri  # [b, np, C, C]
        t1, t2 = p.sum(-1), (p * p).sum(-1)
        if state:
            t2 = t2 + ((x @ state[1]) * x).sum(-1)
        count = c0 + torch.arange(1, c1 - c0 + 1, dtype=x.dtype, device=x.device)
        m = t1 / count
        var = (t2 / count - m * m).clamp(min=0)
        return m + (x * shift).sum(-1), var, count


# ----------------------------------------------------------------------------- one chunk
class _Call:
    """Static facts of one call, shared by all chunks (holds no tensor that needs a gradient
    except through the moment helpers, whose tensors are also passed explicitly)."""

    def __init__(self, hp: AscenderHParams, n: int, hd: int, use_sep: bool, with_aux: bool,
                 with_stats: bool):  # fmt: skip
        self.hp, self.n, self.hd, self.use_sep = hp, n, hd, use_sep
        self.want_lsep = with_aux and use_sep and hp.aux_crowding_weight > 0
        self.want_lcoh = with_aux and hp.use_coh and hp.aux_compactness_weight > 0
        self.with_stats = with_stats
        self.align_moments: PrefixMoments | None = None
        self.coh_moments: PrefixMoments | None = None


def _tile_sqdist(zq, zk, c0: int, vis):
    """|z_i - z_j|^2 on the tile [b, np, C, L]: clamped at 0, exactly 0 on the diagonal, +inf
    where j is invisible (so every kernel exp(-d2 / tau) is already 0 there). One pass after
    the matmul: a single torch.where against a precomputed fill."""
    d2 = (zq * zq).sum(-1)[..., :, None] + (zk * zk).sum(-1)[..., None, :] - 2 * zq @ zk.transpose(-1, -2)
    C, L = d2.shape[-2:]
    diag = torch.arange(c0, c0 + C, device=zq.device)[:, None] == torch.arange(L, device=zq.device)
    fill = torch.zeros(C, L, dtype=d2.dtype, device=d2.device).masked_fill(~vis, float("inf"))
    return torch.where(vis & ~diag, d2.clamp(min=0), fill)


def _kernels(call: _Call, d2):
    """(w_sep, w_coh) on the tile; one exp when both taus give the same kernel."""
    hp = call.hp
    ks, kc = hp.kernel_denominator(hp.tau_sep), hp.kernel_denominator(hp.tau_coh)
    w_sep = torch.exp(d2 * (-1.0 / ks)) if call.use_sep else None
    if not hp.use_coh:
        return w_sep, None
    w_coh = w_sep if w_sep is not None and ks == kc else torch.exp(d2 * (-1.0 / kc))
    return w_sep, w_coh


def _align_part(call: _Call, c0, c1, L, t, count, denom, terms, rows):
    """Query columns w_a s_a(i) u_i of the fold; s_a from the prefix moments of u_i . khat_j."""
    hp = call.hp
    head = t["omega"][:, ALIGN].view(1, -1, 1, 1)
    uq = t["u"][..., c0:c1, :]  # [b, np, C, hd]
    g = t["lambdas"][:, ALIGN].view(1, -1, 1) * t["gate_a"][..., c0:c1]
    mean, var, _ = call.align_moments.row_moments(uq, t["align_state"], c0, c1, t["khat"])
    s = row_scale(g, safe_sqrt(var * count / denom), hp)  # [b, np, C]
    rows["align_mean"], rows["align_scale"] = mean, s
    if call.with_stats:
        r = uq @ t["khat"][..., :L, :].transpose(-1, -2)  # [b, np, C, L]
        terms["align"] = head * s[..., None] * (r - mean[..., None])
    return head * s[..., None] * uq


def _coh_part(call: _Call, c0, c1, L, t, w, count, denom, terms, rows):
    """Query columns 2 w_c s_c(i) [c_i, 1] of the fold; c_i and its gate from the kernel tile
    w (0 where invisible)."""
    hp = call.hp
    head = t["omega"][:, COH].view(1, -1, 1, 1)
    zk = t["z"][..., :L, :]
    z2 = t["z2"][..., :L]  # [b, np, L]
    weight = w.sum(-1)  # [b, np, C], >= 1 since w_ii = 1
    # centroid and second moment in one matmul: w @ [z, |z|^2]
    moments = (w @ torch.cat([zk, z2[..., None]], -1)) / weight[..., None]  # [b, np, C, dz + 1]
    c, ez2 = moments[..., :-1], moments[..., -1]
    c2 = (c * c).sum(-1)
    gate = torch.sigmoid(-hp.alpha_coh * (ez2 - c2).clamp(min=0))
    g = t["lambdas"][:, COH].view(1, -1, 1) * gate / hp.tau_coh
    x = torch.cat([c, torch.ones_like(c[..., :1])], -1)  # r_ij = 2 x_i . zy_j - |c_i|^2
    mean_p, var_p, _ = call.coh_moments.row_moments(x, t["coh_state"], c0, c1, t["zy"])
    s = row_scale(g, safe_sqrt(4 * var_p * count / denom), hp)
    mean = 2 * mean_p - c2
    rows["centroid"], rows["gate_coh"], rows["coh_mean"], rows["coh_scale"] = c, gate, mean, s
    if call.with_stats:
        r = -(z2[..., None, :] - 2 * c @ zk.transpose(-1, -2) + c2[..., None])
        terms["coh"] = head * s[..., None] * (r - mean[..., None])
    return head * 2 * s[..., None] * x


def _sep_tile(call: _Call, c0, c1, L, t, w, vis, count, denom, rows):
    """(omega_s * normalised Separation bias / tau_score, phi) on the tile [b, np, C, L], both
    0 where invisible; w is the Separation kernel tile (0 where invisible)."""
    hp = call.hp
    cols = torch.arange(L, device=w.device)[None, :]
    off_diag = (vis & (cols != torch.arange(c0, c1, device=w.device)[:, None])).to(w.dtype)  # [C, L]
    rho = torch.linalg.vecdot(w, off_diag)  # [b, np, C]: sum over l != i (not w.sum - 1: cancels)
    eta = torch.clamp(rho / t["kappa"].view(1, -1, 1), max=1.0)
    hhat = t["hhat"]
    a = hhat[..., c0:c1, :] @ hhat[..., :L, :].transpose(-1, -2)  # [b, np, C, L]
    phi = w * F.relu(a - t["delta"].view(1, -1, 1, 1))
    mu = phi.sum(-1) / count
    dev = phi - mu[..., None]
    if hp.causal:
        dev = dev * vis
    sigma = safe_sqrt(torch.linalg.vecdot(dev, dev) / denom)
    s = row_scale(-t["lambdas"][:, SEP].view(1, -1, 1) * eta, sigma, hp)
    rows["rho"], rows["eta"], rows["sep_mean"], rows["sep_scale"] = rho, eta, mu, s
    factor = t["omega"][:, SEP].view(1, -1, 1) * s / t["tau"].view(1, -1, 1)  # [b, np, C]
    return factor[..., None] * dev, phi


def _chunk_queries(call: _Call, c0: int, c1: int, t: dict):
    """Everything of query rows [c0, c1) except the attention itself: the folded queries
    q_aug [b, np, C, e], the additive tile bias (Separation + other, already / tau_score,
    -inf where invisible) [b, np, C, L] or None, the visibility [C, L], row statistics, and
    the explicit bias tiles (not / tau) when stats are wanted."""
    hp, dev_ = call.hp, t["q"].device
    L = c1 if hp.causal else call.n  # keys this chunk can see
    vis = tile_visibility(c0, c1, L, hp.causal, dev_)  # [C, L]
    count = vis.sum(-1).to(t["q"].dtype)  # [C]
    denom = variance_denominator(count, hp)
    tau = t["tau"].view(1, -1, 1, 1)
    rows, terms = {}, {}
    q_c = t["q"][..., c0:c1, :]
    parts = [q_c / math.sqrt(call.hd)]
    if hp.use_align:
        parts.append(_align_part(call, c0, c1, L, t, count, denom, terms, rows))
    if call.use_sep or hp.use_coh:
        d2 = _tile_sqdist(t["z"][..., c0:c1, :], t["z"][..., :L, :], c0, vis)  # [b, np, C, L]
        w_sep, w_coh = _kernels(call, d2)
    if hp.use_coh:
        parts.append(_coh_part(call, c0, c1, L, t, w_coh, count, denom, terms, rows))
    bias = None
    if call.use_sep:
        bias, rows["phi"] = _sep_tile(call, c0, c1, L, t, w_sep, vis, count, denom, rows)
        if call.with_stats:
            terms["sep"] = bias.detach() * tau
    if hp.other_bias == "alibi":
        dist = (torch.arange(c0, c1, device=dev_)[:, None] - torch.arange(L, device=dev_)).abs()
        other = -t["slope"].view(1, -1, 1, 1) * dist.to(q_c.dtype)  # [1, np, C, L]
        bias = other / tau if bias is None else bias + other / tau
        if call.with_stats:
            terms["other"] = other
    if hp.causal:
        neg = torch.zeros(vis.shape, dtype=q_c.dtype, device=dev_).masked_fill(~vis, NEG_INF)
        bias = neg if bias is None else bias + neg  # -inf only after / tau: no inf * 0 in grads
    q_aug = torch.cat(parts, -1) / tau  # [b, np, C, hd + extra]
    return q_aug, bias, vis, rows, terms


def _chunk(call: _Call, c0: int, c1: int, t: dict):
    """Output rows [c0, c1) ([b, np, C, hd]), their row statistics, and (with_stats) the
    per-head sums over rows of the mass each bias moves."""
    q_aug, mask, vis, rows, terms = _chunk_queries(call, c0, c1, t)
    L = vis.shape[-1]
    ka, va = t["k_aug"][..., :L, :], t["v_aug"][..., :L, :]
    phi = rows.pop("phi", None)
    if call.want_lsep:  # the crowding loss needs the attention probabilities themselves
        A = torch.softmax(q_aug @ ka.transpose(-1, -2) + mask, -1)  # [b, np, C, L]
        out = A @ va
        rows["lsep"] = (A * phi).sum(-1)
    else:
        out = F.scaled_dot_product_attention(q_aug, ka, va, attn_mask=mask, scale=1.0)
    if call.want_lcoh:  # E_{j~A_i}|z_j - c_i|^2 from the value columns [z, |z|^2]
        c, ez, ez2 = rows["centroid"], out[..., call.hd : -1], out[..., -1]
        rows["lcoh"] = ez2 - 2 * (c * ez).sum(-1) + (c * c).sum(-1)
    moved = {}
    if call.with_stats:
        with torch.no_grad():
            tau = t["tau"].view(1, -1, 1, 1)
            q_c = t["q"][..., c0:c1, :]
            S = q_c @ t["k_aug"][..., :L, : call.hd].transpose(-1, -2) / math.sqrt(call.hd)
            S = S + sum(terms.values())
            terms.pop("other", None)  # part of the base for "all", not a moved bias
            moved = mass_moved(S, {k_: v_.detach() for k_, v_ in terms.items()}, vis, tau)
            moved = {k_: v_ * (c1 - c0) for k_, v_ in moved.items()}
    return out[..., : call.hd], rows, moved


def _needs_checkpoint(tensors: dict) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in tensors.values()
    )


def prepare(q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
            with_aux: bool, with_stats: bool):  # fmt: skip
    """Whole-sequence O(s) work: neighbours, headings, gates, moment states, k_aug / v_aug.

    Returns (call, t, chunks, rows) where t holds the tensors every chunk reads."""
    b, nh, n, hd = q.shape
    chunks = chunk_bounds(n, b * nh, hp)
    call = _Call(hp, n, hd, use_sep, with_aux, with_stats)
    hhat = F.normalize(h, dim=-1, eps=hp.eps)
    khat = F.normalize(k, dim=-1, eps=hp.eps)
    idx, valid = neighbours(hhat.detach(), hp, chunks)  # [b, np, s, k]
    rows = {"neighbour_idx": idx, "neighbour_valid": valid}
    t = dict(q=q, z=z, z2=(z * z).sum(-1), hhat=hhat, khat=khat, omega=params.omega, lambdas=params.lambdas,
             delta=params.delta, kappa=params.kappa, tau=params.tau_score, slope=params.alibi_slope)  # fmt: skip
    k_parts = [k]
    if hp.use_align:
        u, spread, _ = headings(khat, idx, valid, hp)  # [b, np, s, hd], [b, np, s]
        t["u"], t["gate_a"] = u, torch.sigmoid(-hp.alpha_align * spread)
        rows["u"], rows["gate_align"] = u, t["gate_a"]
        call.align_moments = PrefixMoments(khat, hp.causal, chunks)
        k_parts.append(khat)
    if hp.use_coh:
        zy = torch.cat([z, -0.5 * (z * z).sum(-1, keepdim=True)], -1)  # [b, np, s, dz + 1]
        t["zy"] = zy
        call.coh_moments = PrefixMoments(zy, hp.causal, chunks)
        k_parts.append(zy)
    t["k_aug"] = torch.cat(k_parts, -1)  # [b, np, s, hd (+ hd) (+ dz + 1)]
    t["v_aug"] = torch.cat([v, z, (z * z).sum(-1, keepdim=True)], -1) if call.want_lcoh else v
    return call, t, chunks, rows


def run_chunks(fn, call: _Call, t: dict, chunks):
    """Apply fn(call, c0, c1, t) to every chunk, under checkpointing when gradients flow, so
    backward recomputes one chunk's tiles at a time instead of keeping all of them."""
    results = []
    for ci, (c0, c1) in enumerate(chunks):
        if call.align_moments is not None:
            t["align_state"] = call.align_moments.state(ci)
        if call.coh_moments is not None:
            t["coh_state"] = call.coh_moments.state(ci)
        if _needs_checkpoint(t):
            results.append(checkpoint(fn, call, c0, c1, dict(t), use_reentrant=False))
        else:
            results.append(fn(call, c0, c1, dict(t)))
    return results


def merge_rows(rows: dict, chunk_rows: list[dict]) -> dict:
    """Concatenate per-chunk row statistics along the sequence dim."""
    for key in chunk_rows[0]:
        rows[key] = torch.cat([r[key] for r in chunk_rows], dim=2)
    return rows


def fast_attention(
    q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
    with_aux: bool = False, with_stats: bool = False,
) -> AscenderResult:  # fmt: skip
    """ASCender attention in O(s * (window + chunk)) memory. Same result as reference_attention
    (out [b, np, s, hd]; rows: per-row statistics; stats: per-head mass moved; aux losses), no maps."""
    n = q.shape[-2]
    call, t, chunks, rows = prepare(
        q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=with_aux, with_stats=with_stats
    )
    results = run_chunks(_chunk, call, t, chunks)
    out = torch.cat([r[0] for r in results], -2)  # [b, np, s, hd]
    rows = merge_rows(rows, [r[1] for r in results])
    stats = {}
    for _, _, moved in results:
        for key, val in moved.items():
            stats[key] = stats.get(key, 0) + val / n
    aux = _aux(rows, t.get("u"), rows["neighbour_idx"], rows["neighbour_valid"], hp, call) if with_aux else {}
    return AscenderResult(out=out, rows=rows, stats=stats, aux=aux)


def _aux(rows, u, idx, valid, hp: AscenderHParams, call: _Call):
    """Section 8 losses from the streamed per-row pieces (same definitions as the reference)."""
    aux = {}
    if call.want_lcoh:
        aux["compactness"] = rows.pop("lcoh").mean()
    if call.want_lsep:
        aux["crowding"] = rows.pop("lsep").mean()
    if hp.aux_alignment_weight > 0 and u is not None:
        count = valid.sum(-1)
        u_bar = gather_sum(u, idx, valid) / count.clamp(min=1)[..., None].to(u.dtype)
        aux["alignment"] = ((1 - (u * u_bar).sum(-1)) * (count > 0)).mean()
    weights = {
        "compactness": hp.aux_compactness_weight,
        "crowding": hp.aux_crowding_weight,
        "alignment": hp.aux_alignment_weight,
    }
    aux["total"] = sum(weights[k] * v for k, v in aux.items())
    return aux
