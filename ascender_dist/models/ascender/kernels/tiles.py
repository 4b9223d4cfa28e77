"""Triton device helpers shared by the ASCender kernels: masked loads/stores and one score tile.

A tile is query rows ``rows`` [BM] x key columns ``cols`` [BN] of one batch-head ``bh``. Every
operand is a contiguous ``[B, n, W]`` tensor (B = batch * heads) read as a ``[rows, WP]`` block
(WP = W padded to a power of two >= 16), zero outside ``rows < n`` and ``col < W``; offsets are
int64. Values are computed in fp64 when F64 (fp64 inputs) and fp32 otherwise (inputs are upcast
on load: the interpreter multiplies bf16 as integers, and fp32 accumulation is the contract).

The score tile is the fast path's folded score (fast_tiles, "fused path"):
    S_ij = qk_i . k_j + qa_i . khat_j + qc_i . Zr_j + fac_i * dev_ij - slope * |i - j|
with dev_ij = phi_ij - mu_i on visible entries (0 elsewhere), phi_ij = w_ij * relu(Hl_i . Hr_j),
w_ij = exp(clamp(Zl_i . Zr_j, lo, 0)) (w_ii = 1, 0 where invisible), and S = -inf where j is
invisible (causal: j > i) or j >= n.
"""

try:  # (a try block also keeps Hugging Face remote-code loading from requiring triton)
    import triton
    import triton.language as tl
except ImportError as e:  # only imported once triton_supported() said yes
    raise ImportError("the ASCender Triton kernels need triton (pip install triton)") from e


