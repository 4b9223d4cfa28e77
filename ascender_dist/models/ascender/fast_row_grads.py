"""Closed-form backward of one chunk's per-row algebra (fast_rows.row_algebra with ``saved``).

Every step is [b, np, C]-sized; written out by hand because re-running the algebra under
autograd cost more per chunk (graph building, one engine node per op) than the algebra itself.
The result maps each input of the algebra (row_inputs' names; ``name#i`` for the entries of a
moment state) to its gradient, which fast_rows.scatter_row_grads adds into the whole-sequence
buffers; the fast path and the Triton path both use it; align_backward is
the Alignment block alone, run once per group of chunks.
tests/unit/test_ascender_row_grads.py checks it against autograd in float64.
"""

from __future__ import annotations

import math

import torch

from ascender_dist.config.ascender_hparams import AscenderHParams
from .fast_grads import normalize_backward_
from .fast_moments import row_moments_backward
from .fast_tiles import Call
from .params import ALIGN, COH, SEP


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """Sum of x [b, np, ...] over everything but the head dimension: [np]."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).sum(-1)


def row_scale_backward(g, sig, hp: AscenderHParams, g_s):
    """(dL/dg, dL/dsigma) of s = common.row_scale(g, sigma) given dL/ds."""
    if hp.gate_placement == "pre_norm":  # s = g / (|g| sigma + eps)
        inv = 1.0 / (g.abs() * sig + hp.eps)
        return g_s * (inv - g.abs() * sig * inv * inv), -g_s * g * g.abs() * inv * inv
    inv = 1.0 / (sig + hp.eps)  # post_norm: s = g / (sigma + eps)
    return g_s * inv, -g_s * g * inv * inv


def safe_sqrt_backward(v, sig, g_sig):
    """dL/dv of sig = common.safe_sqrt(v): 0 where v <= 0."""
    pos = v > 0
    return torch.where(pos, g_sig * 0.5 / torch.where(pos, sig, torch.ones_like(sig)), torch.zeros_like(sig))


def sigmoid_arg_grad(g_gate, gate, alpha: float, arg):
    """dL/d(arg) of gate = sigmoid(-alpha * clamp(arg, min=0)) given dL/d gate."""
    return g_gate * gate * (1 - gate) * (-alpha) * (arg >= 0)


class _Grads:
    """Accumulators of one chunk's backward: leaf gradients by name and the per-head sums."""

    def __init__(self, x: dict):
        self.gx: dict = {}
        self.omega = torch.zeros_like(x["omega"])
        self.lambdas = torch.zeros_like(x["lambdas"])
        self.tau = torch.zeros_like(x["tau"])

    def part(self, G, P, tau):
        """A folded part P = (...) / tau with gradient G [b, np, C, e]: tau's share."""
        self.tau -= _per_head((G * P).sum(-1)) / tau


def row_algebra_backward(call: Call, c0: int, c1: int, x: dict, saved: dict, rows: dict, g_parts: dict,
                         g_factor, d_rows: dict, d_centroid=None) -> dict:  # fmt: skip
    """Gradients of row_algebra's leaves (q, the per-head parameters, ktot / ksq / khat and the
    Alignment states, mom / Zr and the Cohesion states, rho / mu / var) from the gradients of
    its outputs: g_parts {operand name: [B, C, e]} of the folded query parts, g_factor [B, C]
    of the Separation row factor (or None), d_rows {row name: [b, np, s, ...]} of the returned
    row statistics (entries may be None), d_centroid [b, np, C, dz] (L_coh, or None)."""
    b, nh, C, hd = x["q"].shape
    tau = x["tau"]
    acc = _Grads(x)
    d = _row_grad_getter(d_rows, rows, c0, c1)
    G0 = g_parts["k3"].view(b, nh, C, hd)  # [B, C, hd] -> [b, np, C, hd]
    acc.gx["q"] = G0 / (math.sqrt(call.hd) * tau.view(1, -1, 1, 1))
    acc.part(G0, saved["parts"]["k3"], tau)
    if "align" in saved:
        _align_backward(call, x, saved["align"], g_parts["khat3"].view(b, nh, C, hd), d, acc)
    if call.hp.use_coh:
        _coh_backward(call, x, saved, g_parts["Zr"].view(b, nh, C, -1), d, d_centroid, acc)
    if call.use_sep:
        _sep_backward(call, x, saved, g_factor.view(b, nh, C), d, acc)
    acc.gx.update(omega=acc.omega, lambdas=acc.lambdas, tau=acc.tau)
    return acc.gx


