"""Neighbourhoods of the fast path: query chunks, top-k neighbours N_k(i) chunk by chunk (the
shared rule of neighbour_rule; no gradient flows through the choice), and the headings u_i from
the neighbours' keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascender_dist.config.ascender_hparams import AscenderHParams
from .neighbour_rule import search_scores, top_k

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
            scores = search_scores(hq, xk[..., :hi, :])
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
            scores = torch.cat([search_scores(hq, xk[..., lo:hi, :]), search_scores(hq, xk[..., glob, :])],
                               dim=-1)  # [b, np, C, band + g]
        idx, valid = top_k(scores, cand, cols, hp.k)
        out_idx.append(idx)
        out_valid.append(valid)
    return torch.cat(out_idx, dim=-2), torch.cat(out_valid, dim=-2)


def gather_sum(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over valid slots t of x[idx[..., t]]: [b, np, s, e], one [s, e] row gather per slot.

    Rows are picked with index_select from x flattened to [b*np*s + 1, e], whose extra last row
    is 0 and stands for invalid slots (no mask multiply; backward is a row-wise index_add)."""
    b, nh, n, e = x.shape
    flat = torch.cat([x.reshape(b * nh * n, e), x.new_zeros(1, e)])  # [b*np*s + 1, e]
    base = (torch.arange(b * nh, device=x.device) * n).view(b, nh, 1)
    pos = torch.where(valid, idx + base[..., None], b * nh * n)  # [b, np, s, k]
    total = None
    for t in range(idx.shape[-1]):
        sel = flat.index_select(0, pos[..., t].reshape(-1))
        total = sel if total is None else total + sel
    if total is None:
        return torch.zeros_like(x)
    return total.view(b, nh, n, e)  # [b*np*s, e] -> [b, np, s, e]


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


def neighbour_sums(t: dict, c0: int, c1: int):
    """For rows [c0, c1): sum of the valid neighbours' khat [b, np, C, hd] and of their |khat|^2
    [b, np, C] (embedding_bag with 0/1 weights: the [C, k, hd] gather is never formed), plus the
    flat row positions [b, np, C, k] and weights that backward scatters through."""
    idx, valid, khat3 = t["idx"], t["valid"][..., c0:c1, :], t["khat3"]
    b, nh, _, kk = idx.shape
    pos = index_rows(idx, c0, c1, khat3.shape[1])  # [b, np, C, k]
    weight = valid.to(khat3.dtype)
    total = F.embedding_bag(pos.reshape(-1, kk), khat3.reshape(-1, khat3.shape[-1]), mode="sum",
                            per_sample_weights=weight.reshape(-1, kk))  # fmt: skip
    sq = (t["khat_sq"].reshape(-1)[pos] * weight).sum(-1)
    return total.view(b, nh, c1 - c0, -1), sq, pos, weight  # [b*np*C, hd] -> [b, np, C, hd]


def index_rows(idx, c0: int, c1: int, n: int) -> torch.Tensor:
    """Rows of the flattened [B * s, e] operand that the neighbour slots of rows [c0, c1) read."""
    b, nh = idx.shape[:2]
    base = (torch.arange(b * nh, device=idx.device) * n).view(b, nh, 1, 1)
    return idx[..., c0:c1, :] + base  # [b, np, C, k]