def interpreting() -> bool:
    """Kernels run by the Triton interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return bool(getattr(triton.knobs.runtime, "interpret", False))


def device(fn):
    """A device helper: ``@triton.jit`` when compiling; under the interpreter the plain function.
    The interpreter re-patches triton.language on every call of a nested jit function (~3 ms,
    most of a test's time); the launching kernel has patched it already, so the plain function
    runs the same operations."""
    return fn if interpreting() else triton.jit(fn)


@device
def to_acc(x, F64: tl.constexpr):
    if F64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return y


@device
def mm(a, b, IEEE: tl.constexpr):
    """a @ b; IEEE: exact fp32 products (no TF32), used unless the caller's inputs were bf16/fp16."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@device
def load_rows(ptr, bh, rows, n, W, WP: tl.constexpr, F64: tl.constexpr):
    """[len(rows), WP] block of the [B, n, W] tensor at batch-head bh (int64), 0 outside."""
    cols = tl.arange(0, WP)
    offs = (bh * n + rows[:, None].to(tl.int64)) * W + cols[None, :]
    mask = (rows[:, None] < n) & (cols[None, :] < W)
    return to_acc(tl.load(ptr + offs, mask=mask, other=0.0), F64)


@device
def store_rows(ptr, bh, rows, n, W, WP: tl.constexpr, val):
    cols = tl.arange(0, WP)
    offs = (bh * n + rows[:, None].to(tl.int64)) * W + cols[None, :]
    mask = (rows[:, None] < n) & (cols[None, :] < W)
    tl.store(ptr + offs, val.to(ptr.dtype.element_ty), mask=mask)


@device
def load_vec(ptr, bh, rows, n, F64: tl.constexpr):
    """[len(rows)] entries of the [B, n] tensor at batch-head bh, 0 outside."""
    return to_acc(tl.load(ptr + bh * n + rows.to(tl.int64), mask=rows < n, other=0.0), F64)


@device
def store_vec(ptr, bh, rows, n, val):
    tl.store(ptr + bh * n + rows.to(tl.int64), val.to(ptr.dtype.element_ty), mask=rows < n)


@device
def load_query_side(qk_ptr, qa_ptr, qc_ptr, zl_ptr, hl_ptr, fac_ptr, mu_ptr, bh, rows, n, HD, ZD, HD2,
                    HDP: tl.constexpr, ZP: tl.constexpr, HP: tl.constexpr, ALIGN: tl.constexpr,
                    COH: tl.constexpr, SEP: tl.constexpr, F64: tl.constexpr):
    """The query-row operands of a score tile: qk, qa, qc [BM, *], zl, hl [BM, *] and the
    Separation row factor and mean fac, mu [BM]; an operand of a bias that is off is a stand-in
    (qk, or zeros) that score_tile never reads."""
    qk = load_rows(qk_ptr, bh, rows, n, HD, HDP, F64)
    qa = qk
    qc = qk
    zl = qk
    hl = qk
    zero = tl.sum(qk, 1) * 0.0
    fac = zero
    mu = zero
    if ALIGN:
        qa = load_rows(qa_ptr, bh, rows, n, HD, HDP, F64)
    if COH:
        qc = load_rows(qc_ptr, bh, rows, n, ZD, ZP, F64)
    if SEP or COH:
        zl = load_rows(zl_ptr, bh, rows, n, ZD, ZP, F64)
    if SEP:
        hl = load_rows(hl_ptr, bh, rows, n, HD2, HP, F64)
        fac = load_vec(fac_ptr, bh, rows, n, F64)
        mu = load_vec(mu_ptr, bh, rows, n, F64)
    return qk, qa, qc, zl, hl, fac, mu


@device
def load_key_side(k_ptr, ka_ptr, zr_ptr, hr_ptr, bh, cols, n, HD, ZD, HD2, HDP: tl.constexpr,
                  ZP: tl.constexpr, HP: tl.constexpr, ALIGN: tl.constexpr, COH: tl.constexpr,
                  SEP: tl.constexpr, F64: tl.constexpr):
    """The key-row operands of a score tile: k, khat [BN, HD], Zr [BN, ZD], Hr [BN, HD2] (stand-ins
    for biases that are off, as in load_query_side)."""
    k = load_rows(k_ptr, bh, cols, n, HD, HDP, F64)
    ka = k
    zr = k
    hr = k
    if ALIGN:
        ka = load_rows(ka_ptr, bh, cols, n, HD, HDP, F64)
    if SEP or COH:
        zr = load_rows(zr_ptr, bh, cols, n, ZD, ZP, F64)
    if SEP:
        hr = load_rows(hr_ptr, bh, cols, n, HD2, HP, F64)
    return k, ka, zr, hr


@device
def visibility(rows, cols, n, CAUSAL: tl.constexpr):
    """[BM, BN] bool: key j exists and is visible to row i; and the diagonal i == j."""
    vis = (cols[None, :] < n) & (rows[:, None] >= 0)
    if CAUSAL:
        vis = vis & (cols[None, :] <= rows[:, None])
    return vis, rows[:, None] == cols[None, :]


@device
def geometry(zl, zr, hl, hr, vis, diag, lo, ratio, SEP: tl.constexpr, RATIO_ONE: tl.constexpr,
             IEEE: tl.constexpr):
    """Kernel tiles: (clamped, w, wc, r). x = Zl_i . Zr_j = -|z_i - z_j|^2 / k_main, at most 0
    (clamped marks x > 0 by rounding: no gradient there), 0 on the diagonal, -inf where invisible;
    w = exp(max(x, lo)) (Separation's kernel, or Cohesion's when Separation is off),
    wc = exp(max(ratio * x, lo)) (Cohesion's: each kernel's exponent gets the floor itself, so a
    ratio far from 1 floors neither kernel above the denormals), r = relu(Hl_i . Hr_j) = relu(a_ij - delta) (SEP).
    The distance GEMM is IEEE fp32 whatever the inputs' precision: it forms -|z_i - z_j|^2 as a difference
    of larger terms, which TF32's 10-bit products cancel (near pairs' kernel weights off by several %)."""
    x = mm(zl, tl.trans(zr), True)
    clamped = x > 0
    x = tl.minimum(x, 0.0)
    x = tl.where(diag, 0.0, x)
    w = tl.exp(tl.where(vis, tl.maximum(x, lo), float("-inf")))
    if RATIO_ONE:
        wc = w
    else:
        wc = tl.exp(tl.where(vis, tl.maximum(x * ratio, lo), float("-inf")))
    if SEP:
        r = tl.maximum(mm(hl, tl.trans(hr), IEEE), 0.0)
    else:
        r = w * 0.0
    return clamped, w, wc, r


@device
def score_tile(rows, cols, n, qk, k, qa, ka, qc, zl, zr, hl, hr, fac, mu, slope, lo, ratio,
               CAUSAL: tl.constexpr, ALIGN: tl.constexpr, COH: tl.constexpr, SEP: tl.constexpr,
               ALIBI: tl.constexpr, RATIO_ONE: tl.constexpr, IEEE: tl.constexpr):
    """The folded score tile and what backward needs of it: (s, vis, diag, clamped, w, wc, r,
    phi, dev). Unused pieces (feature off) are zero tiles."""
    vis, diag = visibility(rows, cols, n, CAUSAL)
    s = mm(qk, tl.trans(k), IEEE)
    if ALIGN:
        s += mm(qa, tl.trans(ka), IEEE)
    if COH:
        s += mm(qc, tl.trans(zr), IEEE)
    zero = s * 0.0
    clamped = diag & (s != s) & (s == s)  # all False
    w = zero
    wc = zero
    r = zero
    phi = zero
    dev = zero
    if SEP or COH:
        clamped, w, wc, r = geometry(zl, zr, hl, hr, vis, diag, lo, ratio, SEP, RATIO_ONE, IEEE)
    if SEP:
        phi = r * w
        dev = tl.where(vis, phi - mu[:, None], 0.0)
        s += fac[:, None] * dev
    if ALIBI:
        s -= slope * tl.abs(rows[:, None] - cols[None, :]).to(s.dtype)
    s = tl.where(vis, s, float("-inf"))
    return s, vis, diag, clamped, w, wc, r, phi, dev


@device
def softmax_grads(s, lse, do, v, gl, dd, phi, rows, n, CAUSAL: tl.constexpr, LSEP: tl.constexpr,
                  IEEE: tl.constexpr):
    """p = softmax row (from the saved log-sum-exp) and dS = p (dP - D), where
    dP_ij = dO_i . v_j (+ gl_i phi_ij, the crowding loss sum_j A_ij phi_ij) and D_i = sum_j p dP.
    A row with one visible key (causal row 0, or n = 1) has p = 1 whatever S is: its dS is
    exactly 0, not the rounding residue of dP - D, which the row's Separation scale (~1/eps,
    its std is 0) would blow up to ~1e-10 (fp64) or ~0.1 (fp32) in the gradients."""
    p = tl.exp(s - lse[:, None])
    dp = mm(do, tl.trans(v), IEEE)
    if LSEP:
        dp += gl[:, None] * phi
    if CAUSAL:
        single = rows == 0
    else:
        single = (rows * 0 + n) == 1
    return p, tl.where(single[:, None], 0.0, p * (dp - dd[:, None]))


@device
def geometry_grads(ds, p, fac, cvar, cmu, grho, gl, gmom, zr, dev, r, w, wc, clamped, diag, vis, ratio,
                   SEP: tl.constexpr, COH: tl.constexpr, LSEP: tl.constexpr, IEEE: tl.constexpr):
    """Gradients at the tile's affinity (da, before Hl_i . Hr_j) and distance (dx, before
    Zl_i . Zr_j), given the row gradients of the statistics: cvar = 2 dL/dvar_i / denom_i,
    cmu = dL/dmu_i / count_i, grho = dL/drho_i, gmom = dL/dmom_i (mom_i = sum_j wc_ij Zr_j).
    The distance-gradient products (gmom . Zr_j here; dx @ Zr in the callers) are IEEE fp32 whatever
    the inputs' precision, as the forward's distance GEMM: Zr_j's columns [s z_j, 1, -a |z_j|^2] hold
    the large terms that cancel in z's gradient (TF32 products: grad z off by ~1% of its largest entry
    in the bf16 emulation, test_kernels_distance_products_are_ieee_when_the_others_are_tf32)."""
    da = ds * 0.0
    dx = ds * 0.0
    if SEP:
        dphi = fac[:, None] * ds + cvar[:, None] * dev + cmu[:, None]
        if LSEP:
            dphi += p * gl[:, None]
        da = tl.where(r > 0, dphi * w, 0.0)
        dx = (dphi * r + grho[:, None]) * w
    if COH:
        dx += ratio * mm(gmom, tl.trans(zr), True) * wc
    dx = tl.where(clamped | diag, 0.0, dx)
    dx = tl.where(vis, dx, 0.0)
    return da, dx
