"""The autograd.Function of the fused fast path (see fast_tiles for the layout)."""

from __future__ import annotations

import torch

from .common import count_denom, swap_last_two
from .fast_grads import input_grads
from .fast_rows import SMALL, row_algebra, row_inputs, rows_backward, store_rows
from .fast_tiles import Spec, alibi_tile, fold_scores, kernel_tiles, moved_stats, operands


class FusedChunks(torch.autograd.Function):
    """All query chunks of one call; see the comment at the top of this section."""

    @staticmethod
    def forward(ctx, spec: Spec, q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid):
        call, hp = spec.call, spec.call.hp
        t = operands(call, q, k, v, z, h, delta, tau, slope)
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
            stats, tiles = kernel_tiles(call, c0, c1, L, t, keep=call.want_lsep)
            x = row_inputs(call, c0, c1, t, stats, leaf=False)
            parts, factor, rows = row_algebra(call, c0, c1, L, x)
            dev = tiles.get("dev")
            if call.with_stats:
                for key, val in moved_stats(call, c0, c1, L, t, rows, factor, dev).items():
                    moved[key] = moved.get(key, 0) + val
            S = fold_scores(call, c0, c1, L, t, parts, factor, dev, keep_dev=False)
            P = torch.softmax(S, -1)  # one row-wise kernel (rows stay in cache)
            del S
            out_aug[..., c0:c1, :] = torch.bmm(P, t["v_aug3"][:, :L]).view(b, nh, C, ve)
            if call.want_lsep:  # sum_j A_ij phi_ij
                rows["lsep"] = torch.linalg.vecdot(P, tiles["r"].mul_(tiles["w_sep"])).view(b, nh, C)
            if call.want_lcoh:
                c, oc = rows["centroid"], out_aug[..., c0:c1, hd:]
                rows["lcoh"] = oc[..., -1] - 2 * (c * oc[..., :-1]).sum(-1) + (c * c).sum(-1)
            store_rows(row_out, rows, c0, c1, n)
            store_rows(stats_full, {k_: v_ for k_, v_ in stats.items() if k_ != "mom"}, c0, c1, n)
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
        t = operands(call, q, k, v, z, h, delta, tau, slope)
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
            fresh, tiles = kernel_tiles(call, c0, c1, L, t, keep=True, saved=stats)
            stats.update(fresh)
            with torch.enable_grad():
                x = row_inputs(call, c0, c1, t, stats, leaf=True)
                parts, factor, rows = row_algebra(call, c0, c1, L, x)
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
            S = fold_scores(call, c0, c1, L, t, parts_det, f_det, dev, keep_dev=True)
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
                gbuf[key][:, :L].baddbmm_(dS.transpose(1, 2), swap_last_two(qd) if key == "Zr" else qd)
            if hp.other_bias == "alibi":
                alibi = alibi_tile(c0, c1, L, dtype, dev_)
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
                count, denom = count_denom(c0, c1, L, hp, dtype, dev_)
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
                gZ[:, :L].baddbmm_(w_coh.transpose(1, 2), swap_last_two(gmom3))
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
        Zr = gZ = Hr = gH = None  # the buffers are released one by one in input_grads
        return (None, *input_grads(call, t, gq, gbuf, gv3, g_small, g_states, g_tau_alibi, ctx.needs_input_grad))
