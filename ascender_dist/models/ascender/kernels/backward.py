"""Backward kernels, no atomics: every output row is reduced by the one program that owns it.

* ``row_grad_kernel`` (grid: query blocks x B), run twice:
  - K3 (GEOM=False): gradients of the folded query parts, dQk_i = sum_j dS_ij k_j (likewise
    qa / khat, qc / Zr), the Separation row factor's dL/dfac_i = sum_j dS_ij dev_ij and the
    ALiBi row sums sum_j dS_ij |i - j|. The torch per-row algebra turns these into the row
    gradients of the statistics (var, mu, rho, mom) that K4 and K5 need.
  - K4 (GEOM=True): the query-row side of the geometry operands, dZl_i = sum_j dx_ij Zr_j and
    dHl_i = sum_j da_ij Hr_j (fast_tiles keeps both sides in the left layout; see there).
* ``col_grad_kernel`` (K5, grid: key blocks x B): everything a key row receives, dk_j, dkhat_j,
  dZ_j (folded Cohesion part, distance, Cohesion moments), dH_j and dv_j, summed over the query
  blocks that see it.
"""

try:  # (a try block also keeps Hugging Face remote-code loading from requiring triton)
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError("the ASCender Triton kernels need triton (pip install triton)") from e

from .tiles import (geometry_grads, load_key_side, load_query_side, load_rows, load_vec, mm, score_tile, softmax_grads,
                    store_rows, store_vec, to_acc)


@triton.jit(do_not_specialize=["n"])
def row_grad_kernel(qk_ptr, k_ptr, qa_ptr, ka_ptr, qc_ptr, zl_ptr, zr_ptr, hl_ptr, hr_ptr, fac_ptr, mu_ptr,
                    slope_ptr, consts_ptr, v_ptr, do_ptr, lse_ptr, dd_ptr, gl_ptr,
                    cvar_ptr, cmu_ptr, grho_ptr, gmom_ptr,
                    gqk_ptr, gqa_ptr, gqc_ptr, gfac_ptr, galibi_ptr, gzl_ptr, ghl_ptr,
                    n, HD, ZD, HD2, VD,
                    HDP: tl.constexpr, ZP: tl.constexpr, HP: tl.constexpr, VP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, ALIGN: tl.constexpr,
                    COH: tl.constexpr, SEP: tl.constexpr, ALIBI: tl.constexpr, LSEP: tl.constexpr,
                    RATIO_ONE: tl.constexpr, F64: tl.constexpr, IEEE: tl.constexpr, GEOM: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * BM + tl.arange(0, BM)
    lo = to_acc(tl.load(consts_ptr), F64)
    ratio = to_acc(tl.load(consts_ptr + 1), F64)
    qk, qa, qc, zl, hl, fac, mu = load_query_side(qk_ptr, qa_ptr, qc_ptr, zl_ptr, hl_ptr, fac_ptr, mu_ptr, bh, rows,
                                                  n, HD, ZD, HD2, HDP, ZP, HP, ALIGN, COH, SEP, F64)
    gmom = qk
    zero = tl.sum(qk, 1) * 0.0
    gl = zero
    cvar = zero
    cmu = zero
    grho = zero
    slope = tl.sum(zero, 0)
    if ALIBI:
        slope = to_acc(tl.load(slope_ptr + bh), F64)
    if LSEP:
        gl = load_vec(gl_ptr, bh, rows, n, F64)
    if GEOM:
        if SEP:
            cvar = load_vec(cvar_ptr, bh, rows, n, F64)
            cmu = load_vec(cmu_ptr, bh, rows, n, F64)
            grho = load_vec(grho_ptr, bh, rows, n, F64)
        if COH:
            gmom = load_rows(gmom_ptr, bh, rows, n, ZD, ZP, F64)
    do = load_rows(do_ptr, bh, rows, n, VD, VP, F64)
    lse = load_vec(lse_ptr, bh, rows, n, F64)
    dd = load_vec(dd_ptr, bh, rows, n, F64)
    gqk = qk * 0.0
    gqa = qa * 0.0
    gqc = qc * 0.0
    gzl = zl * 0.0
    ghl = hl * 0.0
    gfac = zero
    galibi = zero
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid + 1) * BM)
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        k, ka, zr, hr = load_key_side(k_ptr, ka_ptr, zr_ptr, hr_ptr, bh, cols, n, HD, ZD, HD2, HDP, ZP, HP,
                                      ALIGN, COH, SEP, F64)
        s, vis, diag, clamped, w, wc, r, phi, dev = score_tile(
            rows, cols, n, qk, k, qa, ka, qc, zl, zr, hl, hr, fac, mu, slope, lo, ratio,
            CAUSAL, ALIGN, COH, SEP, ALIBI, RATIO_ONE, IEEE)
        v = load_rows(v_ptr, bh, cols, n, VD, VP, F64)
        p, ds = softmax_grads(s, lse, do, v, gl, dd, phi, rows, n, CAUSAL, LSEP, IEEE)
        if GEOM:
            da, dx = geometry_grads(ds, p, fac, cvar, cmu, grho, gl, gmom, zr, dev, r, w, wc, clamped, diag,
                                    vis, ratio, SEP, COH, LSEP, IEEE)
            if SEP or COH:
                gzl += mm(dx, zr, True)  # IEEE: see geometry_grads
            if SEP:
                ghl += mm(da, hr, IEEE)
        else:
            gqk += mm(ds, k, IEEE)
            if ALIGN:
                gqa += mm(ds, ka, IEEE)
            if COH:
                gqc += mm(ds, zr, IEEE)
            if SEP:
                gfac += tl.sum(ds * dev, 1)
            if ALIBI:
                dist = tl.abs(rows[:, None] - cols[None, :]).to(ds.dtype)
                galibi += tl.sum(tl.where(vis, ds * dist, 0.0), 1)
    if GEOM:
        if SEP or COH:
            store_rows(gzl_ptr, bh, rows, n, ZD, ZP, gzl)
        if SEP:
            store_rows(ghl_ptr, bh, rows, n, HD2, HP, ghl)
    else:
        store_rows(gqk_ptr, bh, rows, n, HD, HDP, gqk)
        if ALIGN:
            store_rows(gqa_ptr, bh, rows, n, HD, HDP, gqa)
        if COH:
            store_rows(gqc_ptr, bh, rows, n, ZD, ZP, gqc)
        if SEP:
            store_vec(gfac_ptr, bh, rows, n, gfac)
        if ALIBI:
            store_vec(galibi_ptr, bh, rows, n, galibi)


