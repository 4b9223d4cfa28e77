"""The autograd.Function of the fused fast path: every query chunk of one call, forward and a
hand-written backward (layout and operands: see fast_tiles).

Forward keeps no tile and nothing derived: only the inputs, the output, the neighbour indices and
O(s) row statistics. Backward derives the operands again and, one chunk at a time, rebuilds the
tiles and back-propagates through them in named steps: the output rows' gradient, the softmax,
the folded query / key GEMMs, the per-row algebra (closed form, fast_row_grads), the Separation
tile and the kernel tile. The Alignment rows read no tile: they run, forward and backward, once
per group of chunks (Spec.groups). Gradients of whole-sequence operands accumulate in place into one buffer
each (a per-chunk slice of a full-size tensor would allocate a full-size gradient per chunk).
"""

from __future__ import annotations

import torch

from .common import count_denom, swap_last_two
from .fast_grads import input_grads
from .fast_row_grads import align_backward, row_algebra_backward
from .fast_rows import align_rows, grad_sinks, row_algebra, row_inputs, scatter_row_grads, store_rows
from .fast_tiles import (Call, Spec, alibi_tile, fold_scores, kernel_tiles, moved_stats, operands, row_dot,
                         softmax_into)


def _all_operands(call: Call, q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid) -> dict:
    """The whole-sequence operands plus the per-head parameters and neighbours, by name."""
    t = operands(call, q, k, v, z, h, delta, tau, slope)
    t.update(omega=omega, lambdas=lambdas, delta=delta, kappa=kappa, tau=tau, slope=slope, idx=idx, valid=valid)
    return t


def _forward_chunk(call: Call, c0: int, c1: int, t: dict, out_aug, row_out: dict, stats_full: dict,
                   moved: dict, align) -> None:  # fmt: skip
    """Rows [c0, c1): tiles, per-row algebra, softmax and output, written into the full-length
    out_aug [b, np, s, ve], row outputs and statistics (per-chunk pieces kept until one cat at
    the end would double them and fragment the heap at long s)."""
    hp = call.hp
    b, nh, n, hd = t["q"].shape
    ve = out_aug.shape[-1]
    L = c1 if hp.causal else n
    C = c1 - c0
    stats, tiles = kernel_tiles(call, c0, c1, L, t, keep=call.want_lsep)
    x = row_inputs(call, c0, c1, t, stats, align=align is None)
    parts, factor, rows = row_algebra(call, c0, c1, L, x, align=align)
    dev = tiles.get("dev")
    if call.with_stats:
        for key, val in moved_stats(call, c0, c1, L, t, rows, factor, dev).items():
            moved[key] = moved.get(key, 0) + val
    S = fold_scores(call, c0, c1, L, t, parts, factor, dev, keep_dev=False)
    # one row-wise kernel (rows stay in cache), into the kernels' tile unless L_sep still reads them:
    # the forward then holds two tiles, not three
    P = softmax_into(t["ws"], "P" if call.want_lsep else "w", S)
    del S
    out_aug[..., c0:c1, :] = torch.bmm(P, t["v_aug3"][:, :L]).view(b, nh, C, ve)  # [B, C, ve] -> [b, np, C, ve]
    if call.want_lsep:  # sum_j A_ij phi_ij
        rows["lsep"] = torch.linalg.vecdot(P, tiles["r"].mul_(tiles["w_sep"])).view(b, nh, C)  # [B, C] -> [b, np, C]
    if call.want_lcoh:
        c, oc = rows["centroid"], out_aug[..., c0:c1, hd:]
        rows["lcoh"] = oc[..., -1] - 2 * (c * oc[..., :-1]).sum(-1) + (c * c).sum(-1)
    store_rows(row_out, rows, c0, c1, n)
    store_rows(stats_full, {k_: v_ for k_, v_ in stats.items() if k_ != "mom"}, c0, c1, n)


