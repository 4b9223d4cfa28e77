"""Tiles of the fused fast path: the static facts of a call, the whole-sequence operands,
the kernel / Separation tiles of one query chunk and the folded score tile built from them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ascender_dist.config.ascender_hparams import AscenderHParams
from .common import count_denom, swap_last_two
from .fast_moments import chunk_groups, moment_chunks, moment_states
from .fast_neighbours import NEG_INF, chunk_bounds, tile_visibility
from .fast_workspace import TileWorkspace, max_tile_numel
from .params import ALIGN, COH
from .reference import mass_moved

# ----------------------------------------------------------------------------- fused path
# One autograd.Function (fast_function.FusedChunks) runs every query chunk from the raw inputs (q, k, v, z, h and the
# per-head parameters): it derives the key-side operands itself, keeps no tile and no derived
# whole-sequence tensor for backward (only the inputs, the output, the neighbour indices and
# O(s) row statistics), and backward derives the operands again, recomputes one chunk's tiles
# at a time and back-propagates through them by hand (the Separation tile, the kernels and the
# attention, FlashAttention-style). The O(chunk) per-row algebra between them (headings from the
# gathered neighbours, row scales, gates, eta, centroids, the folded queries) is recomputed and
# differentiated in closed form (fast_row_grads). Each tile is written into its role's buffer of
# the pass's workspace (fast_workspace), not into fresh memory per chunk. Gradients of
# whole-sequence operands accumulate in place into one buffer each
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

LOG2E = 1.0 / math.log(2.0)


def exp2_(x: torch.Tensor) -> torch.Tensor:
    """2^x in place: the kernels are exp(x) = 2^(x log2 e), with log2 e folded into the distance
    GEMM's left operand (no extra pass over the tile); torch's CPU exp2 kernel takes less than
    half the time of its exp on a tile here (docs/ascender.md, Cost); exp2(0) = 1 and
    exp2(-inf) = 0 exactly, as exp."""
    return x.exp2_()


# ----------------------------------------------------------------------------- one chunk
class Call:
    """Static facts of one call, shared by all chunks (holds no tensor)."""

    def __init__(self, hp: AscenderHParams, n: int, hd: int, use_sep: bool, with_aux: bool,
                 with_stats: bool):  # fmt: skip
        self.hp, self.n, self.hd, self.use_sep = hp, n, hd, use_sep
        self.want_lsep = with_aux and use_sep and hp.aux_crowding_weight > 0
        self.want_lcoh = with_aux and hp.use_coh and hp.aux_compactness_weight > 0
        self.with_stats = with_stats



class Spec:
    """Static description of one fused call (chunks, names of the row outputs and statistics)."""

    def __init__(self, call: Call, chunks):
        self.call, self.chunks = call, chunks
        self.groups = chunk_groups(chunks, call.hp.causal, call.n)
        self.row_keys: list[str] = []
        self.stat_keys: list[str] = []
        self.moved: dict = {}


def centred(z: torch.Tensor) -> torch.Tensor:
    """z - z_0 per batch and head (position 0's z subtracted): the coordinates both fused paths
    compute in. ASCender reads z only through differences (distances, centroids against keys), so
    it is the same function; but the paths form -a |z_i - z_j|^2 as one GEMM of the Zl / Zr
    operands, 2a z_i . z_j - a |z_i|^2 - a |z_j|^2, and a common offset in z makes those terms
    cancel in float32 (relative error 3.5 at z = 0.05 randn + 30, 1e-6 centred). Position 0 is
    visible to every row: the shift reads no future token. Only the derived operands (Zr, the L_coh
    value columns) are built from it, so no centred copy of z is kept; input_grads applies the
    shift's Jacobian, with_z_origin moves the centroids back."""
    return z - z[:, :, :1]


def with_z_origin(rows: dict, z: torch.Tensor) -> dict:
    """The row outputs of a fused call on ``z``, its centroids (computed in centred coordinates)
    moved back to z's (differentiably: the gradient reaches z_0)."""
    if "centroid" in rows:
        rows["centroid"] = rows["centroid"] + z[:, :, :1].to(rows["centroid"].dtype)
    return rows


def operands(call: Call, q, k, v, z, h, delta, tau, slope) -> dict:
    """The whole-sequence operands every chunk reads, O(s) each, derived from the inputs in
    forward and again in backward (nothing derived is kept in between): 4-d views of the
    inputs, [B, s, e] GEMM operands (k3, khat3, Zr, Hr, v_aug3), the moment states and the
    pass's tile workspace ("ws", sized for the largest tile of the call's chunks)."""
    hp = call.hp
    b, nh, n, hd = q.shape
    B = b * nh
    t = dict(q=q, z=z, h=h, k=k, k3=k.reshape(B, n, hd))  # k3: [b, np, s, hd] -> [B, s, hd]
    t["ws"] = TileWorkspace(max_tile_numel(chunk_bounds(n, B, hp), n, B, hp.causal), q.dtype, q.device)
    starts = [s0 for s0, _ in moment_chunks(n)]
    zc = centred(z) if call.want_lcoh or call.use_sep or hp.use_coh else None  # freed once the operands exist
    if call.want_lcoh:  # the value columns of L_coh: sum_j A_ij [z_j, |z_j|^2]
        t["v_aug3"] = torch.cat([v, zc, (zc * zc).sum(-1, keepdim=True)], -1).reshape(B, n, -1)
    else:
        t["v_aug3"] = v.reshape(B, n, hd)  # [b, np, s, hd] -> [B, s, hd]
    if hp.use_align:
        t["khat3"] = F.normalize(t["k3"], dim=-1, eps=hp.eps)
        t["khat_sq"] = torch.linalg.vecdot(t["khat3"], t["khat3"])  # [B, s]: 1 unless |k| < eps
        t["align_states"] = moment_states(t["khat3"], hp.causal, starts)
    if call.use_sep or hp.use_coh:
        ks, kc = hp.kernel_denominator(hp.tau_sep), hp.kernel_denominator(hp.tau_coh)
        k_main = ks if call.use_sep else kc
        t["a"] = a = 1.0 / k_main
        t["s"] = math.sqrt(2 * a)
        t["ratio"] = k_main / kc if (call.use_sep and hp.use_coh and kc != ks) else 1.0
        z3 = zc.reshape(B, n, -1)  # [b, np, s, dz] -> [B, s, dz]
        t["Zr"] = torch.cat([t["s"] * z3, torch.ones_like(z3[..., :1]), -a * (z3 * z3).sum(-1, keepdim=True)], -1)
    if hp.use_coh:
        t["coh_states"] = moment_states(t["Zr"], hp.causal, starts)
    if call.use_sep:
        h3 = h.reshape(B, n, -1)  # [b, np, s, da] -> [B, s, da]
        hhat = F.normalize(h3, dim=-1, eps=hp.eps)  # kept only inside Hr
        half = (-0.5 * delta).repeat(b).view(B, 1, 1).expand(B, n, 1)
        t["Hr"] = torch.cat([hhat, torch.ones_like(hhat[..., :1]), half], -1)
    if hp.other_bias == "alibi":
        t["slope_tau_b"] = (slope / tau).repeat(b)
    return t


def kernel_tiles(call: Call, c0: int, c1: int, L: int, t: dict, keep: bool, saved: dict | None = None):
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
    C = c1 - c0
    w_sep, w_coh, clamped, upper = _kernel_weights(call, c0, c1, L, t, keep)
    stats, tiles = {}, {}
    if hp.use_coh and (saved is None or "mom" not in saved):  # not kept for backward: one GEMM again
        stats["mom"] = torch.bmm(w_coh, t["Zr"][:, :L]).view(b, nh, C, -1)  # [B, C, e] -> [b, np, C, e]
    if call.use_sep:
        _separation_tile(call, c0, c1, L, t, w_sep, upper, keep, saved, stats, tiles)
    if keep:
        tiles.update(clamped=clamped, w_coh=w_coh, upper=upper)
    return stats, tiles


def _kernel_weights(call: Call, c0: int, c1: int, L: int, t: dict, keep: bool):
    """The kernels w = exp(-|z_i - z_j|^2 / k) of one tile [B, C, L], 0 where invisible, 1 on
    the diagonal: (w_sep, w_coh) (the same tensor when both widths agree; None when unused),
    the entries clamped at 0 (with keep, None when there are none; no gradient there) and the
    causal upper mask [C, C]."""
    hp = call.hp
    C = c1 - c0
    Zr = t["Zr"]
    ks, kc = hp.kernel_denominator(hp.tau_sep), hp.kernel_denominator(hp.tau_coh)
    # x = -|z_i - z_j|^2 log2(e) / k_main: the base-2 exponent of the kernel (LOG2E on the left
    # operand, [C, e], instead of a pass over the tile)
    ws = t["ws"]
    x = torch.bmm(swap_last_two(Zr[:, c0:c1]).mul_(LOG2E), Zr[:, :L].transpose(1, 2),
                  out=ws.tile("w", (Zr.shape[0], C, L)))  # fmt: skip
    blk = x[:, :, c0:c1]  # the [C, C] block holding the diagonal (and the causal triangle)
    blk.diagonal(dim1=1, dim2=2).fill_(0.0)  # d_ii = 0 exactly
    # |z_i - z_j|^2 < 0 by rounding off the diagonal: clamped, no gradient there (rare: the mask
    # is only built when some entry is positive; None means none is)
    clamped = torch.gt(x, 0, out=ws.tile("clamped", x.shape, torch.bool)) if keep and bool(x.amax() > 0) else None
    ratio = t["ratio"]
    # Lower clamp of each kernel's exponent: exp of arguments in [-104, -87] (float32) lands in the
    # denormals and is ~30x slower than elsewhere; clamping there changes w by < 2e-38 (float32),
    # 3e-308 (float64). Cohesion's exponent ratio * x gets its own clamp (one floor on x would put
    # the other kernel's floor at tiny^ratio or tiny^(1/ratio): 0.42 at ratio 100 in float32).
    lo = math.log2(torch.finfo(x.dtype).tiny) * 0.999
    x.clamp_(min=lo / min(1.0, ratio), max=0)  # ratio < 1: low enough that ratio * x >= lo
    x_coh = None
    if ratio != 1.0:  # one more pass: the floor of whichever argument can still be below lo
        x_coh = torch.mul(x, ratio, out=ws.tile("w_coh", x.shape))
        (x_coh if ratio > 1.0 else x).clamp_(min=lo)
    upper = None
    if hp.causal and C > 1:
        upper = torch.ones(C, C, dtype=torch.bool, device=x.device).triu(1)
        for exponent in (x, x_coh):  # invisible: every kernel exactly 0
            if exponent is not None:
                exponent[:, :, c0:c1].masked_fill_(upper, NEG_INF)
    w_sep = w_coh = None
    if x_coh is not None:
        w_coh = exp2_(x_coh)
    w = exp2_(x)
    if call.use_sep:
        w_sep = w
        if hp.use_coh and kc == ks:
            w_coh = w
    else:
        w_coh = w
    return w_sep, w_coh, clamped, upper


def _separation_tile(call: Call, c0: int, c1: int, L: int, t: dict, w_sep, upper, keep: bool, saved, stats: dict,
                     tiles: dict) -> None:  # fmt: skip
    """Separation: phi = relu(hhat_i . hhat_j - delta) w_sep and its centred rows dev = phi - mu
    (into tiles; with keep also r and w_sep) and, without saved, the row statistics rho, mu,
    var (into stats, [b, np, C])."""
    hp = call.hp
    b, nh = t["q"].shape[:2]
    B, C = b * nh, c1 - c0
    if saved is None:
        dg = w_sep[:, :, c0:c1].diagonal(dim1=1, dim2=2)
        dg.fill_(0.0)
        stats["rho"] = w_sep.sum(-1).view(b, nh, C)  # sum over visible l != i (no 1 - 1 cancelling)
        dg.fill_(1.0)
    Hr = t["Hr"]
    r = torch.bmm(swap_last_two(Hr[:, c0:c1]), Hr[:, :L].transpose(1, 2), out=t["ws"].tile("r", (B, C, L)))
    r.clamp_(min=0)  # relu(a - delta)
    phi = torch.mul(r, w_sep, out=t["ws"].tile("phi", r.shape)) if keep else r.mul_(w_sep)
    if saved is None:
        count, denom = count_denom(c0, c1, L, hp, phi.dtype, phi.device)
        mu = phi.sum(-1) / count  # [B, C]
    else:
        mu = saved["mu"].reshape(B, C)  # [b, np, C] -> [B, C]
    dev = phi.sub_(mu[:, :, None])
    if upper is not None:
        dev[:, :, c0:c1].masked_fill_(upper, 0.0)
    if saved is None:
        stats["mu"] = mu.view(b, nh, C)  # [B, C] -> [b, np, C]
        # forward only (saved is None): the kernels' tile is dead unless kept, the probabilities'
        # is free until the softmax
        stats["var"] = (row_dot(t["ws"], "P" if keep else "w", dev, dev) / denom).view(b, nh, C)  # [B, C] -> [b, np, C]
    tiles["dev"] = dev
    if keep:
        tiles.update(r=r, w_sep=w_sep)


def row_dot(ws: TileWorkspace, role: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_j x_ij y_ij over the last dim, with the product written into ``role``'s tile, which
    must be dead: torch.linalg.vecdot's kernels (bit-identical), without its fresh temporary tile."""
    return torch.mul(x, y, out=ws.tile(role, x.shape)).sum(-1)


def softmax_into(ws: TileWorkspace, role: str, S: torch.Tensor) -> torch.Tensor:
    """softmax(S, -1) written into ``role``'s tile, which must be dead (torch.softmax's kernel)."""
    return torch.ops.aten._softmax.out(S, -1, False, out=ws.tile(role, S.shape))


def alibi_tile(c0: int, c1: int, L: int, dtype, device):
    """|i - j| for query rows [c0, c1) and keys [0, L): the ALiBi distance tile [C, L]."""
    return (torch.arange(c0, c1, device=device)[:, None] - torch.arange(L, device=device)).abs().to(dtype)


def fold_scores(call: Call, c0, c1, L, t, parts, factor, dev, keep_dev: bool):
    """S = sum over parts of q_part k_part^T + omega_s s_i dev_ij / tau (+ ALiBi / tau), -inf
    where invisible; one GEMM per folded part, accumulated in place."""
    hp = call.hp
    ws = t["ws"]
    S = None
    if factor is not None:
        f = factor.reshape(-1, c1 - c0, 1)  # [b, np, C] -> [B, C, 1]
        S = torch.mul(dev, f, out=ws.tile("S", dev.shape)) if keep_dev else dev.mul_(f)
    for key, qp in parts:
        kT = t[key][:, :L].transpose(1, 2)
        S = torch.bmm(qp, kT, out=ws.tile("S", (qp.shape[0], c1 - c0, L))) if S is None else S.baddbmm_(qp, kT)
    if hp.other_bias == "alibi":
        S.sub_(alibi_tile(c0, c1, L, S.dtype, S.device) * t["slope_tau_b"][:, None, None])
    if hp.causal and c1 - c0 > 1:
        S[:, :, c0:c1].masked_fill_(torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=S.device).triu(1),
                                    NEG_INF)  # fmt: skip
    return S


def moved_stats(call: Call, c0, c1, L, t, rows, factor, dev):
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
        terms["sep"] = (dev.view(b, nh, C, L) * factor[..., None]) * tau  # dev: [B, C, L] -> [b, np, C, L]
    if hp.use_coh:
        c, s, mean = rows["centroid"], rows["coh_scale"], rows["coh_mean"]
        zk = t["z"][..., :L, :] - t["z"][..., :1, :]  # the keys in the centroids' (centred) coordinates
        r = -((zk * zk).sum(-1)[..., None, :] - 2 * c @ zk.transpose(-1, -2) + (c * c).sum(-1)[..., None])
        terms["coh"] = t["omega"][:, COH].view(1, -1, 1, 1) * s[..., None] * (r - mean[..., None])
    S = t["q"][..., c0:c1, :] @ t["k"][..., :L, :].transpose(-1, -2) / math.sqrt(hd)
    if hp.other_bias == "alibi":
        S = S - t["slope"].view(1, -1, 1, 1) * alibi_tile(c0, c1, L, S.dtype, S.device)
    S = S + sum(terms.values()) if terms else S
    moved = mass_moved(S, terms, vis, tau)
    return {k_: v_ * C for k_, v_ in moved.items()}
