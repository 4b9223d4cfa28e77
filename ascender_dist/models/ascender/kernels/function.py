"""ASCender attention through the Triton kernels: the fast path's math with the tile work in
kernels and the per-row algebra in torch, reused from the fast path's modules (fast_tiles,
fast_rows, fast_grads).

Forward (one autograd.Function, inputs q, k, v, z, h and the per-head parameters):
1. whole-sequence operands (fast_tiles.operands: khat, Zr, Hr, moment states), neighbours (torch);
2. K1: per-row statistics of the kernel tiles (rho, Separation mean / centred squares, Cohesion
   moments);
3. the per-row algebra of fast_rows.row_algebra, chunk by chunk (headings, gates, row scales, centroids):
   the folded query parts qk, qa, qc and the Separation row factor;
4. K2: attention over the folded scores with the Separation tile rebuilt per block; log-sum-exp.
Backward: K3 (gradients of the folded query parts and of the row factor), the per-row algebra
re-run under autograd to turn them into gradients of the row statistics, K4 / K5 (geometry
gradients by query row and by key row), then input_grads maps the operand gradients back
to the inputs. Nothing n x n is stored; kept for backward: inputs, out, lse, row statistics.
"""

from __future__ import annotations

import contextlib


import torch

from ..common import count_denom, swap_last_two
from ..fast_grads import input_grads
from ..fast_moments import MOMENT_STRIDE
from ..fast_neighbours import chunk_bounds, neighbours
from ..neighbour_rule import search_vectors
from ..fast_row_grads import row_algebra_backward
from ..fast_rows import aux_losses, grad_sinks, row_algebra, row_inputs, scatter_row_grads, store_rows
from ..fast_tiles import Call, Spec, kernel_tiles, moved_stats, operands, with_z_origin
from ascender_dist.config.ascender_hparams import AscenderHParams
from ..params import AscenderHeadParams
from ..reference import AscenderResult
from .launch import Ops, attention_col_grads, attention_forward, attention_row_grads, kernel_arg_floor, row_stats
from .tiles import interpreting


# Cap on b*heads*rows*keys of one chunk's torch tiles around the kernels on a GPU (causal row
# moments, neighbour scores): 2^26 entries, 256 MiB in fp32.
CUDA_ROW_TILE_ELEMS = 2**26


def _row_tile_width(rows: int, n: int, call: Call) -> int:
    """Keys per row of the widest torch tile of a chunk of ``rows`` query rows: the causal row
    moments read the keys from the chunk's moment state on, the neighbour search a band of
    2 x window + globals around the chunk (all n keys unwindowed), the diagnostics all n."""
    hp = call.hp
    width = rows + MOMENT_STRIDE if hp.causal else 0
    width = max(width, rows + 2 * hp.window + hp.num_global if hp.window > 0 else n)
    return n if call.with_stats else min(width, n)


def row_chunks(n: int, batch_heads: int, call: Call, on_cuda: bool) -> list[tuple[int, int]]:
    """Query chunks of the torch work around the kernels (per-row algebra, neighbour search).
    CPU tensors (the interpreter) take the fast path's chunks, so short test sequences run several.
    On a GPU each chunk costs a few hundred small kernel launches whatever its size (with the fast
    path's 64-row chunks one layer call took 400 ms at n = 2048 on an H200), so chunks are as
    long as CUDA_ROW_TILE_ELEMS allows: halved from n until their widest tile fits."""
    if not on_cuda:
        return chunk_bounds(n, batch_heads, call.hp)
    rows = n
    while rows > 16 and batch_heads * rows * _row_tile_width(rows, n, call) > CUDA_ROW_TILE_ELEMS:
        rows = (rows + 1) // 2
    return [(c0, min(c0 + rows, n)) for c0 in range(0, n, rows)]


def _swap(x: torch.Tensor) -> torch.Tensor:
    return swap_last_two(x).contiguous()


def _counts(call: Call, n: int, dtype, device):
    """Visible keys per row [n] and the variance denominator [n]."""
    return count_denom(0, n, n, call.hp, dtype, device)