def _grad_buffers(t: dict) -> dict:
    """The row gradients' sinks (grad_sinks) plus the value buffer and ALiBi's per-(batch, head)
    tau gradient, accumulated over the chunks."""
    q = t["q"]
    acc = grad_sinks(t)
    acc["gv3"] = torch.zeros_like(t["v_aug3"])
    acc["g_tau_alibi"] = torch.zeros(q.shape[0] * q.shape[1], dtype=q.dtype, device=q.device)
    return acc


def _output_grad(call: Call, c0: int, c1: int, out_aug, d_out, g_lcoh, rows: dict):
    """Gradient of the augmented output rows [B, C, ve] (task output, and the L_coh value columns
    [z, |z|^2]) and the gradient reaching the centroids directly through L_coh (or None)."""
    hd = call.hd
    b, nh = out_aug.shape[:2]
    o = out_aug[..., c0:c1, :]
    if d_out is not None and o.shape[-1] == hd:
        dO = d_out[..., c0:c1, :].contiguous()
    else:
        dO = torch.zeros_like(o)
        if d_out is not None:
            dO[..., :hd] = d_out[..., c0:c1, :]
    d_c = None
    if call.want_lcoh and g_lcoh is not None:
        g = g_lcoh[..., c0:c1]
        c = rows["centroid"].detach()
        dO[..., -1] += g
        dO[..., hd:-1] += -2 * g[..., None] * c
        d_c = g[..., None] * (2 * c - 2 * o[..., hd:-1])
    return dO.view(b * nh, c1 - c0, -1), d_c  # [b, np, C, ve] -> [B, C, ve]


def _softmax_backward(call: Call, c0: int, c1: int, L: int, t: dict, parts, factor, tiles: dict, dO3,
                      g_lsep, gv3):  # fmt: skip
    """Rebuild the score tile, add P^T dO into the value buffer and return (dS, P, gl): dS the
    score gradient [B, C, L]; P only when L_sep needs it again (else None, one tile less); gl the
    L_sep row gradient [B, C] (or None)."""
    B, C = dO3.shape[:2]
    S = fold_scores(call, c0, c1, L, t, parts, factor, tiles.get("dev"), keep_dev=True)
    P = softmax_into(t["ws"], "P", S)
    del S
    # S is dead: its role's buffer takes dP (then dS, dphi, dw in place)
    dP = torch.bmm(dO3, t["v_aug3"][:, :L].transpose(1, 2), out=t["ws"].tile("S", (B, C, L)))
    gl = None
    if call.want_lsep and g_lsep is not None:
        gl = g_lsep[..., c0:c1].reshape(B, C)  # [b, np, C] -> [B, C]
        dP.addcmul_(tiles["r"] * tiles["w_sep"], gl[..., None])  # + dL_sep/dA = g phi
    gv3[:, :L].baddbmm_(P.transpose(1, 2), dO3)  # in place: no [L, e] temporary per chunk
    # A * (dA - sum_j A dA), one row-wise kernel; a row with one visible key gets exactly 0
    # in place into dP (the row kernel reduces each row before writing it; checked
    # bit-identical to the out-of-place call): one tile less at the backward peak
    dS = torch.ops.aten._softmax_backward_data.out(dP, P, -1, dP.dtype, grad_input=dP)
    del dP
    return dS, (P if gl is not None else None), gl


def _fold_grads(call: Call, c0: int, c1: int, L: int, t: dict, parts, factor, dev, dS, acc: dict, scratch: str):
    """Gradients through the folded score GEMMs: the key-side operands' buffers and ALiBi's tau
    in place; returns (g_parts {operand name: [B, C, e]}, g_factor [B, C] or None), the
    gradients of the query-side parts and of the Separation row factor. scratch: a dead tile role."""
    g_parts = {}
    for key, qp in parts:
        g_parts[key] = torch.bmm(dS, t[key][:, :L])
        # key side; Zr's gradient is kept in the left layout (see fast_tiles)
        acc["gbuf"][key][:, :L].baddbmm_(dS.transpose(1, 2), swap_last_two(qp) if key == "Zr" else qp)
    if call.hp.other_bias == "alibi":
        B = dS.shape[0]
        alibi = alibi_tile(c0, c1, L, dS.dtype, dS.device)
        acc["g_tau_alibi"] += torch.linalg.vecdot(dS.view(B, -1), alibi.reshape(1, -1).expand(B, -1))
    g_factor = row_dot(t["ws"], scratch, dS, dev) if factor is not None else None
    return g_parts, g_factor


