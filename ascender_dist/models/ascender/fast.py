"""ASCender attention without any n x n tensor per head: memory O(s * (window + chunk)).

Same inputs and outputs as ``reference.py`` (q, k, v: [b, np, s, hd]; z: [b, np, s, d_z];
h: [b, np, s, d_a]) and the same math, rearranged (docs/ascender.md, "Fast path"):

* Alignment and Cohesion are bilinear in a per-query and a per-key vector, so they fold into
  the attention scores (shared/design/ascender-math.md section 2): one GEMM per folded part,
  q_i . k_j, (w_a s_a(i) u_i) . khat_j and (2 w_c s_c(i) y_i) . Zr_j, accumulated into one
  tile; no concatenated key tensor is ever built. Their row means are row constants (softmax
  ignores them) and their row stds come from the covariance of the keys over the visible
  positions: a global covariance (bidirectional) or running states every MOMENT_STRIDE rows
  plus the keys since the last state (causal). No statistic of row i reads a key j > i.
* Separation (not low-rank), the densities rho_i, the centroids c_i and the row statistics of
  Separation are built per query chunk on a [chunk, keys] tile from two augmented operands
  (Zr, Hr: a distance and a thresholded affinity are one GEMM each). One autograd.Function
  (_FusedChunks) takes the raw inputs, derives every whole-sequence operand itself in forward
  and again in backward, keeps no tile and nothing derived, and differentiates the tile math by
  hand, one chunk at a time, with the O(chunk) per-row algebra re-run under autograd.
* Neighbourhoods (no gradient flows through the choice of neighbours) are found chunk by
  chunk over a band of +-window keys plus the globals (O(s * window)), or over all visible
  keys when window == 0 (O(s * chunk) memory).

The GPU path is the Triton kernels in ``kernels/``, which reuse the operand and row helpers here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import row_scale, safe_sqrt, variance_denominator
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
def search_vectors(q, k, h, hp: AscenderHParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(query-side, key-side) vectors whose dot products N_k(i) ranks, detached: unit h for
    the affinity, (q / sqrt(d), k) for the base scores (hp.neighbour_source)."""
    if hp.neighbour_source == "affinity":
        hhat = F.normalize(h.detach(), dim=-1, eps=hp.eps)
        return hhat, hhat
    return q.detach() / math.sqrt(q.shape[-1]), k.detach()


