"""Forward kernels: K1 per-row statistics, K2 attention forward with log-sum-exp.

Grid (query blocks, B); each program streams the key blocks a row block can see (causal: up to
the block's last row). Lengths are runtime arguments (``n`` is not specialised): one compiled
kernel serves every sequence length.
"""

try:  # (a try block also keeps Hugging Face remote-code loading from requiring triton)
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError("the ASCender Triton kernels need triton (pip install triton)") from e

from .tiles import (geometry, load_key_side, load_query_side, load_rows, load_vec, mm, score_tile, store_rows, store_vec,
                    to_acc, visibility)


@triton.jit(do_not_specialize=["n"])
def stats_kernel(zl_ptr, zr_ptr, hl_ptr, hr_ptr, consts_ptr, rho_ptr, mu_ptr, m2_ptr, mom_ptr,
                 n, ZD, HD2,
                 ZP: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 CAUSAL: tl.constexpr, SEP: tl.constexpr, COH: tl.constexpr, RATIO_ONE: tl.constexpr,
                 F64: tl.constexpr, IEEE: tl.constexpr):
    """K1. Per row i over its visible keys: rho_i = sum_{j != i} w_ij, mu_i = mean_j phi_ij and
    the centred sum of squares m2_i = sum_j (phi_ij - mu_i)^2 (block means merged as Chan et
    al., so no E[x^2] - E[x]^2 cancelling) (SEP); mom_i = sum_j wc_ij Zr_j (COH)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * BM + tl.arange(0, BM)
    lo = to_acc(tl.load(consts_ptr), F64)
    ratio = to_acc(tl.load(consts_ptr + 1), F64)
    zl = load_rows(zl_ptr, bh, rows, n, ZD, ZP, F64)
    hl = zl
    if SEP:
        hl = load_rows(hl_ptr, bh, rows, n, HD2, HP, F64)
    zero = tl.sum(zl, 1) * 0.0
    rho = zero
    cnt = zero
    mean = zero
    m2 = zero
    mom = zl * 0.0
    hi = n
    if CAUSAL:
        hi = tl.minimum(n, (pid + 1) * BM)
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        vis, diag = visibility(rows, cols, n, CAUSAL)
        zr = load_rows(zr_ptr, bh, cols, n, ZD, ZP, F64)
        hr = zr
        if SEP:
            hr = load_rows(hr_ptr, bh, cols, n, HD2, HP, F64)
        clamped, w, wc, r = geometry(zl, zr, hl, hr, vis, diag, lo, ratio, SEP, RATIO_ONE, IEEE)
        if SEP:
            rho += tl.sum(tl.where(diag, 0.0, w), 1)
            phi = r * w
            nb = tl.sum(vis.to(zl.dtype), 1)
            mb = tl.sum(phi, 1) / tl.maximum(nb, 1.0)
            dev = tl.where(vis, phi - mb[:, None], 0.0)
            m2b = tl.sum(dev * dev, 1)
            tot = cnt + nb
            delta = mb - mean
            frac = nb / tl.maximum(tot, 1.0)
            mean = mean + delta * frac
            m2 = m2 + m2b + delta * delta * cnt * frac
            cnt = tot
        if COH:
            mom += mm(wc, zr, True)  # IEEE: E|z|^2 - |E z|^2 (the Cohesion gate) cancels like the distances
    if SEP:
        store_vec(rho_ptr, bh, rows, n, rho)
        store_vec(mu_ptr, bh, rows, n, mean)
        store_vec(m2_ptr, bh, rows, n, m2)
    if COH:
        store_rows(mom_ptr, bh, rows, n, ZD, ZP, mom)


@triton.jit(do_not_specialize=["n"])
def forward_kernel(qk_ptr, k_ptr, qa_ptr, ka_ptr, qc_ptr, zl_ptr, zr_ptr, hl_ptr, hr_ptr, fac_ptr, mu_ptr,
                   slope_ptr, consts_ptr, v_ptr, out_ptr, lse_ptr, lsep_ptr,
                   n, HD, ZD, HD2, VD,
                   HDP: tl.constexpr, ZP: tl.constexpr, HP: tl.constexpr, VP: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, ALIGN: tl.constexpr,
                   COH: tl.constexpr, SEP: tl.constexpr, ALIBI: tl.constexpr, LSEP: tl.constexpr,
                   RATIO_ONE: tl.constexpr, F64: tl.constexpr, IEEE: tl.constexpr):
    """K2. Online-softmax attention over the folded score tiles: out_i = sum_j A_ij v_j,
    lse_i = log sum_j exp(S_ij), and (LSEP) the crowding term sum_j A_ij phi_ij."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * BM + tl.arange(0, BM)
    lo = to_acc(tl.load(consts_ptr), F64)
    ratio = to_acc(tl.load(consts_ptr + 1), F64)
    qk, qa, qc, zl, hl, fac, mu = load_query_side(qk_ptr, qa_ptr, qc_ptr, zl_ptr, hl_ptr, fac_ptr, mu_ptr, bh, rows,
                                                  n, HD, ZD, HD2, HDP, ZP, HP, ALIGN, COH, SEP, F64)
    zero = tl.sum(qk, 1) * 0.0
    slope = tl.sum(zero, 0)
    if ALIBI:
        slope = to_acc(tl.load(slope_ptr + bh), F64)
    m = zero + float("-inf")
    l_sum = zero
    ls = zero
    acc = tl.zeros((BM, VP), dtype=qk.dtype)
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
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = load_rows(v_ptr, bh, cols, n, VD, VP, F64)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p, v, IEEE)
        if LSEP:
            ls = ls * alpha + tl.sum(p * phi, 1)
        m = m_new
    store_rows(out_ptr, bh, rows, n, VD, VP, acc / l_sum[:, None])
    store_vec(lse_ptr, bh, rows, n, m + tl.log(l_sum))
    if LSEP:
        store_vec(lsep_ptr, bh, rows, n, ls / l_sum)
