"""Gradients of the fused fast path's inputs from its whole-sequence gradient buffers."""

from __future__ import annotations

import torch

from .fast_moments import moment_states_backward
from .fast_tiles import Call, centred


def normalize_backward_(x: torch.Tensor, xhat: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """Gradient with respect to x of xhat = x / max(|x|, eps) given g = dL/dxhat (F.normalize),
    computed in place into g (a whole-sequence buffer: no full-size temporary)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    radial = torch.linalg.vecdot(xhat, g)[..., None].masked_fill_(norm <= eps, 0.0)
    return g.addcmul_(xhat, radial, value=-1.0).div_(norm.clamp_(min=eps))



def input_grads(call: Call, t, gq, gbuf, gv3, g_small, g_states, g_tau_alibi, needs) -> list:
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
        g_delta = -0.5 * gH[..., da].reshape(b, nh, n).sum((0, 2))  # [B, s] -> [b, np, s] -> [np]
        gh = normalize_backward_(h.reshape(B, n, da), t.pop("Hr")[..., :da], gH[..., :da], hp.eps).reshape(h.shape)
        del gH
    gk = gbuf.pop("k3")
    if hp.use_align:
        g_khat = gbuf.pop("khat3")
        g_khat.addcmul_(t["khat3"], gbuf.pop("khat_sq")[..., None], value=2.0)
        moment_states_backward(t["khat3"], t["align_states"], g_states["align"], hp.causal, g_khat)
        gk += normalize_backward_(t["k3"], t.pop("khat3"), g_khat, hp.eps)
        del g_khat
    dz = z.shape[-1]
    z3 = centred(z).reshape(B, n, dz)  # the operands' coordinates (fast_tiles.centred): [B, s, dz]
    gz = None
    if "Zr" in gbuf:  # left layout [s z, -a |z|^2, 1]
        gZ = gbuf.pop("Zr")
        if hp.use_coh:
            moment_states_backward(t["Zr"], t["coh_states"], g_states["coh"], hp.causal, gZ, swap=True)
        gz = gZ[..., :dz] * t["s"]
        gz.addcmul_(z3, gZ[..., dz : dz + 1], value=-2 * t["a"])
        del gZ
    gv3_out = gv3
    if call.want_lcoh:  # v_aug = [v, z, |z|^2]
        g_lcoh = gv3[..., hd : hd + dz] + 2 * z3 * gv3[..., hd + dz :]
        gz = g_lcoh if gz is None else gz.add_(g_lcoh)
        gv3_out = gv3[..., :hd]
    if gz is not None:  # through z - z_0: position 0 also takes minus every position's gradient
        gz[:, :1] -= gz.sum(1, keepdim=True)
    gz = torch.zeros_like(z) if gz is None else gz.view_as(z)
    gh = torch.zeros_like(h) if gh is None else gh
    g_delta = torch.zeros_like(t["delta"]) if g_delta is None else g_delta
    g_tau = g_small["tau"]
    if hp.other_bias == "alibi":
        g_tau = g_tau + g_tau_alibi.view(b, nh).sum(0) * t["slope"] / (t["tau"] * t["tau"])
    grads = [gq, gk.view_as(k), gv3_out.reshape(b, nh, n, hd), gz, gh,
             g_small["omega"], g_small["lambdas"], g_delta, g_small["kappa"], g_tau, None, None, None]  # fmt: skip
    return [g if need else None for g, need in zip(grads, needs[1:])]