@torch.no_grad()
def neighbours(xq: torch.Tensor, xk: torch.Tensor, hp: AscenderHParams, chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k N_k(i) of xq_i . xk_j over j != i, j visible (and in window or global), chunk by
    chunk (search_vectors gives xq, xk).

    xq, xk: [b, np, s, e]. Returns idx [b, np, s, k] (long), valid [b, np, s, k].
    Windowed: each chunk scores a band of keys [c0 - w, c1 + w) plus the globals, O(s * w).
    """
    n, dev = xk.shape[-2], xk.device
    out_idx, out_valid = [], []
    for c0, c1 in chunks:
        hq = xq[..., c0:c1, :]  # [b, np, C, e]
        i = torch.arange(c0, c1, device=dev)[:, None]
        if hp.window == 0:
            hi = c1 if hp.causal else n
            cols = torch.arange(hi, device=dev)
            cand = (cols[None, :] != i) & ((cols[None, :] < i) if hp.causal else True)
            scores = hq @ xk[..., :hi, :].transpose(-1, -2)
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
                [hq @ xk[..., lo:hi, :].transpose(-1, -2), hq @ xk[..., glob, :].transpose(-1, -2)],
                dim=-1,
            )  # [b, np, C, band + g]
        idx, valid = _topk_masked(scores, cand, cols, hp.k)
        out_idx.append(idx)
        out_valid.append(valid)
    return torch.cat(out_idx, dim=-2), torch.cat(out_valid, dim=-2)


def gather_sum(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over valid slots t of x[idx[..., t]]: [b, np, s, e], one [s, e] row gather per slot.

    Rows are picked with index_select from x flattened to [b*np*s + 1, e], whose extra last row
    is 0 and stands for invalid slots (no mask multiply; backward is a row-wise index_add)."""
    b, nh, n, e = x.shape
    flat = torch.cat([x.reshape(b * nh * n, e), x.new_zeros(1, e)])
    base = (torch.arange(b * nh, device=x.device) * n).view(b, nh, 1)
    pos = torch.where(valid, idx + base[..., None], b * nh * n)  # [b, np, s, k]
    total = None
    for t in range(idx.shape[-1]):
        sel = flat.index_select(0, pos[..., t].reshape(-1))
        total = sel if total is None else total + sel
    if total is None:
        return torch.zeros_like(x)
    return total.view(b, nh, n, e)


def headings(khat, idx, valid, hp: AscenderHParams):
    """u_i = normalise(sum of neighbour khat) and Var_l[khat_l] (total variance) per row.

    For unit vectors the total variance is mean |khat_l|^2 - |mean khat_l|^2.
    """
    count = valid.sum(-1).to(khat.dtype)  # [b, np, s]
    total = gather_sum(khat, idx, valid)  # [b, np, s, hd]
    sq = gather_sum((khat * khat).sum(-1, keepdim=True), idx, valid)[..., 0]  # [b, np, s]
    return (*heading_from_sums(total, sq, count, hp), count)


def heading_from_sums(total, sq, count, hp: AscenderHParams):
    """u = normalise(total) and the total variance of the neighbours' unit keys, from their
    sum ``total`` [.., hd], the sum of their squared norms ``sq`` and their number ``count``."""
    c1 = count.clamp(min=1)
    spread = (sq / c1 - (total * total).sum(-1) / (c1 * c1)).clamp(min=0)
    return F.normalize(total, dim=-1, eps=hp.eps), spread


# ----------------------------------------------------------------------------- one chunk
class _Call:
    """Static facts of one call, shared by all chunks (holds no tensor)."""

    def __init__(self, hp: AscenderHParams, n: int, hd: int, use_sep: bool, with_aux: bool,
                 with_stats: bool):  # fmt: skip
        self.hp, self.n, self.hd, self.use_sep = hp, n, hd, use_sep
        self.want_lsep = with_aux and use_sep and hp.aux_crowding_weight > 0
        self.want_lcoh = with_aux and hp.use_coh and hp.aux_compactness_weight > 0
        self.with_stats = with_stats


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


# ----------------------------------------------------------------------------- fused path
# One autograd.Function runs every query chunk from the raw inputs (q, k, v, z, h and the
# per-head parameters): it derives the key-side operands itself, keeps no tile and no derived
# whole-sequence tensor for backward (only the inputs, the output, the neighbour indices and
# O(s) row statistics), and backward derives the operands again, recomputes one chunk's tiles
# at a time and back-propagates through them by hand (the Separation tile, the kernels and the
# attention, FlashAttention-style). The O(chunk) per-row algebra between them (headings from the
# gathered neighbours, row scales, gates, eta, centroids, the folded queries) is re-run under
# autograd. Gradients of whole-sequence operands accumulate in place into one buffer each
# (slicing a full-size tensor per chunk would allocate a full-size gradient per chunk).
#
# The folded scores are never formed from a concatenated [s, hd + hd + dz + 2] key tensor:
# S accumulates q'_i . k_j, (w_a s_a u_i) . khat_j and (2 w_c s_c y_i) . Zr_j with one GEMM
# each into the same tile, so the only key-side operands are khat and Zr (below), which the
# Separation tile needs anyway.
#
# Geometry operands, one row per key, shared by the folds and the tiles:
#     Zr_j = [s z_j, 1, -a |z_j|^2],  Zl_i = perm(Zr_i) = [s z_i, -a |z_i|^2, 1]   (s^2 = 2a)
#         Zl_i . Zr_j = -a |z_i - z_j|^2           (a = 1 / kernel denominator)
#     Hr_j = [hhat_j, 1, -delta / 2],  Hl_i = perm(Hr_i)
#         Hl_i . Hr_j = hhat_i . hhat_j - delta    (the thresholded affinity before relu)
# perm swaps the last two columns, so a gradient with respect to the right factor, written as
# sum_i g_ij perm(left_i) = sum_i g_ij right_i, lands in the left factor's layout: both sides
# of a tile accumulate into one buffer per operand, using the right factor only.
#
# Tiles are [B, C, L] with B = b * np, C query rows [c0, c1) and L keys [0, L). Every key
# j < c0 is visible to every row of a causal chunk, so the only masked / diagonal entries lie
# in the [C, C] block of columns [c0, c1): masks never touch the rest of the tile.

MOMENT_STRIDE = 256  # rows between two causal moment states of the fused path
LOG2E = 1.0 / math.log(2.0)


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place, as exp2(x log2 e): torch's CPU exp2 kernel takes less than half the time
    of its exp on a tile here (docs/ascender.md, Cost); exp2(0) = 1 and exp2(-inf) = 0 exactly,
    as exp; the product's rounding moves w by < 4e-6 relative (float32) at the lower clamp."""
    return x.mul_(LOG2E).exp2_()


def moment_chunks(n: int) -> list[tuple[int, int]]:
    return [(s0, min(s0 + MOMENT_STRIDE, n)) for s0 in range(0, n, MOMENT_STRIDE)]


def _swap_last_two(x: torch.Tensor) -> torch.Tensor:
    """perm above: the last two columns exchanged (a copy of an O(chunk) operand)."""
    return torch.cat([x[..., :-2], x[..., -1:], x[..., -2:-1]], -1)


def _normalize_backward_(x: torch.Tensor, xhat: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """Gradient with respect to x of xhat = x / max(|x|, eps) given g = dL/dxhat (F.normalize),
    computed in place into g (a whole-sequence buffer: no full-size temporary)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    radial = torch.linalg.vecdot(xhat, g)[..., None].masked_fill_(norm <= eps, 0.0)
    return g.addcmul_(xhat, radial, value=-1.0).div_(norm.clamp_(min=eps))


def _count_denom(c0: int, c1: int, L: int, hp: AscenderHParams, dtype, device):
    """Visible keys per row [C] and the variance denominator [C]."""
    if hp.causal:
        count = torch.arange(c0 + 1, c1 + 1, dtype=dtype, device=device)
    else:
        count = torch.full((c1 - c0,), float(L), dtype=dtype, device=device)
    return count, variance_denominator(count, hp)


def _moment_states(y3: torch.Tensor, causal: bool, starts: list[int]) -> list[tuple]:
    """Moment states of the keys y3 [B, s, e] for _row_moments_chunk.

    Causal: entry i holds (mean [B, 1, e], centred scatter [B, e, e]) of the keys
    j < starts[i] (() when starts[i] == 0), merged block by block (Chan et al.).
    Bidirectional: one entry, (mean, covariance) over all keys. The fused path calls it without
    autograd and differentiates it in closed form (_moment_states_backward)."""
    n = y3.shape[1]
    if not causal:
        mean = y3.mean(1, keepdim=True)
        yc = y3 - mean
        return [(mean, yc.transpose(1, 2) @ yc / n)]
    states, count, mean, scatter = [], 0, None, None
    for s0, s1 in zip(starts, list(starts[1:]) + [n]):
        states.append((mean, scatter) if count else ())
        if s1 == n:
            break  # the last block feeds no state
        yb = y3[:, s0:s1]
        mb = yb.mean(1, keepdim=True)
        yc = yb - mb
        sb = yc.transpose(1, 2) @ yc
        nb = s1 - s0
        if count == 0:
            mean, scatter = mb, sb
        else:
            delta = mb - mean
            tot = count + nb
            scatter = scatter + sb + delta.transpose(1, 2) @ delta * (count * nb / tot)
            mean = mean + delta * (nb / tot)
        count += nb
    return states


def _moment_states_backward(y3, states, grads: dict, causal: bool, gy3: torch.Tensor, swap: bool = False) -> None:
    """Add to gy3 [B, s, e] the gradient reaching the keys through the moment states.

    For a state over keys j < c with mean m and scatter M = sum_j (y_j - m)(y_j - m)^T:
    dL/dy_j = (G + G^T)(y_j - m) + g_m / c, with G = dL/dM, g_m = dL/dm (the path through m
    inside M vanishes: sum_j (y_j - m) = 0). Key block r feeds every state si > r, so the
    (G + G^T) and the offsets are summed from the last stride backwards: O(s e^2). swap: gy3 is
    kept in the left layout of Zr (_swap_last_two), one block at a time."""
    n = y3.shape[1]
    if not grads:
        return
    if not causal:
        g_mean, g_cov = grads[0]
        mean = states[0][0]
        grad = torch.zeros_like(mean) if g_mean is None else g_mean / n
        if g_cov is not None:
            grad = torch.baddbmm(grad, y3 - mean, g_cov + g_cov.transpose(1, 2), alpha=1.0 / n)
        gy3.add_(_swap_last_two(grad) if swap else grad)
        return
    acc = offset = None
    blocks = moment_chunks(n)
    for r in reversed(range(len(blocks))):
        if r + 1 in grads:
            g_mean, g_scatter = grads[r + 1]
            mean = states[r + 1][0]
            sym = g_scatter + g_scatter.transpose(1, 2) if g_scatter is not None else torch.zeros_like(states[r + 1][1])
            off = mean @ sym
            if g_mean is not None:
                off = off - g_mean / ((r + 1) * MOMENT_STRIDE)
            acc = sym if acc is None else acc + sym
            offset = off if offset is None else offset + off
        if acc is not None:
            s0, s1 = blocks[r]
            grad = torch.baddbmm(-offset, y3[:, s0:s1], acc)
            gy3[:, s0:s1] += _swap_last_two(grad) if swap else grad


def _row_moments_chunk(causal: bool, x, state, yb, c0: int, s0: int):
    """Mean and population variance over visible keys j of p_ij = x_i . y_j for query rows
    [c0, c1), without the [C, s] p: from the state of the keys j < s0 (s0 <= c0: states are
    kept every MOMENT_STRIDE rows only, so their number, each e x e, stays small at long s)
    plus the keys yb = y[s0:c1] themselves (an autograd leaf in backward); the p are shifted by
    the state mean so that E[p^2] - E[p]^2 does not cancel. Returns (mean, var_pop), [b, np, C]."""
    if not causal:
        mean, cov = state
        return (x * mean).sum(-1), ((x @ cov) * x).sum(-1)
    C = x.shape[-2]
    shift = state[0] if state else yb[..., :1, :]
    keys = torch.arange(s0, s0 + yb.shape[-2], device=x.device)
    vis = keys[None, :] <= torch.arange(c0, c0 + C, device=x.device)[:, None]  # [C, c1 - s0]
    p = (x @ (yb - shift).transpose(-1, -2)) * vis
    t1, t2 = p.sum(-1), (p * p).sum(-1)
    if state:
        t2 = t2 + ((x @ state[1]) * x).sum(-1)
    count = c0 + torch.arange(1, C + 1, dtype=x.dtype, device=x.device)
    m = t1 / count
    var = (t2 / count - m * m).clamp(min=0)
    return m + (x * shift).sum(-1), var


class _Spec:
    """Static description of one fused call (chunks, names of the row outputs and statistics)."""

    def __init__(self, call: _Call, chunks):
        self.call, self.chunks = call, chunks
        self.row_keys: list[str] = []
        self.stat_keys: list[str] = []
        self.moved: dict = {}


def _operands(call: _Call, q, k, v, z, h, delta, tau, slope) -> dict:
    """The whole-sequence operands every chunk reads, O(s) each, derived from the inputs in
    forward and again in backward (nothing derived is kept in between): 4-d views of the
    inputs, [B, s, e] GEMM operands (k3, khat3, Zr, Hr, v_aug3) and the moment states."""
    hp = call.hp
    b, nh, n, hd = q.shape
    B = b * nh
    t = dict(q=q, z=z, h=h, k=k, k3=k.reshape(B, n, hd))
    starts = [s0 for s0, _ in moment_chunks(n)]
    if call.want_lcoh:  # the value columns of L_coh: sum_j A_ij [z_j, |z_j|^2]
        t["v_aug3"] = torch.cat([v, z, (z * z).sum(-1, keepdim=True)], -1).reshape(B, n, -1)
    else:
        t["v_aug3"] = v.reshape(B, n, hd)
    if hp.use_align:
        t["khat3"] = F.normalize(t["k3"], dim=-1, eps=hp.eps)
        t["khat_sq"] = torch.linalg.vecdot(t["khat3"], t["khat3"])  # [B, s]: 1 unless |k| < eps
        t["align_states"] = _moment_states(t["khat3"], hp.causal, starts)
    if call.use_sep or hp.use_coh:
        ks, kc = hp.kernel_denominator(hp.tau_sep), hp.kernel_denominator(hp.tau_coh)
        k_main = ks if call.use_sep else kc
        t["a"] = a = 1.0 / k_main
        t["s"] = math.sqrt(2 * a)
        t["ratio"] = k_main / kc if (call.use_sep and hp.use_coh and kc != ks) else 1.0
        z3 = z.reshape(B, n, -1)
        t["Zr"] = torch.cat([t["s"] * z3, torch.ones_like(z3[..., :1]), -a * (z3 * z3).sum(-1, keepdim=True)], -1)
    if hp.use_coh:
        t["coh_states"] = _moment_states(t["Zr"], hp.causal, starts)
    if call.use_sep:
        h3 = h.reshape(B, n, -1)
        hhat = F.normalize(h3, dim=-1, eps=hp.eps)  # kept only inside Hr
        half = (-0.5 * delta).repeat(b).view(B, 1, 1).expand(B, n, 1)
        t["Hr"] = torch.cat([hhat, torch.ones_like(hhat[..., :1]), half], -1)
    if hp.other_bias == "alibi":
        t["slope_tau_b"] = (slope / tau).repeat(b)
    return t


def _tiles(call: _Call, c0: int, c1: int, L: int, t: dict, keep: bool, saved: dict | None = None):
    """Kernel / Separation tiles of rows [c0, c1) x keys [0, L) and their row statistics.

    Returns (stats, tiles). stats (per row, [b, np, C(, e)]; only when saved is None):
    rho, mu, var (Separation), mom = sum_l w_il Zr_l = [s sum w z, sum w, -a sum w |z|^2]
    (Cohesion, l = i included). tiles: dev = phi - mu on visible entries (0 elsewhere) and,
    with keep, what backward needs. saved: the stats of the forward pass (backward).
    The scaled squared distance and the thresholded affinity are one GEMM each (see above)."""
    hp = call.hp
    if not (call.use_sep or hp.use_coh):
        return {}, {}
    b, nh = t["q"].shape[:2]
    B, C = b * nh, c1 - c0
    Zr = t["Zr"]
    use_coh = hp.use_coh
    ks, kc = hp.kernel_denominator(hp.tau_sep), hp.kernel_denominator(hp.tau_coh)
    x = torch.bmm(_swap_last_two(Zr[:, c0:c1]), Zr[:, :L].transpose(1, 2))  # -|z_i - z_j|^2 / k_main
    clamped = (x > 0) if keep else None  # |z_i - z_j|^2 < 0 by rounding: clamped, no gradient
    ratio = t["ratio"]
    # Lower clamp: exp of arguments in [-104, -87] (float32) lands in the denormals and is ~30x
    # slower than elsewhere; clamping there changes w by < 2e-38 (float32), 3e-308 (float64).
    lo = math.log(torch.finfo(x.dtype).tiny) * 0.999 / max(1.0, ratio)
    x.clamp_(min=lo, max=0)
    blk = x[:, :, c0:c1]  # the [C, C] block holding the diagonal (and the causal triangle)
    blk.diagonal(dim1=1, dim2=2).fill_(0.0)  # d_ii = 0 exactly
    upper = None
    if hp.causal and C > 1:
        upper = torch.ones(C, C, dtype=torch.bool, device=x.device).triu(1)
        blk.masked_fill_(upper, NEG_INF)  # invisible: every kernel exactly 0
    w_sep = w_coh = None
    if ratio != 1.0:
        w_coh = _exp_(x * ratio)
    w = _exp_(x)
    if call.use_sep:
        w_sep = w
        if use_coh and kc == ks:
            w_coh = w
    else:
        w_coh = w
    stats, tiles = {}, {}
    if use_coh and (saved is None or "mom" not in saved):  # not kept for backward: one GEMM again
        stats["mom"] = torch.bmm(w_coh, Zr[:, :L]).view(b, nh, C, -1)
    if call.use_sep:
        if saved is None:
            dg = w_sep[:, :, c0:c1].diagonal(dim1=1, dim2=2)
            dg.fill_(0.0)
            stats["rho"] = w_sep.sum(-1).view(b, nh, C)  # sum over visible l != i (no 1 - 1 cancelling)
            dg.fill_(1.0)
        Hr = t["Hr"]
        r = torch.bmm(_swap_last_two(Hr[:, c0:c1]), Hr[:, :L].transpose(1, 2))
        r.clamp_(min=0)  # relu(a - delta)
        phi = r * w_sep if keep else r.mul_(w_sep)
        if saved is None:
            count, denom = _count_denom(c0, c1, L, hp, x.dtype, x.device)
            mu = phi.sum(-1) / count  # [B, C]
        else:
            mu = saved["mu"].reshape(B, C)
        dev = phi.sub_(mu[:, :, None])
        if upper is not None:
            dev[:, :, c0:c1].masked_fill_(upper, 0.0)
        if saved is None:
            stats["mu"] = mu.view(b, nh, C)
            stats["var"] = (torch.linalg.vecdot(dev, dev) / denom).view(b, nh, C)
        tiles["dev"] = dev
        if keep:
            tiles.update(r=r, w_sep=w_sep)
    if keep:
        tiles.update(clamped=clamped, w_coh=w_coh, upper=upper)
    return stats, tiles


def _neighbour_sums(t: dict, c0: int, c1: int):
    """For rows [c0, c1): sum of the valid neighbours' khat [b, np, C, hd] and of their |khat|^2
    [b, np, C] (embedding_bag with 0/1 weights: the [C, k, hd] gather is never formed), plus the
    flat row positions [b, np, C, k] and weights that backward scatters through."""
    idx, valid, khat3 = t["idx"], t["valid"][..., c0:c1, :], t["khat3"]
    b, nh, _, kk = idx.shape
    pos = _index_rows(idx, c0, c1, khat3.shape[1])  # [b, np, C, k]
    weight = valid.to(khat3.dtype)
    total = F.embedding_bag(pos.reshape(-1, kk), khat3.reshape(-1, khat3.shape[-1]), mode="sum",
                            per_sample_weights=weight.reshape(-1, kk))  # fmt: skip
    sq = (t["khat_sq"].reshape(-1)[pos] * weight).sum(-1)
    return total.view(b, nh, c1 - c0, -1), sq, pos, weight


def _index_rows(idx, c0: int, c1: int, n: int) -> torch.Tensor:
    """Rows of the flattened [B * s, e] operand that the neighbour slots of rows [c0, c1) read."""
    b, nh = idx.shape[:2]
    base = (torch.arange(b * nh, device=idx.device) * n).view(b, nh, 1, 1)
    return idx[..., c0:c1, :] + base  # [b, np, C, k]


def _rows(call: _Call, c0: int, c1: int, L: int, x: dict):
    """Per-row algebra of one chunk ([b, np, C]-sized tensors only): the folded query parts
    [(key operand name, [B, C, e] already / tau_score)], the Separation row factor
    omega_s s_i / tau (or None) and the row statistics."""
    hp = call.hp
    b, nh, C, _ = x["q"].shape
    B = b * nh
    count, denom = _count_denom(c0, c1, L, hp, x["q"].dtype, x["q"].device)
    tau = x["tau"].view(1, -1, 1, 1)
    omega, lambdas = x["omega"], x["lambdas"]
    rows = {}
    parts = [("k3", x["q"] / (math.sqrt(call.hd) * tau))]
    if hp.use_align:
        uq, spread = heading_from_sums(x["ktot"], x["ksq"], x["nweight"].sum(-1), hp)
        gate_a = torch.sigmoid(-hp.alpha_align * spread)
        g = lambdas[:, ALIGN].view(1, -1, 1) * gate_a
        mean, var = _row_moments_chunk(hp.causal, uq, x["align_state"], x["khat"], c0, x["s0"])
        s = row_scale(g, safe_sqrt(var * count / denom), hp)
        rows["u"], rows["gate_align"], rows["align_mean"], rows["align_scale"] = uq, gate_a, mean, s
        parts.append(("khat3", omega[:, ALIGN].view(1, -1, 1, 1) * s[..., None] * uq / tau))
    if hp.use_coh:
        sz, a = x["s_z"], x["a"]
        mom = x["mom"]  # [s sum w z, sum w, -a sum w |z|^2]
        mass = mom[..., -2:-1]  # >= 1 (w_ii = 1)
        c = mom[..., :-2] / (sz * mass)
        ez2 = -mom[..., -1] / (a * mass[..., 0])
        c2 = (c * c).sum(-1)
        gate = torch.sigmoid(-hp.alpha_coh * (ez2 - c2).clamp(min=0))
        g = lambdas[:, COH].view(1, -1, 1) * gate / hp.tau_coh
        # y_i . Zr_j = c_i . z_j - |z_j|^2 / 2 =: p_ij, and r_coh_ij = 2 p_ij - |c_i|^2
        y = torch.cat([c / sz, torch.zeros_like(c[..., :1]), torch.full_like(c[..., :1], 0.5 / a)], -1)
        mean_p, var_p = _row_moments_chunk(hp.causal, y, x["coh_state"], x["Zr"], c0, x["s0"])
        s = row_scale(g, safe_sqrt(4 * var_p * count / denom), hp)
        rows["centroid"], rows["gate_coh"], rows["coh_mean"], rows["coh_scale"] = c, gate, 2 * mean_p - c2, s
        parts.append(("Zr", omega[:, COH].view(1, -1, 1, 1) * 2 * s[..., None] * y / tau))
    factor = None
    if call.use_sep:
        eta = torch.clamp(x["rho"] / x["kappa"].view(1, -1, 1), max=1.0)
        s = row_scale(-lambdas[:, SEP].view(1, -1, 1) * eta, safe_sqrt(x["var"]), hp)
        rows["rho"], rows["eta"], rows["sep_mean"], rows["sep_scale"] = x["rho"], eta, x["mu"], s
        factor = omega[:, SEP].view(1, -1, 1) * s / tau[..., 0]
    return [(key, p.reshape(B, C, -1)) for key, p in parts], factor, rows


def _alibi_tile(c0: int, c1: int, L: int, dtype, device):
    return (torch.arange(c0, c1, device=device)[:, None] - torch.arange(L, device=device)).abs().to(dtype)


def _scores(call: _Call, c0, c1, L, t, parts, factor, dev, keep_dev: bool):
    """S = sum over parts of q_part k_part^T + omega_s s_i dev_ij / tau (+ ALiBi / tau), -inf
    where invisible; one GEMM per folded part, accumulated in place."""
    hp = call.hp
    S = None
    if factor is not None:
        f = factor.reshape(-1, c1 - c0, 1)
        S = dev * f if keep_dev else dev.mul_(f)
    for key, qp in parts:
        kT = t[key][:, :L].transpose(1, 2)
        S = torch.bmm(qp, kT) if S is None else S.baddbmm_(qp, kT)
    if hp.other_bias == "alibi":
        S.sub_(_alibi_tile(c0, c1, L, S.dtype, S.device) * t["slope_tau_b"][:, None, None])
    if hp.causal and c1 - c0 > 1:
        S[:, :, c0:c1].masked_fill_(torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=S.device).triu(1),
                                    NEG_INF)  # fmt: skip
    return S


SMALL = ("omega", "lambdas", "kappa", "tau")


def _row_inputs(call: _Call, c0: int, c1: int, t: dict, stats: dict, leaf: bool):
    """Inputs of _rows for one chunk; with leaf, detached copies that require grad (the
    per-head parameters: the shared leaves t['leaf_*'])."""
    hp = call.hp
    b, nh = t["q"].shape[:2]
    si = c0 // MOMENT_STRIDE if hp.causal else 0  # moment state index, keys j < s0 in it
    s0 = si * MOMENT_STRIDE if hp.causal else c0
    x = {"q": t["q"][..., c0:c1, :]}
    for key in SMALL:
        x[key] = t["leaf_" + key] if leaf else t[key]
    as4 = lambda y: y.view(b, nh, *y.shape[1:])  # noqa: E731  [B, ...] -> [b, np, ...]
    if hp.use_align:
        x["ktot"], x["ksq"], x["npos"], x["nweight"] = _neighbour_sums(t, c0, c1)
        x["khat"] = as4(t["khat3"][:, s0:c1])
        x["align_state"] = tuple(as4(s_) for s_ in t["align_states"][si])
    if hp.use_coh:
        x["Zr"] = as4(t["Zr"][:, s0:c1])
        x["coh_state"] = tuple(as4(s_) for s_ in t["coh_states"][si])
        x["s_z"], x["a"] = t["s"], t["a"]
    x.update(stats)
    x["s0"], x["si"] = s0, si
    if leaf:
        for key, val in list(x.items()):
            if key in SMALL:
                continue
            if isinstance(val, tuple):
                x[key] = tuple(v_.detach().requires_grad_() for v_ in val)
            elif isinstance(val, torch.Tensor) and val.is_floating_point():
                x[key] = val.detach().requires_grad_()
    return x


def _store_rows(full: dict, rows: dict, c0: int, c1: int, n: int) -> None:
    """Write one chunk's per-row tensors [b, np, C, ...] into full-length [b, np, s, ...] ones."""
    for key, val in rows.items():
        if key not in full:
            full[key] = val.new_empty(*val.shape[:2], n, *val.shape[3:])
        full[key][:, :, c0:c1] = val


class _FusedChunks(torch.autograd.Function):
    """All query chunks of one call; see the comment at the top of this section."""

    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid):
        call, hp = spec.call, spec.call.hp
        t = _operands(call, q, k, v, z, h, delta, tau, slope)
        t.update(omega=omega, lambdas=lambdas, delta=delta, kappa=kappa, tau=tau, slope=slope, idx=idx, valid=valid)
        b, nh, n, hd = q.shape
        ve = t["v_aug3"].shape[-1]
        out_aug = q.new_empty(b, nh, n, ve)
        # row outputs and statistics go straight into full-length tensors: per-chunk pieces kept
        # until one cat at the end would double them and fragment the heap at long s
        row_out, stats_full, moved = {}, {}, {}
        for c0, c1 in spec.chunks:
            L = c1 if hp.causal else n
            C = c1 - c0
            stats, tiles = _tiles(call, c0, c1, L, t, keep=call.want_lsep)
            x = _row_inputs(call, c0, c1, t, stats, leaf=False)
            parts, factor, rows = _rows(call, c0, c1, L, x)
            dev = tiles.get("dev")
            if call.with_stats:
                for key, val in _moved_stats(call, c0, c1, L, t, rows, factor, dev).items():
                    moved[key] = moved.get(key, 0) + val
            S = _scores(call, c0, c1, L, t, parts, factor, dev, keep_dev=False)
            P = torch.softmax(S, -1)  # one row-wise kernel (rows stay in cache)
            del S
            out_aug[..., c0:c1, :] = torch.bmm(P, t["v_aug3"][:, :L]).view(b, nh, C, ve)
            if call.want_lsep:  # sum_j A_ij phi_ij
                rows["lsep"] = torch.linalg.vecdot(P, tiles["r"].mul_(tiles["w_sep"])).view(b, nh, C)
            if call.want_lcoh:
                c, oc = rows["centroid"], out_aug[..., c0:c1, hd:]
                rows["lcoh"] = oc[..., -1] - 2 * (c * oc[..., :-1]).sum(-1) + (c * c).sum(-1)
            _store_rows(row_out, rows, c0, c1, n)
            _store_rows(stats_full, {k_: v_ for k_, v_ in stats.items() if k_ != "mom"}, c0, c1, n)
        spec.row_keys = list(row_out)
        spec.stat_keys = list(stats_full)
        spec.moved = {k_: v_ / n for k_, v_ in moved.items()}
        out = out_aug if ve == hd else out_aug[..., :hd].contiguous()
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid, out_aug,
                              *stats_full.values())  # fmt: skip
        ctx.set_materialize_grads(False)
        return (out, *row_out.values())

    @staticmethod
    def backward(ctx, d_out, *d_rows):
        spec = ctx.spec
        call, hp = spec.call, spec.call.hp
        q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid, out_aug, *saved = ctx.saved_tensors
        stats_full = dict(zip(spec.stat_keys, saved))
        t = _operands(call, q, k, v, z, h, delta, tau, slope)
        t.update(omega=omega, lambdas=lambdas, delta=delta, kappa=kappa, tau=tau, slope=slope, idx=idx, valid=valid)
        b, nh, n, hd = q.shape
        B = b * nh
        dtype, dev_ = q.dtype, q.device
        d_rows = dict(zip(spec.row_keys, d_rows))
        # one full-size gradient buffer per whole-sequence operand, filled chunk by chunk in place
        gq = torch.zeros_like(q)
        gbuf = {key: torch.zeros_like(t[key]) for key in ("k3", "khat3", "khat_sq", "Zr", "Hr") if key in t}
        gv3 = torch.zeros_like(t["v_aug3"])
        g_tau_alibi = torch.zeros(B, dtype=dtype, device=dev_)
        for key in SMALL:
            t["leaf_" + key] = t[key].detach().requires_grad_()
        g_small = {key: torch.zeros_like(t[key]) for key in SMALL}
        g_states = {"align": {}, "coh": {}}
        for c0, c1 in spec.chunks:
            L = c1 if hp.causal else n
            C = c1 - c0
            stats = {k_: v_[:, :, c0:c1] for k_, v_ in stats_full.items()}
            fresh, tiles = _tiles(call, c0, c1, L, t, keep=True, saved=stats)
            stats.update(fresh)
            with torch.enable_grad():
                x = _row_inputs(call, c0, c1, t, stats, leaf=True)
                parts, factor, rows = _rows(call, c0, c1, L, x)
            dev = tiles.get("dev")
            # ---- gradient of the augmented output rows (task output, L_coh value columns)
            o = out_aug[..., c0:c1, :]
            if d_out is not None and o.shape[-1] == hd:
                dO = d_out[..., c0:c1, :].contiguous()
            else:
                dO = torch.zeros_like(o)
                if d_out is not None:
                    dO[..., :hd] = d_out[..., c0:c1, :]
            d_c = None
            g_lcoh = d_rows.get("lcoh")
            if call.want_lcoh and g_lcoh is not None:
                g = g_lcoh[..., c0:c1]
                c = rows["centroid"].detach()
                dO[..., -1] += g
                dO[..., hd:-1] += -2 * g[..., None] * c
                d_c = g[..., None] * (2 * c - 2 * o[..., hd:-1])
            dO3 = dO.view(B, C, -1)
            # ---- attention backward on the tile
            f_det = factor.detach() if factor is not None else None
            parts_det = [(key, p.detach()) for key, p in parts]
            S = _scores(call, c0, c1, L, t, parts_det, f_det, dev, keep_dev=True)
            P = torch.softmax(S, -1)
            del S
            dP = torch.bmm(dO3, t["v_aug3"][:, :L].transpose(1, 2))
            g_lsep = d_rows.get("lsep")
            gl = None
            if call.want_lsep and g_lsep is not None:
                gl = g_lsep[..., c0:c1].reshape(B, C)
                dP.addcmul_(tiles["r"] * tiles["w_sep"], gl[..., None])  # + dL_sep/dA = g phi
            gv3[:, :L].baddbmm_(P.transpose(1, 2), dO3)  # in place: no [L, e] temporary per chunk
            # A * (dA - sum_j A dA), one row-wise kernel; a row with one visible key gets exactly 0
            # in place into dP (the row kernel reduces each row before writing it; checked
            # bit-identical to the out-of-place call): one tile less at the backward peak
            dS = torch.ops.aten._softmax_backward_data.out(dP, P, -1, dtype, grad_input=dP)
            del dP
            if gl is None:
                del P  # one tile less for the rest of the chunk
            outs, gouts = [], []
            for (key, qp), (_, qd) in zip(parts, parts_det):
                outs.append(qp)
                gouts.append(torch.bmm(dS, t[key][:, :L]))
                # key side; Zr's gradient is kept in the left layout (see the section comment)
                gbuf[key][:, :L].baddbmm_(dS.transpose(1, 2), _swap_last_two(qd) if key == "Zr" else qd)
            if hp.other_bias == "alibi":
                alibi = _alibi_tile(c0, c1, L, dtype, dev_)
                g_tau_alibi += torch.linalg.vecdot(dS.view(B, -1), alibi.reshape(1, -1).expand(B, -1))
            # ---- per-row algebra under autograd (O(C) tensors)
            if factor is not None:
                outs.append(factor)
                gouts.append(torch.linalg.vecdot(dS, dev).view(b, nh, C))
            if d_c is not None:
                outs.append(rows["centroid"])
                gouts.append(d_c)
            gx = rows_backward(c0, c1, x, rows, outs, gouts, d_rows, (gbuf, gq, g_small, g_states))
            if not (call.use_sep or hp.use_coh):
                continue
            # ---- tile backward: Separation statistics and bias, kernels, affinity
            g_mass = 0
            dw = None
            if call.use_sep:
                # dL/d dev = f dS (+ 2 g_var dev / denom); through mu = mean_j phi_ij the
                # correction is (g_mu - sum_j dL/d dev_ij) / count with sum_j dS_ij = 0 and
                # sum_j dev_ij = 0 (softmax rows, centred rows): g_mu / count. Invisible entries
                # need no mask: w_sep = 0 there, so they reach neither dw * w nor da.
                count, denom = _count_denom(c0, c1, L, hp, dtype, dev_)
                dphi = dS.mul_(f_det.reshape(B, C, 1))
                gvar = gx.get("var")
                if gvar is not None:
                    dphi.addcmul_(dev, (2 * gvar.reshape(B, C) / denom)[..., None])
                gmu = gx.get("mu")
                if gmu is not None:
                    dphi.add_((gmu.reshape(B, C) / count)[..., None])
                if gl is not None:
                    dphi.addcmul_(P, gl[..., None])
                r, w_sep = tiles.pop("r"), tiles["w_sep"]
                da = dphi * w_sep
                dw = dphi.mul_(r)
                da.mul_(r.sign_())  # relu'(a - delta) = [r > 0], r >= 0; r is not needed after
                del r
                Hr, gH = t["Hr"], gbuf["Hr"]
                gH[:, c0:c1].baddbmm_(da, Hr[:, :L])
                gH[:, :L].baddbmm_(da.transpose(1, 2), Hr[:, c0:c1])
                del da
                grho = gx.get("rho")
                if grho is not None:  # also hits the diagonal: zeroed in dx below
                    g_mass = grho.reshape(B, C, 1)
            P = dS = dphi = None
            Zr, gZ = t["Zr"], gbuf["Zr"]
            w_coh = tiles["w_coh"]
            gmom = gx.get("mom")
            gmom3 = None
            if hp.use_coh and gmom is not None:
                gmom3 = gmom.reshape(B, C, -1)
                gZ[:, :L].baddbmm_(w_coh.transpose(1, 2), _swap_last_two(gmom3))
            same = not call.use_sep or not hp.use_coh or w_coh is tiles["w_sep"]
            if same:
                if dw is None:
                    dw = torch.zeros_like(w_coh)
                if gmom3 is not None:
                    gm = gmom3.clone()
                    gm[..., -2:-1] += g_mass  # the kernel-mass column of Zr is 1
                    dw.baddbmm_(gm, Zr[:, :L].transpose(1, 2))
                elif isinstance(g_mass, torch.Tensor):
                    dw.add_(g_mass)
                dx = dw.mul_(w_coh if w_coh is not None else tiles["w_sep"])
            else:
                if isinstance(g_mass, torch.Tensor):
                    dw.add_(g_mass)
                dx = dw.mul_(tiles["w_sep"])
                if gmom3 is not None:
                    dwc = torch.bmm(gmom3, Zr[:, :L].transpose(1, 2))
                    dx.add_(dwc.mul_(w_coh), alpha=t["ratio"])
            dx.masked_fill_(tiles["clamped"], 0.0)
            dx[:, :, c0:c1].diagonal(dim1=1, dim2=2).fill_(0.0)
            gZ[:, c0:c1].baddbmm_(dx, Zr[:, :L])
            gZ[:, :L].baddbmm_(dx.transpose(1, 2), Zr[:, c0:c1])
            # drop every tile before the next chunk builds its own (else two chunks' tiles coexist)
            del dx, dw, tiles
            dev = w_sep = w_coh = gm = dwc = None
        Zr = gZ = Hr = gH = None  # the buffers are released one by one in _input_grads
        return (None, *_input_grads(call, t, gq, gbuf, gv3, g_small, g_states, g_tau_alibi, ctx.needs_input_grad))