def align_backward(call: Call, c0: int, c1: int, x: dict, saved: dict, rows: dict, G, d_rows: dict) -> dict:
    """Gradients of the Alignment block's leaves (ktot, ksq, khat, its moment state, omega,
    lambdas, tau) for rows [c0, c1) (fast_rows.align_rows with ``saved``), from the gradient G
    [b, np, C, hd] of its folded part and d_rows of its row statistics (rows: their names)."""
    acc = _Grads(x)
    _align_backward(call, x, saved, G, _row_grad_getter(d_rows, rows, c0, c1), acc)
    acc.gx.update(omega=acc.omega, lambdas=acc.lambdas, tau=acc.tau)
    return acc.gx


def _row_grad_getter(d_rows: dict, rows: dict, c0: int, c1: int):
    """name -> the gradient of row statistic name on rows [c0, c1), or None."""

    def d(name):
        g = d_rows.get(name)
        return g[:, :, c0:c1] if g is not None and name in rows else None

    return d


def _add(a, b):
    return a if b is None else a + b


def _align_backward(call: Call, x: dict, sv: dict, G, d, acc: _Grads) -> None:
    """Alignment: part omega_a s u / tau, s = row_scale(lambda_a gate(spread), sigma(u)), u the
    normalised neighbour sum ktot, spread from ktot and ksq."""
    hp = call.hp
    tau3 = x["tau"].view(1, -1, 1)
    om = x["omega"][:, ALIGN].view(1, -1, 1)
    uq, s = sv["uq"], sv["s"]
    Gu = (G * uq).sum(-1)
    acc.part(G, sv["part"], x["tau"])
    acc.omega[:, ALIGN] += _per_head(s * Gu / tau3)
    g_s = _add(om * Gu / tau3, d("align_scale"))
    g_uq = _add(G * (om * s / tau3)[..., None], d("u"))
    g_g, g_sig = row_scale_backward(sv["g"], sv["sig"], hp, g_s)
    g_var = safe_sqrt_backward(sv["v"], sv["sig"], g_sig) * sv["count"] / sv["denom"]
    g_x, g_khat, g_state = row_moments_backward(sv["moments"], d("align_mean"), g_var)
    g_uq = g_uq + g_x
    gate = sv["gate"]
    acc.lambdas[:, ALIGN] += _per_head(g_g * gate)
    g_gate = _add(g_g * x["lambdas"][:, ALIGN].view(1, -1, 1), d("gate_align"))
    ktot, c1 = x["ktot"], sv["nsum"].clamp(min=1)
    spread_raw = x["ksq"] / c1 - (ktot * ktot).sum(-1) / (c1 * c1)
    g_spread = sigmoid_arg_grad(g_gate, gate, hp.alpha_align, spread_raw)
    g_ktot = normalize_backward_(ktot, uq, g_uq.clone(), hp.eps)
    g_ktot.addcmul_(ktot, (g_spread * (-2.0) / (c1 * c1))[..., None])
    acc.gx.update(ktot=g_ktot, ksq=g_spread / c1)
    if g_khat is not None:
        acc.gx["khat"] = g_khat
    for i, g in enumerate(g_state):
        acc.gx[f"align_state#{i}"] = g