def _make_ops(call: Call, t: dict, ieee: bool) -> Ops:
    """Kernel operands that do not depend on the per-row algebra (query parts come later)."""
    hp = call.hp
    B, n, hd = t["k3"].shape
    ops = Ops(qk=t["k3"], k=t["k3"].contiguous(), v=t["v_aug3"].contiguous(), interpreted=interpreting())
    dtype = t["k3"].dtype
    if hp.use_align:
        ops.ka = t["khat3"].contiguous()
    ratio = 1.0
    if call.use_sep or hp.use_coh:
        ops.zr = t["Zr"].contiguous()
        ops.zl = _swap(t["Zr"])
        ratio = t["ratio"]
    if call.use_sep:
        ops.hr = t["Hr"].contiguous()
        ops.hl = _swap(t["Hr"])
    if hp.other_bias == "alibi":
        ops.slope = t["slope_tau_b"].to(dtype).contiguous()
    lo = kernel_arg_floor(dtype)
    # filled on the device: torch.tensor([...], device=cuda) copies from pageable host memory, a
    # synchronising copy that also makes the call impossible to capture in a CUDA graph
    ops.consts = torch.full((2,), lo, dtype=dtype, device=t["k3"].device)
    ops.consts[1].fill_(ratio)
    ops.flags = dict(CAUSAL=hp.causal, ALIGN=hp.use_align, COH=hp.use_coh, SEP=call.use_sep,
                     ALIBI=hp.other_bias == "alibi", LSEP=call.want_lsep, RATIO_ONE=ratio == 1.0,
                     F64=dtype == torch.float64, IEEE=ieee)  # fmt: skip
    return ops


def _stats(call: Call, ops: Ops, b: int, nh: int) -> dict:
    """K1 row statistics as row_algebra reads them ([b, np, s(, e)])."""
    (rho, mu, m2), mom = row_stats(ops)
    n = ops.qk.shape[1]
    stats = {}
    if rho is not None:
        _, denom = _counts(call, n, m2.dtype, m2.device)
        stats.update(rho=rho.view(b, nh, n), mu=mu.view(b, nh, n), var=(m2 / denom).view(b, nh, n))
    if mom is not None:
        stats["mom"] = mom.view(b, nh, n, -1)
    return stats


def _slice(stats: dict, c0: int, c1: int) -> dict:
    return {k_: v_[:, :, c0:c1] for k_, v_ in stats.items()}


def _row_parts(spec: Spec, t: dict, stats: dict, ops: Ops, with_rows: bool, with_stats: bool):
    """Per-row algebra of every chunk without autograd: fills ops.qk / qa / qc / fac / mu and
    returns the row outputs [b, np, s, ...] (and the mass-moved sums when ``with_stats`` and the
    call wants them: forward only, backward would rebuild the diagnostic tiles for nothing)."""
    call, hp = spec.call, spec.call.hp
    b, nh, n, hd = t["q"].shape
    B = b * nh
    q3 = {"k3": torch.empty_like(t["k3"])}
    if hp.use_align:
        q3["khat3"] = torch.empty_like(t["k3"])
    if hp.use_coh:
        q3["Zr"] = torch.empty_like(t["Zr"])
    fac = t["k3"].new_empty(B, n) if call.use_sep else None
    row_out, moved = {}, {}
    for c0, c1 in spec.chunks:
        L = c1 if hp.causal else n
        x = row_inputs(call, c0, c1, t, _slice(stats, c0, c1))
        parts, factor, rows = row_algebra(call, c0, c1, L, x)
        for key, p in parts:
            q3[key][:, c0:c1] = p
        if factor is not None:
            fac[:, c0:c1] = factor.reshape(B, c1 - c0)
        if call.with_stats and with_stats:  # diagnostics: the fast path's explicit no-grad tiles
            _, tiles = kernel_tiles(call, c0, c1, L, t, keep=False)
            for key, val in moved_stats(call, c0, c1, L, t, rows, factor, tiles.get("dev")).items():
                moved[key] = moved.get(key, 0) + val
        if with_rows:
            store_rows(row_out, rows, c0, c1, n)
    t.pop("ws")  # the diagnostics' tile buffers go before the kernels run
    ops.qk = q3["k3"]
    ops.qa = q3.get("khat3")
    ops.qc = q3.get("Zr")
    ops.fac = fac
    if "mu" in stats:
        ops.mu = stats["mu"].reshape(B, n).contiguous()
    return row_out, moved