def rows_backward(c0: int, c1: int, x: dict, rows: dict, outs: list, gouts: list, d_rows: dict, sinks) -> dict:
    """Backward of one chunk's per-row algebra (:func:`_rows`, re-run under autograd): ``outs``/``gouts``
    hold the row outputs the tile backward already has gradients for; the returned row statistics
    with a gradient in ``d_rows`` join them. The leaves' gradients go into ``sinks`` = (gbuf, gq,
    g_small, g_states) (:func:`_scatter_row_grads`) and are returned by leaf name."""
    for key, g in d_rows.items():
        if g is not None and key in rows:
            outs.append(rows[key])
            gouts.append(g[:, :, c0:c1])
    leaves = [(k_, v_) for k_, v_ in x.items() if isinstance(v_, torch.Tensor) and v_.requires_grad]
    leaves += [(f"{k_}#{i}", v_) for k_, val in x.items() if isinstance(val, tuple)
               for i, v_ in enumerate(val)]  # fmt: skip
    grads = torch.autograd.grad(outs, [v_ for _, v_ in leaves], gouts, allow_unused=True)
    gx = {name: g for (name, _), g in zip(leaves, grads) if g is not None}
    _scatter_row_grads(c0, c1, x, gx, *sinks)
    return gx


def _scatter_row_grads(c0: int, c1: int, x: dict, gx: dict, gbuf: dict, gq, g_small: dict, g_states: dict) -> None:
    """Add one chunk's gradients of the _rows leaves into the whole-sequence buffers."""
    for key in SMALL:
        if key in gx:
            g_small[key] += gx[key]
    if "q" in gx:
        gq[..., c0:c1, :] += gx["q"]
    B = gq.shape[0] * gq.shape[1]
    s0 = x["s0"]
    if "ktot" in gx or "ksq" in gx:  # headings: back to the neighbours' rows
        pos, weight = x["npos"].reshape(-1), x["nweight"]
        if "ktot" in gx:
            g = gx["ktot"]
            per_slot = (g[..., None, :] * weight[..., None]).reshape(-1, g.shape[-1])  # [b*np*C*k, hd]
            gbuf["khat3"].view(-1, g.shape[-1]).index_add_(0, pos, per_slot)
        if "ksq" in gx:  # d|khat_l|^2 = 2 khat_l: applied once per key at the end (_input_grads)
            gbuf["khat_sq"].view(-1).index_add_(0, pos, (gx["ksq"][..., None] * weight).reshape(-1))
    if "khat" in gx:  # keys [s0, c1) of the in-chunk moments
        gbuf["khat3"][:, s0:c1] += gx["khat"].reshape(B, c1 - s0, -1)
    if "Zr" in gx:
        gbuf["Zr"][:, s0:c1] += _swap_last_two(gx["Zr"].reshape(B, c1 - s0, -1))
    for name, store in (("align_state", g_states["align"]), ("coh_state", g_states["coh"])):
        pieces = [gx.get(f"{name}#{i}") for i in range(len(x.get(name, ())))]
        if any(p is not None for p in pieces):
            si = x["si"]
            old = store.get(si, (None,) * len(pieces))
            pieces = [None if p is None else p.reshape(B, *p.shape[2:]) for p in pieces]
            store[si] = tuple(p if o is None else (o if p is None else o + p) for o, p in zip(old, pieces))


