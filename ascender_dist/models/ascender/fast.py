"""ASCender attention without any n x n tensor per head: memory O(s * (window + chunk)).

Same inputs and outputs as ``reference.py`` (q, k, v: [b, np, s, hd]; z: [b, np, s, d_z];
h: [b, np, s, d_a]) and the same math, rearranged (docs/ascender.md, "Fast path"):

* Alignment and Cohesion are bilinear in a per-query and a per-key vector, so they fold into
  the attention scores (shared/design/ascender-math.md section 2): one GEMM per folded part,
  q_i . k_j, (w_a s_a(i) u_i) . khat_j and (2 w_c s_c(i) y_i) . Zr_j, accumulated into one
  tile; no concatenated key tensor is ever built. Their row means are row constants (softmax
  ignores them) and their row stds come from the covariance of the keys over the visible
  positions: a global covariance (bidirectional) or running states every MOMENT_STRIDE rows
  plus the keys since the last state (causal). No statistic of row i reads a key j > i.
* Separation (not low-rank), the densities rho_i, the centroids c_i and the row statistics of
  Separation are built per query chunk on a [chunk, keys] tile from two augmented operands
  (Zr, Hr: a distance and a thresholded affinity are one GEMM each). One autograd.Function
  (fast_function.FusedChunks) takes the raw inputs, derives every whole-sequence operand itself in forward
  and again in backward, keeps no tile and nothing derived, and differentiates the tile math and
  the O(chunk) per-row algebra by hand, one chunk at a time (the Alignment rows, which read no
  tile, once per group of chunks).
* Neighbourhoods (no gradient flows through the choice of neighbours) are found chunk by
  chunk over a band of +-window keys plus the globals (O(s * window)), or over all visible
  keys when window == 0 (O(s * chunk) memory).

Modules: fast_neighbours (chunks, neighbours, headings), fast_moments (causal moment states and
their backward), fast_tiles (operands, kernel / Separation tiles, scores), fast_rows (the per-row
algebra and its gradient scatter), fast_row_grads (its closed-form backward), fast_grads (input
gradients from the buffers),
fast_function (the autograd.Function). The GPU path is the Triton kernels in ``kernels/``, which
reuse the operand and row helpers.
"""

from __future__ import annotations

import torch

from ascender_dist.config.ascender_hparams import AscenderHParams
from .fast_function import FusedChunks
from .fast_neighbours import chunk_bounds, neighbours
from .neighbour_rule import search_vectors
from .fast_rows import aux_losses
from .fast_tiles import Call, Spec, with_z_origin
from .params import AscenderHeadParams
from .reference import AscenderResult


def fast_attention(
    q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
    with_aux: bool = False, with_stats: bool = False,
) -> AscenderResult:  # fmt: skip
    """ASCender attention in O(s * (window + chunk)) memory. Same result as reference_attention
    (out [b, np, s, hd]; rows: per-row statistics; stats: per-head mass moved; aux losses), no maps.
    bf16 / fp16 inputs run in fp32 and the output is cast back, as the Triton path does (softmax,
    row statistics and the gradient sums over chunks would otherwise round at 8 bits)."""
    in_dtype = q.dtype
    low = in_dtype in (torch.bfloat16, torch.float16)
    if low:
        q, k, v, z, h = (x.float() for x in (q, k, v, z, h))
    dt = q.dtype
    b, nh, n, hd = q.shape
    chunks = chunk_bounds(n, b * nh, hp)
    call = Call(hp, n, hd, use_sep, with_aux, with_stats)
    idx, valid = neighbours(*search_vectors(q, k, h, hp), hp, chunks)  # [b, np, s, k]
    spec = Spec(call, chunks)
    outs = FusedChunks.apply(
        spec, q.contiguous(), k.contiguous(), v.contiguous(), z.contiguous(), h.contiguous(), params.omega.to(dt),
        params.lambdas.to(dt), params.delta.to(dt), params.density_scale().to(dt), params.score_temperature().to(dt),
        params.alibi_slope.to(dt), idx.to(torch.int32), valid,  # int32: half the bytes kept for backward
    )  # fmt: skip
    rows = {"neighbour_idx": idx, "neighbour_valid": valid, **dict(zip(spec.row_keys, outs[1:]))}
    aux = aux_losses(rows, rows.get("u"), idx, valid, hp, call) if with_aux else {}
    out = outs[0].to(in_dtype) if low else outs[0]
    return AscenderResult(out=out, rows=with_z_origin(rows, z), stats=spec.moved, aux=aux)