def _separation_dphi(call: Call, c0: int, c1: int, L: int, dS, factor, dev, gx: dict, P, gl):
    """dL/dphi [B, C, L], in place into dS: dL/d dev = f dS (+ 2 g_var dev / denom); through
    mu = mean_j phi_ij the correction is (g_mu - sum_j dL/d dev_ij) / count with sum_j dS_ij = 0
    and sum_j dev_ij = 0 (softmax rows, centred rows): g_mu / count. Invisible entries need no
    mask: w_sep = 0 there, so they reach neither dw * w nor da."""
    B, C = dS.shape[:2]
    count, denom = count_denom(c0, c1, L, call.hp, dS.dtype, dS.device)
    dphi = dS.mul_(factor.reshape(B, C, 1))  # f: [b, np, C] -> [B, C, 1]
    gvar = gx.get("var")
    if gvar is not None:
        dphi.addcmul_(dev, (2 * gvar.reshape(B, C) / denom)[..., None])
    gmu = gx.get("mu")
    if gmu is not None:
        dphi.add_((gmu.reshape(B, C) / count)[..., None])
    if gl is not None:
        dphi.addcmul_(P, gl[..., None])
    return dphi


def _separation_backward(c0: int, c1: int, L: int, t: dict, tiles: dict, dphi, gx: dict, gbuf: dict):
    """phi = relu(a - delta) * w: the affinity's gradient into the Hr buffer (both sides of the
    tile); returns (dw in place of dphi, the density gradient g_mass [B, C, 1] or 0)."""
    B, C = dphi.shape[:2]
    r, w_sep = tiles.pop("r"), tiles["w_sep"]
    da = torch.mul(dphi, w_sep, out=t["ws"].tile("P", dphi.shape))  # P is dead (its last reader: dphi)
    dw = dphi.mul_(r)
    da.mul_(r.sign_())  # relu'(a - delta) = [r > 0], r >= 0; r is not needed after
    del r
    Hr, gH = t["Hr"], gbuf["Hr"]
    gH[:, c0:c1].baddbmm_(da, Hr[:, :L])
    gH[:, :L].baddbmm_(da.transpose(1, 2), Hr[:, c0:c1])
    del da
    grho = gx.get("rho")
    # rho's gradient also hits the diagonal: zeroed in dx (_kernel_backward)
    return dw, (grho.reshape(B, C, 1) if grho is not None else 0)


def _distance_grad(call: Call, L: int, t: dict, tiles: dict, dw, g_mass, gmom3):
    """dL/dx [B, C, L] for the scaled squared distance x of the kernels w = exp(x) (w_coh =
    exp(ratio x) when the two kernel widths differ), in place into dw where it exists."""
    Zr, w_coh = t["Zr"], tiles["w_coh"]
    same = not call.use_sep or not call.hp.use_coh or w_coh is tiles["w_sep"]
    if same:
        if dw is None:  # no Separation: the score gradient (role "S") is dead
            dw = t["ws"].tile("S", w_coh.shape).zero_()
        if gmom3 is not None:
            gm = gmom3.clone()
            gm[..., -2:-1] += g_mass  # the kernel-mass column of Zr is 1
            dw.baddbmm_(gm, Zr[:, :L].transpose(1, 2))
        elif isinstance(g_mass, torch.Tensor):
            dw.add_(g_mass)
        return dw.mul_(w_coh if w_coh is not None else tiles["w_sep"])
    if isinstance(g_mass, torch.Tensor):
        dw.add_(g_mass)
    dx = dw.mul_(tiles["w_sep"])
    if gmom3 is not None:
        dwc = torch.bmm(gmom3, Zr[:, :L].transpose(1, 2), out=t["ws"].tile("dwc", tiles["w_sep"].shape))
        dx.add_(dwc.mul_(w_coh), alpha=t["ratio"])
    return dx