class _TritonAttention(torch.autograd.Function):
    """All rows of one call through the kernels; see the module docstring."""

    @staticmethod
    def forward(ctx, spec: Spec, ieee: bool, q_in, k_in, v_in, z_in, h_in, omega, lambdas, delta, kappa, tau, slope,
                idx, valid):  # fmt: skip
        call, hp = spec.call, spec.call.hp
        # bf16 / fp16 inputs are kept as given for backward (half the bytes of fp32 copies) and
        # computed in the parameters' dtype
        q, k, v, z, h = (x.to(omega.dtype) for x in (q_in, k_in, v_in, z_in, h_in))
        t = operands(call, q, k, v, z, h, delta, tau, slope)
        t.update(omega=omega, lambdas=lambdas, delta=delta, kappa=kappa, tau=tau, slope=slope, idx=idx, valid=valid)
        b, nh, n, hd = q.shape
        ops = _make_ops(call, t, ieee)
        stats = _stats(call, ops, b, nh) if (call.use_sep or hp.use_coh) else {}
        row_out, moved = _row_parts(spec, t, stats, ops, with_rows=True, with_stats=True)
        out3, lse, lsep = attention_forward(ops)
        out_aug = out3.view(b, nh, n, -1)
        if lsep is not None:
            row_out["lsep"] = lsep.view(b, nh, n)
        if call.want_lcoh:
            c, oc = row_out["centroid"], out_aug[..., hd:]
            row_out["lcoh"] = oc[..., -1] - 2 * (c * oc[..., :-1]).sum(-1) + (c * c).sum(-1)
        spec.row_keys = list(row_out)
        spec.stat_keys = list(stats)
        spec.moved = {k_: v_ / n for k_, v_ in moved.items()}
        out = out_aug if out_aug.shape[-1] == hd else out_aug[..., :hd].contiguous()
        ctx.spec, ctx.ieee = spec, ieee
        extra = [lsep] if lsep is not None else []
        ctx.save_for_backward(q_in, k_in, v_in, z_in, h_in, omega, lambdas, delta, kappa, tau, slope, idx, valid,
                              out_aug, lse, *extra, *stats.values())  # fmt: skip
        ctx.set_materialize_grads(False)
        return (out, *row_out.values())

    @staticmethod
    def backward(ctx, d_out, *d_rows):
        spec = ctx.spec
        call = spec.call
        q, k, v, z, h, omega, lambdas, delta, kappa, tau, slope, idx, valid, out_aug, lse, *rest = ctx.saved_tensors
        q, k, v, z, h = (x.to(omega.dtype) for x in (q, k, v, z, h))  # the gradients return in it (autograd
        # casts them to the inputs' dtype)
        lsep = rest.pop(0) if call.want_lsep else None
        stats = dict(zip(spec.stat_keys, rest))
        t = operands(call, q, k, v, z, h, delta, tau, slope)
        t.update(omega=omega, lambdas=lambdas, delta=delta, kappa=kappa, tau=tau, slope=slope, idx=idx, valid=valid)
        d_rows = dict(zip(spec.row_keys, d_rows))
        ops = _make_ops(call, t, ctx.ieee)
        row_out, _ = _row_parts(spec, t, stats, ops, with_rows=call.want_lcoh, with_stats=False)
        dO3, d_c, dd, gl = _output_grad(call, out_aug, d_out, d_rows, row_out, lsep)
        # K3: folded query parts and the Separation row factor
        gqk, gqa, gqc, gfac, galibi = attention_row_grads(ops, dO3, lse, dd, gl, None)
        g_parts = {"k3": gqk, "khat3": gqa, "Zr": gqc, "fac": gfac, "centroid": d_c}
        acc, row_g, gmom = _rows_backward_all(spec, t, stats, g_parts, d_rows)
        B = dO3.shape[0]
        g_tau_alibi = galibi.sum(-1) if galibi is not None else torch.zeros(B, dtype=q.dtype, device=q.device)
        gv3 = _geometry_grads(call, ops, acc["gbuf"], row_g, gmom, (dO3, lse, dd, gl))
        grads = input_grads(call, t, acc["gq"], acc["gbuf"], gv3, acc["g_small"], acc["g_states"], g_tau_alibi,
                            ctx.needs_input_grad[1:])  # fmt: skip
        return (None, None, *grads)


