"""Per-row algebra of one query chunk of the fused fast path ([b, np, C]-sized tensors only):
its inputs, the algebra itself (headings, gates, row scales, centroids, folded queries; the
Alignment block also over a group of chunks) and the scatter of its gradients (the closed form
of fast_row_grads) into the whole-sequence buffers."""

from __future__ import annotations

import math

import torch

from ascender_dist.config.ascender_hparams import AscenderHParams
from .common import count_denom, row_scale, safe_sqrt, swap_last_two, weighted_aux_total
from .fast_moments import moment_state_index, row_moments_chunk
from .fast_neighbours import gather_sum, heading_from_sums, neighbour_sums
from .fast_tiles import Call
from .params import ALIGN, COH, SEP

SMALL = ("omega", "lambdas", "kappa", "tau")


def row_inputs(call: Call, c0: int, c1: int, t: dict, stats: dict, align: bool = True):
    """Inputs of row_algebra for one chunk; without align, none of the Alignment block's (its
    rows come from align_rows over a group of chunks)."""
    hp = call.hp
    b, nh = t["q"].shape[:2]
    si, s0 = moment_state_index(c0, hp.causal)  # moment state si holds the keys j < s0
    x = {"q": t["q"][..., c0:c1, :]}
    for key in SMALL:
        x[key] = t[key]
    as4 = lambda y: y.view(b, nh, *y.shape[1:])  # noqa: E731  [B, ...] -> [b, np, ...]
    if hp.use_align and align:
        x["ktot"], x["ksq"], x["npos"], x["nweight"] = neighbour_sums(t, c0, c1)
        x["khat"] = as4(t["khat3"][:, s0:c1])
        x["align_state"] = tuple(as4(s_) for s_ in t["align_states"][si])
    if hp.use_coh:
        x["Zr"] = as4(t["Zr"][:, s0:c1])
        x["coh_state"] = tuple(as4(s_) for s_ in t["coh_states"][si])
        x["s_z"], x["a"] = t["s"], t["a"]
    x.update(stats)
    x["s0"], x["si"] = s0, si
    return x


def store_rows(full: dict, rows: dict, c0: int, c1: int, n: int) -> None:
    """Write one chunk's per-row tensors [b, np, C, ...] into full-length [b, np, s, ...] ones."""
    for key, val in rows.items():
        if key not in full:
            full[key] = val.new_empty(*val.shape[:2], n, *val.shape[3:])
        full[key][:, :, c0:c1] = val


def align_rows(call: Call, c0: int, c1: int, L: int, x: dict, saved: dict | None = None):
    """Alignment block of rows [c0, c1) (reads no tile): the folded query part
    omega_a s_i u_i / tau [b, np, C, hd] and its row statistics. saved: filled with what
    fast_row_grads.align_backward reads."""
    hp = call.hp
    count, denom = count_denom(c0, c1, L, hp, x["ktot"].dtype, x["ktot"].device)
    tau = x["tau"].view(1, -1, 1, 1)
    nsum = x["nweight"].sum(-1)
    uq, spread = heading_from_sums(x["ktot"], x["ksq"], nsum, hp)
    gate_a = torch.sigmoid(-hp.alpha_align * spread)
    g = x["lambdas"][:, ALIGN].view(1, -1, 1) * gate_a
    ms = {} if saved is not None else None
    mean, var = row_moments_chunk(hp.causal, uq, x["align_state"], x["khat"], c0, x["s0"], saved=ms)
    v = var * count / denom
    sig = safe_sqrt(v)
    s = row_scale(g, sig, hp)
    part = x["omega"][:, ALIGN].view(1, -1, 1, 1) * s[..., None] * uq / tau
    if saved is not None:
        saved.update(nsum=nsum, uq=uq, gate=gate_a, g=g, moments=ms, v=v, sig=sig, s=s, part=part, count=count,
                     denom=denom)  # fmt: skip
    return part, {"u": uq, "gate_align": gate_a, "align_mean": mean, "align_scale": s}


def row_algebra(call: Call, c0: int, c1: int, L: int, x: dict, saved: dict | None = None, align=None):
    """Per-row algebra of one chunk ([b, np, C]-sized tensors only): the folded query parts
    [(key operand name, [B, C, e] already / tau_score)], the Separation row factor
    omega_s s_i / tau (or None) and the row statistics. saved: filled with the intermediates
    that fast_row_grads.row_algebra_backward reads. align: (part, rows) of the Alignment block
    for these rows when already computed (align_rows over a group of chunks; saved then holds
    nothing of it)."""
    hp = call.hp
    b, nh, C, _ = x["q"].shape
    B = b * nh
    count, denom = count_denom(c0, c1, L, hp, x["q"].dtype, x["q"].device)
    tau = x["tau"].view(1, -1, 1, 1)
    omega, lambdas = x["omega"], x["lambdas"]
    rows = {}
    keep = saved is not None
    parts = [("k3", x["q"] / (math.sqrt(call.hd) * tau))]
    if hp.use_align:
        if align is None:
            sa = {} if keep else None
            align = align_rows(call, c0, c1, L, x, sa)
            if keep:
                saved["align"] = sa
        rows.update(align[1])
        parts.append(("khat3", align[0]))
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
        ms = {} if keep else None
        mean_p, var_p = row_moments_chunk(hp.causal, y, x["coh_state"], x["Zr"], c0, x["s0"], saved=ms)
        v = 4 * var_p * count / denom
        sig = safe_sqrt(v)
        s = row_scale(g, sig, hp)
        rows["centroid"], rows["gate_coh"], rows["coh_mean"], rows["coh_scale"] = c, gate, 2 * mean_p - c2, s
        parts.append(("Zr", omega[:, COH].view(1, -1, 1, 1) * 2 * s[..., None] * y / tau))
        if keep:
            saved["coh"] = dict(mass=mass, c=c, ez2=ez2, c2=c2, gate=gate, g=g, y=y, moments=ms, v=v, sig=sig, s=s)
    factor = None
    if call.use_sep:
        ratio = x["rho"] / x["kappa"].view(1, -1, 1)
        eta = torch.clamp(ratio, max=1.0)
        sig = safe_sqrt(x["var"])
        g = -lambdas[:, SEP].view(1, -1, 1) * eta
        s = row_scale(g, sig, hp)
        rows["rho"], rows["eta"], rows["sep_mean"], rows["sep_scale"] = x["rho"], eta, x["mu"], s
        factor = omega[:, SEP].view(1, -1, 1) * s / tau[..., 0]
        if keep:
            saved["sep"] = dict(ratio=ratio, eta=eta, sig=sig, g=g, s=s, factor=factor)
    if keep:
        saved["parts"] = dict(parts)
        saved["count"], saved["denom"] = count, denom
    return [(key, p.reshape(B, C, -1)) for key, p in parts], factor, rows  # [b, np, C, e] -> [B, C, e]