def _kernel_backward(call: Call, c0: int, c1: int, L: int, t: dict, tiles: dict, dw, g_mass, gx: dict,
                     gbuf: dict) -> None:  # fmt: skip
    """Kernel tile: the Cohesion moments' gradient and the distance gradient into the Zr buffer
    (both sides of the tile; clamped entries and the diagonal get none)."""
    C = c1 - c0
    Zr, gZ = t["Zr"], gbuf["Zr"]
    gmom = gx.get("mom")
    gmom3 = None
    if call.hp.use_coh and gmom is not None:
        gmom3 = gmom.reshape(Zr.shape[0], C, -1)  # [b, np, C, e] -> [B, C, e]
        gZ[:, :L].baddbmm_(tiles["w_coh"].transpose(1, 2), swap_last_two(gmom3))
    dx = _distance_grad(call, L, t, tiles, dw, g_mass, gmom3)
    if tiles["clamped"] is not None:
        dx.masked_fill_(tiles["clamped"], 0.0)
    dx[:, :, c0:c1].diagonal(dim1=1, dim2=2).fill_(0.0)
    gZ[:, c0:c1].baddbmm_(dx, Zr[:, :L])
    gZ[:, :L].baddbmm_(dx.transpose(1, 2), Zr[:, c0:c1])


def _backward_chunk(call: Call, c0: int, c1: int, t: dict, stats_full: dict, out_aug, d_out, d_rows: dict,
                    acc: dict, align, g_align) -> None:  # fmt: skip
    """Rows [c0, c1): rebuild the tiles and the per-row algebra, then back-propagate through
    output, softmax, folded GEMMs, row algebra (closed form, fast_row_grads), Separation and kernels,
    accumulating into acc (_grad_buffers). Every tile is dropped on return."""
    hp = call.hp
    L = c1 if hp.causal else t["q"].shape[2]
    stats = {k_: v_[:, :, c0:c1] for k_, v_ in stats_full.items()}
    fresh, tiles = kernel_tiles(call, c0, c1, L, t, keep=True, saved=stats)
    stats.update(fresh)
    x = row_inputs(call, c0, c1, t, stats, align=align is None)
    saved = {}
    parts, factor, rows = row_algebra(call, c0, c1, L, x, saved=saved, align=align)
    dev = tiles.get("dev")
    dO3, d_c = _output_grad(call, c0, c1, out_aug, d_out, d_rows.get("lcoh"), rows)
    dS, P, gl = _softmax_backward(call, c0, c1, L, t, parts, factor, tiles, dO3, d_rows.get("lsep"), acc["gv3"])
    # the probabilities' role is free unless L_sep still reads P
    g_parts, g_factor = _fold_grads(call, c0, c1, L, t, parts, factor, dev, dS, acc, "P" if P is None else "dot")
    if g_align is not None:  # the Alignment block's backward runs once per group (_backward_group)
        g_align.copy_(g_parts.pop("khat3").view(g_align.shape))  # [B, C, hd] -> [b, np, C, hd]
    gx = row_algebra_backward(call, c0, c1, x, saved, rows, g_parts, g_factor, d_rows, d_c)
    scatter_row_grads(c0, c1, x, gx, acc["gbuf"], acc["gq"], acc["g_small"], acc["g_states"])
    if not (call.use_sep or hp.use_coh):
        return
    g_mass, dw = 0, None
    if call.use_sep:
        dphi = _separation_dphi(call, c0, c1, L, dS, factor, dev, gx, P, gl)
        dw, g_mass = _separation_backward(c0, c1, L, t, tiles, dphi, gx, acc["gbuf"])
    P = dS = dphi = None
    _kernel_backward(call, c0, c1, L, t, tiles, dw, g_mass, gx, acc["gbuf"])