def _output_grad(call: Call, out_aug, d_out, d_rows: dict, row_out: dict, lsep):
    """Gradient of the augmented output rows dO3 [B, s, ve] (task output, L_coh value columns),
    the centroids' direct L_coh gradient d_c (or None), the row sums dd = sum_e dO o (+ gl lsep)
    [B, s] and the L_sep row gradient gl [B, s] (zeros when L_sep exists without a gradient)."""
    b, nh, n, _ = out_aug.shape
    hd, B = call.hd, b * nh
    dO = torch.zeros_like(out_aug)
    if d_out is not None:
        dO[..., :hd] = d_out
    d_c = None
    g_lcoh = d_rows.get("lcoh")
    if call.want_lcoh and g_lcoh is not None:
        c = row_out["centroid"]
        dO[..., -1] += g_lcoh
        dO[..., hd:-1] += -2 * g_lcoh[..., None] * c
        d_c = g_lcoh[..., None] * (2 * c - 2 * out_aug[..., hd:-1])
    dO3 = dO.view(B, n, -1)  # [b, np, s, ve] -> [B, s, ve]
    gl = None
    dd = (dO * out_aug).sum(-1).view(B, n)
    if call.want_lsep:  # the kernels read gl whenever the crowding loss exists
        g = d_rows.get("lsep")
        gl = torch.zeros(B, n, dtype=dO.dtype, device=dO.device) if g is None else g.reshape(B, n).contiguous()
        dd = dd + gl * lsep.view(B, n)
    return dO3, d_c, dd, gl


def _rows_backward_all(spec: Spec, t: dict, stats: dict, g_parts: dict, d_rows: dict):
    """The per-row algebra's closed-form backward (fast_row_grads, as the fast path), chunk by
    chunk: returns the sinks (fast_rows.grad_sinks), the row-statistic gradients row_g {var, mu,
    rho} [B, s] and the Cohesion moments' gradient gmom [B, s, e] (or None) that the geometry
    kernels read."""
    call, hp = spec.call, spec.call.hp
    b, nh, n, _ = t["q"].shape
    B = b * nh
    dtype, dev_ = t["q"].dtype, t["q"].device
    acc = grad_sinks(t)
    row_g = {key: torch.zeros(B, n, dtype=dtype, device=dev_) for key in ("var", "mu", "rho")}
    gmom = torch.zeros_like(t["Zr"]) if hp.use_coh else None
    for c0, c1 in spec.chunks:
        L = c1 if hp.causal else n
        C = c1 - c0
        x = row_inputs(call, c0, c1, t, _slice(stats, c0, c1))
        saved: dict = {}
        parts, factor, rows = row_algebra(call, c0, c1, L, x, saved=saved)
        g_chunk = {key: g_parts[key][:, c0:c1] for key, _ in parts}  # [B, C, e]
        g_factor = g_parts["fac"][:, c0:c1] if factor is not None else None  # [B, C]
        d_c = g_parts["centroid"][:, :, c0:c1] if g_parts["centroid"] is not None else None
        gx = row_algebra_backward(call, c0, c1, x, saved, rows, g_chunk, g_factor, d_rows, d_c)
        scatter_row_grads(c0, c1, x, gx, acc["gbuf"], acc["gq"], acc["g_small"], acc["g_states"])
        for key in row_g:
            if key in gx:
                row_g[key][:, c0:c1] = gx[key].reshape(B, C)
        if gmom is not None and "mom" in gx:
            gmom[:, c0:c1] = gx["mom"].reshape(B, C, -1)
    return acc, row_g, gmom