def grad_sinks(t: dict) -> dict:
    """Zero gradient buffers that scatter_row_grads adds into (one full-size buffer per
    whole-sequence operand, filled chunk by chunk in place; the per-head parameters; the moment
    states by index)."""
    gbuf = {key: torch.zeros_like(t[key]) for key in ("k3", "khat3", "khat_sq", "Zr", "Hr") if key in t}
    g_small = {key: torch.zeros_like(t[key]) for key in SMALL}
    return {"gq": torch.zeros_like(t["q"]), "gbuf": gbuf, "g_small": g_small, "g_states": {"align": {}, "coh": {}}}


def scatter_row_grads(c0: int, c1: int, x: dict, gx: dict, gbuf: dict, gq, g_small: dict, g_states: dict) -> None:
    """Add one chunk's gradients of the row_algebra leaves into the whole-sequence buffers."""
    for key in SMALL:
        if key in gx:
            g_small[key] += gx[key]
    if "q" in gx:
        gq[..., c0:c1, :] += gx["q"]
    B = gq.shape[0] * gq.shape[1]
    s0 = x["s0"]
    if "ktot" in gx or "ksq" in gx:  # headings: back to the neighbours' rows
        pos, weight = x["npos"].reshape(-1), x["nweight"]
        if "ktot" in gx:  # slot by slot: a [b*np*C*k, hd] source would be k times the rows' size
            hd = gx["ktot"].shape[-1]
            g, dst = gx["ktot"].reshape(-1, hd), gbuf["khat3"].view(-1, hd)  # [b*np*C, hd], [B*s, hd]
            slots, w = x["npos"].reshape(-1, weight.shape[-1]), weight.reshape(-1, weight.shape[-1])
            for t in range(slots.shape[-1]):
                dst.index_add_(0, slots[:, t], g * w[:, t, None])
        if "ksq" in gx:  # d|khat_l|^2 = 2 khat_l: applied once per key at the end (input_grads)
            gbuf["khat_sq"].view(-1).index_add_(0, pos, (gx["ksq"][..., None] * weight).reshape(-1))
    if "khat" in gx:  # keys [s0, c1) of the in-chunk moments
        gbuf["khat3"][:, s0:c1] += gx["khat"].reshape(B, c1 - s0, -1)  # [b, np, c1-s0, hd] -> [B, .., hd]
    if "Zr" in gx:
        gbuf["Zr"][:, s0:c1] += swap_last_two(gx["Zr"].reshape(B, c1 - s0, -1))
    for name, store in (("align_state", g_states["align"]), ("coh_state", g_states["coh"])):
        pieces = [gx.get(f"{name}#{i}") for i in range(len(x.get(name, ())))]
        if any(p is not None for p in pieces):
            si = x["si"]
            old = store.get(si, (None,) * len(pieces))
            pieces = [None if p is None else p.reshape(B, *p.shape[2:]) for p in pieces]  # [b, np, ..] -> [B, ..]
            store[si] = tuple(p if o is None else (o if p is None else o + p) for o, p in zip(old, pieces))



def aux_losses(rows, u, idx, valid, hp: AscenderHParams, call: Call):
    """Section 8 losses from the streamed per-row pieces (same definitions as the reference)."""
    aux = {}
    if call.want_lcoh:
        aux["compactness"] = rows.pop("lcoh").mean()
    if call.want_lsep:
        aux["crowding"] = rows.pop("lsep").mean()
    if hp.aux_alignment_weight > 0 and u is not None:
        # neighbours with a heading only: u_l = 0 where l has no neighbours (row 0, causal) is no heading
        b, nh, n, k = idx.shape
        has = valid.any(-1)  # [b, np, s]
        headed = valid & has.gather(-1, torch.where(valid, idx, 0).reshape(b, nh, n * k)).view(b, nh, n, k)
        count = headed.sum(-1)
        u_bar = gather_sum(u, idx, headed) / count.clamp(min=1)[..., None].to(u.dtype)
        aux["alignment"] = ((1 - (u * u_bar).sum(-1)) * (count > 0)).mean()
    aux["total"] = weighted_aux_total(aux, hp)
    return aux