def _align_group(call: Call, g0: int, g1: int, t: dict, saved: dict | None):
    """The Alignment block of rows [g0, g1) (a group of chunks, fast_moments.chunk_groups):
    (its inputs x, its part [b, np, G, hd], its row statistics)."""
    L = g1 if call.hp.causal else t["q"].shape[2]
    x = row_inputs(call, g0, g1, t, {})
    part, rows = align_rows(call, g0, g1, L, x, saved)
    return x, part, rows


def _sliced(group: tuple, r0: int, r1: int) -> tuple:
    """(part, rows) of a group restricted to its rows [r0, r1) (views)."""
    part, rows = group
    return part[:, :, r0:r1], {k_: v_[:, :, r0:r1] for k_, v_ in rows.items()}


def _backward_group(call: Call, g0: int, g1: int, chunks: list, t: dict, stats_full: dict, out_aug, d_out,
                    d_rows: dict, acc: dict) -> None:  # fmt: skip
    """The chunks of one group, then the backward of the group's Alignment block from the
    gradient of its part that the chunks wrote into g_part."""
    if not call.hp.use_align:
        for c0, c1 in chunks:
            _backward_chunk(call, c0, c1, t, stats_full, out_aug, d_out, d_rows, acc, None, None)
        return
    saved = {}
    x, part, rows = _align_group(call, g0, g1, t, saved)
    g_part = torch.empty_like(part)
    for c0, c1 in chunks:
        align = _sliced((part, rows), c0 - g0, c1 - g0)
        _backward_chunk(call, c0, c1, t, stats_full, out_aug, d_out, d_rows, acc, align, g_part[:, :, c0 - g0 : c1 - g0])
    gx = align_backward(call, g0, g1, x, saved, rows, g_part, d_rows)
    scatter_row_grads(g0, g1, x, gx, acc["gbuf"], acc["gq"], acc["g_small"], acc["g_states"])


class FusedChunks(torch.autograd.Function):
    """All query chunks of one call (see the module docstring)."""

    @staticmethod
    def forward(ctx, spec: Spec, q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid):
        call = spec.call
        t = _all_operands(call, q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid)
        b, nh, n, hd = q.shape
        ve = t["v_aug3"].shape[-1]
        out_aug = q.new_empty(b, nh, n, ve)
        row_out, stats_full, moved = {}, {}, {}
        for g0, g1, chunks in spec.groups:
            group = _align_group(call, g0, g1, t, None) if call.hp.use_align else None
            for c0, c1 in chunks:
                align = None if group is None else _sliced(group[1:], c0 - g0, c1 - g0)
                _forward_chunk(call, c0, c1, t, out_aug, row_out, stats_full, moved, align)
        del t["ws"]  # the tile buffers go before anything else is allocated
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
        call = spec.call
        *inputs, out_aug = ctx.saved_tensors[:14]
        stats_full = dict(zip(spec.stat_keys, ctx.saved_tensors[14:]))
        t = _all_operands(call, *inputs)
        d_rows = dict(zip(spec.row_keys, d_rows))
        acc = _grad_buffers(t)
        for g0, g1, chunks in spec.groups:
            _backward_group(call, g0, g1, chunks, t, stats_full, out_aug, d_out, d_rows, acc)
        del t["ws"]  # the tile buffers go before the input gradients are formed
        grads = input_grads(call, t, acc.pop("gq"), acc.pop("gbuf"), acc.pop("gv3"), acc["g_small"],
                            acc["g_states"], acc["g_tau_alibi"], ctx.needs_input_grad)  # fmt: skip
        return (None, *grads)