def _input_grads(call: _Call, t, gq, gbuf, gv3, g_small, g_states, g_tau_alibi, needs) -> list:
    """Gradients of the Function's inputs from the whole-sequence buffers: states and the
    normalisations differentiated in closed form, Hr / khat / Zr mapped back to h, delta, k
    and z; each operand and its buffer is released as soon as it is mapped (backward's peak)."""
    hp = call.hp
    q, z, h, k = t["q"], t["z"], t["h"], t["k"]
    b, nh, n, hd = q.shape
    B = b * nh
    gh, g_delta = None, None
    if "Hr" in gbuf:
        gH, da = gbuf.pop("Hr"), h.shape[-1]
        g_delta = -0.5 * gH[..., da].reshape(b, nh, n).sum((0, 2))
        gh = _normalize_backward_(h.reshape(B, n, da), t.pop("Hr")[..., :da], gH[..., :da], hp.eps).reshape(h.shape)
        del gH
    gk = gbuf.pop("k3")
    if hp.use_align:
        g_khat = gbuf.pop("khat3")
        g_khat.addcmul_(t["khat3"], gbuf.pop("khat_sq")[..., None], value=2.0)
        _moment_states_backward(t["khat3"], t["align_states"], g_states["align"], hp.causal, g_khat)
        gk += _normalize_backward_(t["k3"], t.pop("khat3"), g_khat, hp.eps)
        del g_khat
    dz = z.shape[-1]
    z3 = z.reshape(B, n, dz)
    gz = None
    if "Zr" in gbuf:  # left layout [s z, -a |z|^2, 1]
        gZ = gbuf.pop("Zr")
        if hp.use_coh:
            _moment_states_backward(t["Zr"], t["coh_states"], g_states["coh"], hp.causal, gZ, swap=True)
        gz = gZ[..., :dz] * t["s"]
        gz.addcmul_(z3, gZ[..., dz : dz + 1], value=-2 * t["a"])
        del gZ
    gv3_out = gv3
    if call.want_lcoh:  # v_aug = [v, z, |z|^2]
        g_lcoh = gv3[..., hd : hd + dz] + 2 * z3 * gv3[..., hd + dz :]
        gz = g_lcoh if gz is None else gz.add_(g_lcoh)
        gv3_out = gv3[..., :hd]
    gz = torch.zeros_like(z) if gz is None else gz.view_as(z)
    gh = torch.zeros_like(h) if gh is None else gh
    g_delta = torch.zeros_like(t["delta"]) if g_delta is None else g_delta
    g_tau = g_small["tau"]
    if hp.other_bias == "alibi":
        g_tau = g_tau + g_tau_alibi.view(b, nh).sum(0) * t["slope"] / (t["tau"] * t["tau"])
    grads = [gq, gk.view_as(k), gv3_out.reshape(b, nh, n, hd), gz, gh,
             g_small["omega"], g_small["lambdas"], g_delta, g_small["kappa"], g_tau, None, None, None]  # fmt: skip
    return [g if need else None for g, need in zip(grads, needs[1:])]