def _coh_backward(call: Call, x: dict, saved: dict, G, d, d_centroid, acc: _Grads) -> None:
    """Cohesion: part 2 omega_c s y / tau, y = [c / s_z, 0, 1 / (2a)], c and E|z|^2 from the
    moments mom, s = row_scale(lambda_c gate / tau_coh, 2 sigma(y))."""
    hp, sv = call.hp, saved["coh"]
    tau3 = x["tau"].view(1, -1, 1)
    om = x["omega"][:, COH].view(1, -1, 1)
    y, s, c, gate = sv["y"], sv["s"], sv["c"], sv["gate"]
    sz, a = x["s_z"], x["a"]
    Gy = (G * y).sum(-1)
    acc.part(G, saved["parts"]["Zr"], x["tau"])
    acc.omega[:, COH] += _per_head(2 * s * Gy / tau3)
    g_s = _add(om * 2 * Gy / tau3, d("coh_scale"))
    g_y = G * (om * 2 * s / tau3)[..., None]
    g_g, g_sig = row_scale_backward(sv["g"], sv["sig"], hp, g_s)
    g_var = safe_sqrt_backward(sv["v"], sv["sig"], g_sig) * 4 * saved["count"] / saved["denom"]
    d_mean = d("coh_mean")  # coh_mean = 2 mean_p - |c|^2
    g_x, g_Zr, g_state = row_moments_backward(sv["moments"], None if d_mean is None else 2 * d_mean, g_var)
    g_y = g_y + g_x
    g_c = g_y[..., :-2] / sz
    acc.lambdas[:, COH] += _per_head(g_g * gate / hp.tau_coh)
    g_gate = _add(g_g * x["lambdas"][:, COH].view(1, -1, 1) / hp.tau_coh, d("gate_coh"))
    g_ez2 = sigmoid_arg_grad(g_gate, gate, hp.alpha_coh, sv["ez2"] - sv["c2"])
    g_c2 = -g_ez2 if d_mean is None else -g_ez2 - d_mean
    g_c = g_c.addcmul_(c, 2 * g_c2[..., None])
    g_c = _add(_add(g_c, d("centroid")), d_centroid)
    mass = sv["mass"]
    g_mass = -((g_c * c).sum(-1, keepdim=True) + (g_ez2 * sv["ez2"])[..., None]) / mass  # c, ez2 ~ 1 / mass
    acc.gx["mom"] = torch.cat([g_c / (sz * mass), g_mass, -g_ez2[..., None] / (a * mass)], -1)
    if g_Zr is not None:
        acc.gx["Zr"] = g_Zr
    for i, g in enumerate(g_state):
        acc.gx[f"coh_state#{i}"] = g


def _sep_backward(call: Call, x: dict, saved: dict, g_factor, d, acc: _Grads) -> None:
    """Separation: factor omega_s s / tau, s = row_scale(-lambda_s eta, sqrt(var)),
    eta = min(1, rho / kappa)."""
    hp, sv = call.hp, saved["sep"]
    tau3 = x["tau"].view(1, -1, 1)
    om = x["omega"][:, SEP].view(1, -1, 1)
    s = sv["s"]
    acc.omega[:, SEP] += _per_head(g_factor * s / tau3)
    acc.tau -= _per_head(g_factor * sv["factor"]) / x["tau"]
    g_s = _add(g_factor * om / tau3, d("sep_scale"))
    g_g, g_sig = row_scale_backward(sv["g"], sv["sig"], hp, g_s)
    acc.gx["var"] = safe_sqrt_backward(x["var"], sv["sig"], g_sig)
    acc.lambdas[:, SEP] -= _per_head(g_g * sv["eta"])
    g_eta = _add(-g_g * x["lambdas"][:, SEP].view(1, -1, 1), d("eta"))
    g_ratio = g_eta * (sv["ratio"] <= 1.0)  # clamp(max=1)
    kappa = x["kappa"].view(1, -1, 1)
    acc.gx["rho"] = _add(g_ratio / kappa, d("rho"))
    acc.gx["kappa"] = -_per_head(g_ratio * x["rho"]) / (x["kappa"] * x["kappa"])
    if d("sep_mean") is not None:  # sep_mean = mu
        acc.gx["mu"] = d("sep_mean")
