"""Small pieces of ASCender math shared by the reference and the fast path.

Only definitions that are a line or two of formula live here (so both implementations visibly
use the same *definition*, not the same *algorithm*): the row scale of a normalised bias, the
safe square root, the swap of the geometry operands' last two columns, the
visible-key counts, the mass-moved statistic and the aux-loss gradient injector.
"""

from __future__ import annotations

import torch

from ascender_dist.config.ascender_hparams import AscenderHParams


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt with gradient 0 (not inf * 0 = nan) where x == 0, e.g. a row with one visible key."""
    pos = x > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, x, torch.ones_like(x))), torch.zeros_like(x))


def variance_denominator(count: torch.Tensor, hp: AscenderHParams) -> torch.Tensor:
    """1/n (paper, population) or 1/(n-1) (torch.std in the seed code), never 1/0."""
    count = count.to(torch.get_default_dtype()) if not count.is_floating_point() else count
    return count if hp.std_form == "population" else (count - 1).clamp(min=1)


def row_scale(g: torch.Tensor, sigma_r: torch.Tensor, hp: AscenderHParams) -> torch.Tensor:
    """Factor s_i with normalised bias = s_i * (r_ij - mean_j r_ij) for beta_ij = g_i * r_ij.

    pre_norm (paper): beta is normalised, so sigma_beta = |g| sigma_r and
    s = g / (|g| sigma_r + eps); post_norm: the gate scales the normalised raw score,
    s = g / (sigma_r + eps).
    """
    if hp.gate_placement == "pre_norm":
        return g / (g.abs() * sigma_r + hp.eps)
    return g / (sigma_r + hp.eps)


def swap_last_two(x: torch.Tensor) -> torch.Tensor:
    """The last two columns exchanged (a copy): perm of the fast path's geometry operands, which
    turns a right factor Zr_j / Hr_j into the matching left factor (see fast_tiles)."""
    return torch.cat([x[..., :-2], x[..., -1:], x[..., -2:-1]], -1)


def count_denom(c0: int, c1: int, L: int, hp: AscenderHParams, dtype, device):
    """Visible keys per query row [C] of rows [c0, c1) over keys [0, L), and the variance
    denominator [C] (causal: row i sees i + 1 keys; bidirectional: all L)."""
    if hp.causal:
        count = torch.arange(c0 + 1, c1 + 1, dtype=dtype, device=device)
    else:
        count = torch.full((c1 - c0,), float(L), dtype=dtype, device=device)
    return count, variance_denominator(count, hp)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """0.5 * sum_j |p_ij - q_ij|: the share of row i's attention mass that moved."""
    return 0.5 * (p - q).abs().sum(-1)


class AttachAuxLoss(torch.autograd.Function):
    """Return ``out`` unchanged; in backward give ``aux`` the gradient ``scale``.

    This adds d(aux)/d(theta) to the task gradient without changing what the attention call
    returns (the same trick as megatron's MoE aux-loss scaler). ``scale`` defaults to 1;
    set it with set_aux_loss_scale when the task loss is scaled (loss scaling, microbatches).
    """

    scale: float = 1.0

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, AttachAuxLoss.scale)


def set_aux_loss_scale(scale: float) -> None:
    """Scale of the aux-loss gradient relative to a task loss of 1 (e.g. 1/num_microbatches)."""
    AttachAuxLoss.scale = float(scale)


def weighted_aux_total(aux: dict, hp: AscenderHParams) -> torch.Tensor | float:
    """The section 8 objective: each present auxiliary loss times its weight, summed (0 when none is on)."""
    weights = {
        "compactness": hp.aux_compactness_weight,
        "crowding": hp.aux_crowding_weight,
        "alignment": hp.aux_alignment_weight,
    }
    return sum(weights[name] * value for name, value in aux.items())