def _moved_stats(call: _Call, c0, c1, L, t, rows, factor, dev):
    """Per-head sums over rows of the mass each bias moves (no grad, explicit tiles)."""
    hp = call.hp
    b, nh, n, hd = t["q"].shape
    C = c1 - c0
    tau = t["tau"].view(1, -1, 1, 1)
    vis = tile_visibility(c0, c1, L, hp.causal, t["q"].device)
    as4 = lambda y: y.view(b, nh, *y.shape[1:])  # noqa: E731
    terms = {}
    if hp.use_align:
        r = rows["u"] @ as4(t["khat3"][:, :L]).transpose(-1, -2)
        s, mean = rows["align_scale"], rows["align_mean"]
        terms["align"] = t["omega"][:, ALIGN].view(1, -1, 1, 1) * s[..., None] * (r - mean[..., None])
    if call.use_sep:
        terms["sep"] = (dev.view(b, nh, C, L) * factor[..., None]) * tau
    if hp.use_coh:
        c, s, mean = rows["centroid"], rows["coh_scale"], rows["coh_mean"]
        zk = t["z"][..., :L, :]
        r = -((zk * zk).sum(-1)[..., None, :] - 2 * c @ zk.transpose(-1, -2) + (c * c).sum(-1)[..., None])
        terms["coh"] = t["omega"][:, COH].view(1, -1, 1, 1) * s[..., None] * (r - mean[..., None])
    S = t["q"][..., c0:c1, :] @ t["k"][..., :L, :].transpose(-1, -2) / math.sqrt(hd)
    if hp.other_bias == "alibi":
        S = S - t["slope"].view(1, -1, 1, 1) * _alibi_tile(c0, c1, L, S.dtype, S.device)
    S = S + sum(terms.values()) if terms else S
    moved = mass_moved(S, terms, vis, tau)
    return {k_: v_ * C for k_, v_ in moved.items()}


