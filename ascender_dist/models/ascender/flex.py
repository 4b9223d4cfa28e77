"""GPU variant: FlexAttention computes the Separation bias inside the attention kernel.

Training needs CUDA (torch 2.13 has no FlexAttention backward on CPU). On CPU the forward runs
through FlexAttention's eager (unfused) implementation, which is how CI checks the score_mod
math against the reference (test_flex_forward_matches_reference_on_cpu); the compiled kernel,
its backward and bf16 have NOT been run here (no GPU was lent): treat them as unverified until
tests/unit/test_ascender_fast.py::test_flex_matches_reference passes on a CUDA machine.

Plan: the same whole-sequence preparation as fast.py; one chunked, checkpointed pass computes
the folded queries (Alignment, Cohesion) and the per-row statistics of Separation (eta_i,
mean, scale); then flex_attention over the folded q/k with a score_mod that rebuilds
phi_ij = exp(-|z_i - z_j|^2 / tau) * relu(a_ij - delta) tile by tile from z and h (two small
dot products unrolled over d_z and d_a), so nothing n x n is stored, and a causal block mask.
"""

from __future__ import annotations

import torch

from .fast import _chunk_queries, _Call, merge_rows, prepare, run_chunks
from .hparams import AscenderHParams
from .params import SEP, AscenderHeadParams
from .reference import AscenderResult


_COMPILED_FLEX = None


def _flex_kernel(device: torch.device):
    """torch.compile'd flex_attention on CUDA (the fused kernel; eager flex_attention
    materialises the s x s scores), the eager one elsewhere (CPU parity tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_available() -> bool:
    """FlexAttention importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _row_pass(call: _Call, c0: int, c1: int, t: dict):
    """Folded queries and row statistics of one chunk (the tile bias is dropped)."""
    q_aug, _, _, rows, _ = _chunk_queries(call, c0, c1, t)
    rows.pop("phi", None)
    return q_aug, rows


def flex_attention_path(
    q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
    with_aux: bool = False,
) -> AscenderResult:  # fmt: skip
    """ASCender attention with FlexAttention (CUDA). Aux losses are not supported here."""
    from torch.nn.attention.flex_attention import create_block_mask

    if with_aux:
        raise NotImplementedError("aux losses need impl='fast' (the flex path has no probabilities)")
    b, nh, n, hd = q.shape
    call, t, chunks, rows = prepare(q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=False, with_stats=False)
    results = run_chunks(_row_pass, call, t, chunks)
    q_aug = torch.cat([r[0] for r in results], -2)  # [b, np, s, e]
    rows = merge_rows(rows, [r[1] for r in results])
    tau = params.tau_score
    z2 = (z * z).sum(-1)  # [b, np, s]
    hhat = t["hhat"]
    dz, da = z.shape[-1], hhat.shape[-1]
    k_sep = hp.kernel_denominator(hp.tau_sep)
    if use_sep:
        sep_scale = rows["sep_scale"] * params.omega[:, SEP].view(1, -1, 1) / tau.view(1, -1, 1)
        sep_mean = rows["sep_mean"]
    slope = params.alibi_slope

    def score_mod(score, bi, hi, qi, ki):
        if use_sep:
            zz = sum(z[bi, hi, qi, e] * z[bi, hi, ki, e] for e in range(dz))
            aa = sum(hhat[bi, hi, qi, e] * hhat[bi, hi, ki, e] for e in range(da))
            d2 = torch.where(qi == ki, 0.0, (z2[bi, hi, qi] + z2[bi, hi, ki] - 2 * zz).clamp(min=0))
            phi = torch.exp(-d2 / k_sep) * torch.relu(aa - params.delta[hi])
            score = score + sep_scale[bi, hi, qi] * (phi - sep_mean[bi, hi, qi])
        if hp.other_bias == "alibi":
            score = score - slope[hi] * (qi - ki).abs() / tau[hi]
        return score

    block_mask = None
    if hp.causal:
        block_mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n, device=q.device)
    out = _flex_kernel(q.device)(q_aug, t["k_aug"], v, score_mod=score_mod, block_mask=block_mask, scale=1.0)
    return AscenderResult(out=out, rows=rows)
