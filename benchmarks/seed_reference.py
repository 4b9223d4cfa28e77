"""The seed's "PyTorch Reference (concise)" ASCenderHead, as written, for the benchmark only.

Adapted just enough to run on already-projected tensors of a group of heads
(q, k, v: [b, np, s, hd]; z: [b, np, s, d_z]; h: [b, np, s, d_a]) instead of projecting X
itself: one head axis added to every shape, and every index shifted by one to make room for it.
Everything else is the seed's code, slips included (top-k includes j == i, the [B, N, N, d]
expand+gather, no gates, torch.std, masking applied after all statistics).

Alignment, as the seed computes it: ``K_hat.unsqueeze(2).expand(B, N, N, d).gather(2, idx)``
expands along the axis it then gathers from, so every gathered row is ``k_hat_i``, the query's
own key: ``u_i = normalize(k * k_hat_i) = k_hat_i`` and the top-k neighbour indices are unused.
With the head axis the same expand-then-gather is ``unsqueeze(3)`` / ``gather(3)``, which is what
this file does (tests/unit/test_seed_reference.py pins it). Our model instead averages the keys of
the k semantic neighbours (ascender_dist/models/ascender/reference.py; pinned by
tests/unit/test_ascender_reference.py::test_reference_matches_per_row_loop). Do not use this for
training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cosine_similarity(x, y, eps=1e-6):
    x = F.normalize(x, dim=-1)
    y = F.normalize(y, dim=-1)
    return x @ y.transpose(-2, -1)


def row_norm(B, eps=1e-6):
    mu = B.mean(dim=-1, keepdim=True)
    sd = B.std(dim=-1, keepdim=True) + eps
    return (B - mu) / sd


def seed_params(dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The seed module's scalar nn.Parameters with its initial values (shared by all heads)."""
    init = dict(lambda_align=1.0, lambda_sep=1.0, lambda_coh=1.0, omega_a=0.1, omega_s=0.1,
                omega_c=0.1, score_temp=1.0, delta=0.2, kappa=32.0)  # fmt: skip
    return {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in init.items()}


def seed_attention(q, k, v, z, h, p: dict, *, k_top=16, tau_sep=1.0, tau_coh=1.0, attn_mask=None):
    """The seed's ASCenderHead.forward from Q, K, V, Z, H on. Returns Y, A, decomposition."""
    Q, K, V, Z, H = q, k, v, z, h
    B, NH, N, _ = Q.shape
    d = Q.size(-1)
    S_base = (Q @ K.transpose(-2, -1)) / (d**0.5)  # [B,NH,N,N]

    Asem = cosine_similarity(H, H)  # [B,NH,N,N]
    topk_val, topk_idx = torch.topk(Asem, k=min(k_top, N), dim=-1)  # [B,NH,N,k]

    K_hat = F.normalize(K, dim=-1)  # [B,NH,N,d]
    # the seed's K_hat.unsqueeze(2).expand(B, N, N, d).gather(2, ...), one axis over: row i of the
    # expanded tensor is k_hat_i repeated, so every "neighbour" gathered is k_hat_i itself
    gather_K = K_hat.unsqueeze(3).expand(B, NH, N, N, d).gather(
        3, topk_idx.unsqueeze(-1).expand(B, NH, N, k_top, d)
    )  # [B,NH,N,k,d]
    u = F.normalize(gather_K.sum(dim=3), dim=-1)  # [B,NH,N,d]
    r_align = K_hat @ u.transpose(-2, -1)  # [B,NH,N,N]  (the seed's orientation)
    beta_align = p["lambda_align"] * r_align

    Zi2 = (Z**2).sum(dim=-1, keepdim=True)  # [B,NH,N,1]
    Zj2 = (Z**2).sum(dim=-1).unsqueeze(-2)  # [B,NH,1,N]
    d2 = Zi2 + Zj2 - 2 * (Z @ Z.transpose(-2, -1))  # [B,NH,N,N]

    w_sep = torch.exp(-d2 / (tau_sep + 1e-6))
    w_coh = torch.exp(-d2 / (tau_coh + 1e-6))

    rho = w_sep.sum(dim=-1, keepdim=True)  # [B,NH,N,1]
    eta = torch.clamp(rho / (p["kappa"] + 1e-6), 0.0, 1.0)

    phi_red = w_sep * F.relu(Asem - p["delta"])
    beta_sep = -p["lambda_sep"] * eta * phi_red

    denom = w_coh.sum(dim=-1, keepdim=True) + 1e-6
    c = (w_coh @ Z) / denom  # [B,NH,N,dz]
    r_coh = -((Z.unsqueeze(2) - c.unsqueeze(3)) ** 2).sum(dim=-1)  # [B,NH,N,N]
    beta_coh = p["lambda_coh"] * r_coh / (tau_coh + 1e-6)

    beta_align = row_norm(beta_align)
    beta_sep = row_norm(beta_sep)
    beta_coh = row_norm(beta_coh)

    S = S_base + p["omega_a"] * beta_align + p["omega_s"] * beta_sep + p["omega_c"] * beta_coh
    if attn_mask is not None:
        S = S.masked_fill(attn_mask == 0, float("-inf"))
    A = torch.softmax(S / (p["score_temp"] + 1e-6), dim=-1)
    Y = A @ V
    return Y, A, dict(S_base=S_base, b_align=beta_align, b_sep=beta_sep, b_coh=beta_coh)