def _geometry_grads(call: Call, ops: Ops, gbuf: dict, row_g: dict, gmom, attn: tuple):
    """K4 / K5: the tile geometry's gradients (distance, affinity, moments) by query row and by
    key row, added into gbuf; returns the value gradient gv3 [B, s, ve]. attn = (dO3, lse, dd, gl)."""
    hp = call.hp
    n = ops.qk.shape[1]
    if call.use_sep or hp.use_coh:
        count, denom = _counts(call, n, ops.qk.dtype, ops.qk.device)
        geom = dict(cvar=(2 * row_g["var"] / denom).contiguous() if call.use_sep else None,
                    cmu=(row_g["mu"] / count).contiguous() if call.use_sep else None,
                    grho=row_g["rho"] if call.use_sep else None,
                    gmom=gmom.contiguous() if gmom is not None else None)  # fmt: skip
        gzl, ghl = attention_row_grads(ops, *attn, geom)
        gbuf["Zr"] += gzl
        if ghl is not None:
            gbuf["Hr"] += ghl
        geom["gmoml"] = _swap(gmom) if gmom is not None else None
    else:
        geom = dict(cvar=None, cmu=None, grho=None, gmom=None, gmoml=None)
    qcl = _swap(ops.qc) if ops.qc is not None else None
    gk, gka, gz, gh, gv3 = attention_col_grads(ops, qcl, *attn, geom)
    gbuf["k3"] += gk
    if gka is not None:
        gbuf["khat3"] += gka
    if gz is not None:
        gbuf["Zr"] += gz
    if gh is not None:
        gbuf["Hr"] += gh
    return gv3


def triton_attention(
    q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
    with_aux: bool = False, with_stats: bool = False,
) -> AscenderResult:  # fmt: skip
    """fast_attention's contract (same arguments, same result) through the Triton kernels.
    bf16 / fp16 inputs run in fp32 (kernels accumulate in fp32; the output is cast back), fp64
    in fp64; also under torch.autocast (HF inference), which would otherwise run the torch-side
    row algebra and neighbour search in bf16."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _triton_attention(q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=with_aux, with_stats=with_stats)


def _triton_attention(q, k, v, z, h, params: AscenderHeadParams, hp: AscenderHParams, *, use_sep: bool,
                      with_aux: bool, with_stats: bool) -> AscenderResult:  # fmt: skip
    in_dtype = q.dtype
    low = in_dtype in (torch.bfloat16, torch.float16)
    given = [x.contiguous() for x in (q, k, v, z, h)]  # what _TritonAttention keeps for backward
    if low:
        q, k, v, z, h = (x.float() for x in (q, k, v, z, h))
    b, nh, n, hd = q.shape
    call = Call(hp, n, hd, use_sep, with_aux, with_stats)
    chunks = row_chunks(n, b * nh, call, q.is_cuda)
    idx, valid = neighbours(*search_vectors(q, k, h, hp), hp, chunks)  # [b, np, s, k]
    spec = Spec(call, chunks)
    dt = q.dtype
    # Triton launches on the current device, not the tensors': a model on cuda:1 while the current
    # device is 0 (an evaluation tool, device_map="auto") needs the switch (backward's autograd
    # thread switches by itself)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        outs = _TritonAttention.apply(
            spec, not low, *given, params.omega.to(dt), params.lambdas.to(dt), params.delta.to(dt),
            params.density_scale().to(dt), params.score_temperature().to(dt), params.alibi_slope.to(dt), idx.to(torch.int32), valid,
        )  # fmt: skip
    rows = with_z_origin({"neighbour_idx": idx, "neighbour_valid": valid, **dict(zip(spec.row_keys, outs[1:]))}, z)
    aux = aux_losses(rows, rows.get("u"), idx, valid, hp, call) if with_aux else {}
    out = outs[0].to(in_dtype) if low else outs[0]
    return AscenderResult(out=out, rows=rows, stats=spec.moved, aux=aux)
