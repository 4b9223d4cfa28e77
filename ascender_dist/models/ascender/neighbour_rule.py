"""The neighbour choice N_k(i) that every path shares (reference, fast path, Triton path).

N_k(i) is the top-k of search scores over the candidates, and it must not depend on how the
scores were laid out: which rows share a chunk, how many heads share a call (tensor
parallelism), how long the sequence is (a prefix and the whole sequence). Two things would make
it depend on that, and each has its rule here:

* A float32 GEMM rounds the same dot product differently for different tile shapes, so equal
  vectors (a repeated token's ``h`` at the first layer) get scores a last bit apart, in an order
  that changes with the layout. ``search_scores`` computes them in float64 (a float32 product is
  exact there) and rounds the sum to float32: two layouts then differ only when the float64 sums
  straddle a float32 rounding boundary (odds ~1e-9 per pair).
* ``torch.topk`` returns any of several equal scores. ``top_k`` breaks ties by the lowest key
  index, ranking by an int64 key (the score's order-preserving bits, then the index) where ties
  can matter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ascender_dist.config.ascender_hparams import AscenderHParams

@torch.no_grad()
def search_vectors(q, k, h, hp: AscenderHParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(query-side, key-side) vectors whose dot products N_k(i) ranks, detached: unit h for
    the affinity, (q / sqrt(d), k) for the base scores (hp.neighbour_source)."""
    if hp.neighbour_source == "affinity":
        hhat = F.normalize(h.detach(), dim=-1, eps=hp.eps)
        return hhat, hhat
    return q.detach() / math.sqrt(q.shape[-1]), k.detach()


@torch.no_grad()
def search_scores(xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
    """xq . xk^T [.., m, n] computed in float64 and rounded to float32: the same value in
    every layout (module docstring). xq [.., m, e], xk [.., n, e]."""
    return (xq.double() @ xk.double().transpose(-1, -2)).float()


def _rank_keys(scores: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (score descending, key index ascending): the float32 score's bits made
    order-preserving (a negative value's magnitude bits flipped; -0 as +0) in the high 32 bits,
    minus the key index. scores and cols broadcast together."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0 into +0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative: flip all but the sign bit
    return (ordered.to(torch.int64) << 32) - cols.to(torch.int64)


def top_k(scores: torch.Tensor, cand: torch.Tensor, cols: torch.Tensor, k: int, *, every_row: bool | None = None):
    """N_k: the k best candidates of each row, ties to the lowest key index, in rank order.

    scores [.., m] float32 (search_scores), cand [.., m] bool (broadcastable), cols [m] the key
    index of each column (distinct among candidates). Returns idx [.., k] (long, absolute key
    indices) and valid [.., k]; rows with fewer than k candidates get the ones they have and
    invalid slots (idx 0).

    Two ways to the same result. every_row (the default on CUDA): one top-k over int64 keys of
    every candidate, no host sync. Otherwise (the default on CPU, where a full int64 pass costs
    more than the top-k itself): one float top-k of k + 1 places finds the set; only rows whose
    k-th and (k+1)-th scores tie, or with equal scores inside the set, rank by the int64 keys
    (two host syncs per call)."""
    if scores.dtype != torch.float32:  # the keys hold float32 bits: a wider score would be rounded
        raise TypeError(f"top_k ranks float32 scores (search_scores), got {scores.dtype}")
    scores = scores.masked_fill(~cand, float("-inf"))
    m = scores.shape[-1]
    kk = min(k, m)
    if scores.is_cuda if every_row is None else every_row:
        pos = torch.topk(_rank_keys(scores, cols), kk, dim=-1).indices  # [.., kk], in rank order
        val = scores.gather(-1, pos)
    else:
        val, pos = _top_k_where_tied(scores, cols, kk)
    valid = torch.isfinite(val)
    idx = cols[pos]
    if kk < k:
        idx, valid = F.pad(idx, (0, k - kk)), F.pad(valid, (0, k - kk))
    return idx.masked_fill(~valid, 0), valid


def _top_k_where_tied(scores: torch.Tensor, cols: torch.Tensor, kk: int):
    """(val, pos) [.., kk] of top_k's CPU way: int64 keys only on the rows that need them."""
    m = scores.shape[-1]
    if kk < m:
        val, pos = torch.topk(scores, kk + 1, dim=-1)  # [.., kk + 1]
        tied = (val[..., kk - 1] == val[..., kk]) & torch.isfinite(val[..., kk])
        val, pos = val[..., :kk], pos[..., :kk].clone()
        if bool(tied.any()):
            pos[tied] = torch.topk(_rank_keys(scores[tied], cols), kk, dim=-1).indices
            val[tied] = scores[tied].gather(-1, pos[tied])
    else:
        val, pos = torch.sort(scores, dim=-1, descending=True)
    # the set's rank order: only rows with equal scores inside it need the index to order them
    inner = (val[..., 1:] == val[..., :-1]).any(-1)
    if bool(inner.any()):
        order = torch.sort(_rank_keys(val[inner], cols[pos[inner]]), dim=-1, descending=True).indices
        pos[inner], val[inner] = pos[inner].gather(-1, order), val[inner].gather(-1, order)
    return val, pos