@triton.jit(do_not_specialize=["n"])
def col_grad_kernel(qk_ptr, k_ptr, qa_ptr, ka_ptr, qc_ptr, qcl_ptr, zl_ptr, zr_ptr, hl_ptr, hr_ptr, fac_ptr,
                    mu_ptr, slope_ptr, consts_ptr, v_ptr, do_ptr, lse_ptr, dd_ptr, gl_ptr,
                    cvar_ptr, cmu_ptr, grho_ptr, gmom_ptr, gmoml_ptr,
                    gk_ptr, gka_ptr, gz_ptr, gh_ptr, gv_ptr,
                    n, HD, ZD, HD2, VD,
                    HDP: tl.constexpr, ZP: tl.constexpr, HP: tl.constexpr, VP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, ALIGN: tl.constexpr,
                    COH: tl.constexpr, SEP: tl.constexpr, ALIBI: tl.constexpr, LSEP: tl.constexpr,
                    RATIO_ONE: tl.constexpr, F64: tl.constexpr, IEEE: tl.constexpr):
    """K5. Key block [start_n, start_n + BN) against every query block that sees it."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = pid * BN + tl.arange(0, BN)
    lo = to_acc(tl.load(consts_ptr), F64)
    ratio = to_acc(tl.load(consts_ptr + 1), F64)
    k, ka, zr, hr = load_key_side(k_ptr, ka_ptr, zr_ptr, hr_ptr, bh, cols, n, HD, ZD, HD2, HDP, ZP, HP, ALIGN, COH, SEP,
                                  F64)
    v = load_rows(v_ptr, bh, cols, n, VD, VP, F64)
    slope = tl.sum(tl.sum(k, 1) * 0.0, 0)
    if ALIBI:
        slope = to_acc(tl.load(slope_ptr + bh), F64)
    gk = k * 0.0
    gka = ka * 0.0
    gz = zr * 0.0
    gh = hr * 0.0
    gv = v * 0.0
    first = 0
    if CAUSAL:
        first = (pid * BN // BM) * BM
    for start in range(first, n, BM):
        rows = start + tl.arange(0, BM)
        qk, qa, qc, zl, hl, fac, mu = load_query_side(qk_ptr, qa_ptr, qc_ptr, zl_ptr, hl_ptr, fac_ptr, mu_ptr, bh,
                                                      rows, n, HD, ZD, HD2, HDP, ZP, HP, ALIGN, COH, SEP, F64)
        # the same rows in the key layout (Zr, Hr): the distance and affinity gradients of key j
        qcl = qk
        zq = qk
        hq = qk
        gmom = qk
        gmoml = qk
        zero = tl.sum(qk, 1) * 0.0
        gl = zero
        cvar = zero
        cmu = zero
        grho = zero
        if COH:
            qcl = load_rows(qcl_ptr, bh, rows, n, ZD, ZP, F64)
            gmom = load_rows(gmom_ptr, bh, rows, n, ZD, ZP, F64)
            gmoml = load_rows(gmoml_ptr, bh, rows, n, ZD, ZP, F64)
        if SEP or COH:
            zq = load_rows(zr_ptr, bh, rows, n, ZD, ZP, F64)
        if SEP:
            hq = load_rows(hr_ptr, bh, rows, n, HD2, HP, F64)
            cvar = load_vec(cvar_ptr, bh, rows, n, F64)
            cmu = load_vec(cmu_ptr, bh, rows, n, F64)
            grho = load_vec(grho_ptr, bh, rows, n, F64)
        if LSEP:
            gl = load_vec(gl_ptr, bh, rows, n, F64)
        do = load_rows(do_ptr, bh, rows, n, VD, VP, F64)
        lse = load_vec(lse_ptr, bh, rows, n, F64)
        dd = load_vec(dd_ptr, bh, rows, n, F64)
        s, vis, diag, clamped, w, wc, r, phi, dev = score_tile(
            rows, cols, n, qk, k, qa, ka, qc, zl, zr, hl, hr, fac, mu, slope, lo, ratio,
            CAUSAL, ALIGN, COH, SEP, ALIBI, RATIO_ONE, IEEE)
        # rows >= n (padding of the last query block) must not contribute
        p, ds = softmax_grads(s, lse, do, v, gl, dd, phi, rows, n, CAUSAL, LSEP, IEEE)
        live = rows[:, None] < n
        p = tl.where(live, p, 0.0)
        ds = tl.where(live, ds, 0.0)
        gv += mm(tl.trans(p), do, IEEE)
        gk += mm(tl.trans(ds), qk, IEEE)
        if ALIGN:
            gka += mm(tl.trans(ds), qa, IEEE)
        if COH:
            gz += mm(tl.trans(ds), qcl, IEEE)
            gz += mm(tl.trans(tl.where(live, wc, 0.0)), gmoml, IEEE)
        if SEP or COH:
            da, dx = geometry_grads(ds, p, fac, cvar, cmu, grho, gl, gmom, zr, dev, r, w, wc, clamped, diag,
                                    vis, ratio, SEP, COH, LSEP, IEEE)
            dx = tl.where(live, dx, 0.0)
            gz += mm(tl.trans(dx), zq, True)  # IEEE: see geometry_grads
            if SEP:
                da = tl.where(live, da, 0.0)
                gh += mm(tl.trans(da), hq, IEEE)
    store_rows(gk_ptr, bh, cols, n, HD, HDP, gk)
    store_rows(gv_ptr, bh, cols, n, VD, VP, gv)
    if ALIGN:
        store_rows(gka_ptr, bh, cols, n, HD, HDP, gka)
    if SEP or COH:
        store_rows(gz_ptr, bh, cols, n, ZD, ZP, gz)
    if SEP:
        store_rows(gh_ptr, bh, cols, n, HD2, HP, gh)