def fast_attention(
    q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
    with_aux: bool = False, with_stats: bool = False,
) -> AscenderResult:  # fmt: skip
    """ASCender attention in O(s * (window + chunk)) memory. Same result as reference_attention
    (out [b, np, s, hd]; rows: per-row statistics; stats: per-head mass moved; aux losses), no maps."""
    b, nh, n, hd = q.shape
    chunks = chunk_bounds(n, b * nh, hp)
    call = _Call(hp, n, hd, use_sep, with_aux, with_stats)
    idx, valid = neighbours(*search_vectors(q, k, h, hp), hp, chunks)  # [b, np, s, k]
    spec = _Spec(call, chunks)
    outs = _FusedChunks.apply(
        spec, q.contiguous(), k.contiguous(), v.contiguous(), z.contiguous(), h.contiguous(), params.omega,
        params.lambdas, params.delta, params.kappa, params.tau_score, params.alibi_slope,
        idx.to(torch.int32), valid,  # int32: half the bytes kept for backward
    )  # fmt: skip
    rows = {"neighbour_idx": idx, "neighbour_valid": valid, **dict(zip(spec.row_keys, outs[1:]))}
    aux = _aux(rows, rows.get("u"), idx, valid, hp, call) if with_aux else {}
    return AscenderResult(out=outs[0], rows=rows, stats=spec.moved, aux=aux)
