"""Python launchers of the ASCender Triton kernels: contiguity, padding widths, grids, flags.

Every tensor handed to a kernel is a contiguous ``[B, n, W]`` (or ``[B, n]``) tensor in the
compute dtype (fp32, or fp64 for fp64 inputs); ``Ops`` holds them for one call. Absent operands
(a bias switched off) are passed as a 1-element dummy that the kernel never reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

try:  # (a try block also keeps Hugging Face remote-code loading from requiring triton)
    import triton
except ImportError as e:
    raise ImportError("the ASCender Triton kernels need triton (pip install triton)") from e

from .backward import col_grad_kernel, row_grad_kernel
from .forward import forward_kernel, stats_kernel
from .support import padded


def _pad(width: int) -> int:
    """Power-of-two block width >= 16 (tl.arange and the GPU dot need it); support.padded, which
    triton_supported's shared-memory decision reads."""
    return padded(width)


def block_size(width: int, interpreted: bool, kernel: str = "forward", f64: bool = False) -> int:
    """Rows per block. Under the interpreter cost follows the number of (query, key) block pairs,
    so small blocks only waste little; 16 keeps test lengths off the block multiples. On a GPU
    shared memory bounds it. Compiled ahead of time for sm_80 and sm_90 with num_stages=1 (triton
    reports the shared bytes without a device), the most any kernel needs is 160 KiB (A100 163,
    H100 227): the key-block backward (K5) at 32 rows and head dim 64 (128 KiB with IEEE products,
    160 with TF32; 32 rows at head dim 96 / 128 would need 224, hence 16 there: at most 140 KiB),
    the row backward at 32 rows, head dim 128 with the L_coh value columns (160 KiB), the forward
    at 64 rows and head dim 64 (144 KiB). fp64 (tests) doubles the bytes: half the rows.
    ``width``: widest padded operand. These figures hold for d_z, d_a <= 62 (Zr, Hr at most 64
    wide); support.SHARED_BYTES_NEEDED holds the measured maxima by operand widths, and
    triton_supported refuses wider ones."""
    if interpreted:
        return 16
    if kernel == "col":
        rows = 32 if width <= 64 else 16
    elif kernel == "row":
        rows = 32
    else:
        rows = 64 if width <= 64 else 32
    return max(16, rows // 2) if f64 else rows


def launch_options(interpreted: bool) -> dict:
    """Compiler options of every launch: no software pipelining (it multiplies the shared
    memory of the many operands per iteration); the interpreter takes none."""
    return {} if interpreted else {"num_warps": 4, "num_stages": 1}


@dataclass
class Ops:
    """Operands of one call ([B, n, W] contiguous, compute dtype) and its static flags."""

    qk: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qa: torch.Tensor | None = None
    ka: torch.Tensor | None = None
    qc: torch.Tensor | None = None
    zl: torch.Tensor | None = None
    zr: torch.Tensor | None = None
    hl: torch.Tensor | None = None
    hr: torch.Tensor | None = None
    fac: torch.Tensor | None = None
    mu: torch.Tensor | None = None
    slope: torch.Tensor | None = None  # [B]: ALiBi slope / tau_score
    consts: torch.Tensor | None = None  # [2]: lower clamp of the kernel argument, Cohesion / main ratio
    flags: dict = field(default_factory=dict)
    interpreted: bool = False

    def dummy(self) -> torch.Tensor:
        return self.qk.new_zeros(1)

    def get(self, name: str) -> torch.Tensor:
        val = getattr(self, name)
        return self.dummy() if val is None else val

    def meta(self, kernel: str = "forward") -> dict:
        B, n, hd = self.qk.shape
        zd = self.zr.shape[-1] if self.zr is not None else 1
        hd2 = self.hr.shape[-1] if self.hr is not None else 1
        vd = self.v.shape[-1]
        widest = max(_pad(hd), _pad(zd), _pad(hd2), _pad(vd))
        bm = block_size(widest, self.interpreted, kernel, self.flags.get("F64", False))
        return dict(n=n, HD=hd, ZD=zd, HD2=hd2, VD=vd, HDP=_pad(hd), ZP=_pad(zd), HP=_pad(hd2), VP=_pad(vd),
                    BM=bm, BN=bm, **self.flags)

    def options(self) -> dict:
        return launch_options(self.interpreted)


def row_stats(ops: Ops):
    """K1: rho, mu, m2 [B, n] (Separation; None when off) and mom [B, n, dz + 2] (Cohesion)."""
    m = ops.meta()
    B, n = ops.qk.shape[:2]
    sep, coh = m["SEP"], m["COH"]
    rho, mu, m2 = (ops.qk.new_zeros(B, n) if sep else ops.dummy() for _ in range(3))
    mom = ops.qk.new_zeros(B, n, m["ZD"]) if coh else ops.dummy()
    grid = (triton.cdiv(n, m["BM"]), B)
    stats_kernel[grid](ops.zl, ops.zr, ops.get("hl"), ops.get("hr"), ops.consts, rho, mu, m2, mom,
                       n, m["ZD"], m["HD2"], ZP=m["ZP"], HP=m["HP"], BM=m["BM"], BN=m["BN"],
                       CAUSAL=m["CAUSAL"], SEP=sep, COH=coh, RATIO_ONE=m["RATIO_ONE"], F64=m["F64"],
                       IEEE=m["IEEE"], **ops.options())  # fmt: skip
    return (rho, mu, m2) if sep else (None, None, None), (mom if coh else None)


def _common(ops: Ops) -> list:
    return [ops.qk, ops.k, ops.get("qa"), ops.get("ka"), ops.get("qc")]


def _consts(m: dict) -> dict:
    keys = ("HDP", "ZP", "HP", "VP", "BM", "BN", "CAUSAL", "ALIGN", "COH", "SEP", "ALIBI", "LSEP", "RATIO_ONE",
            "F64", "IEEE")  # fmt: skip
    return {k: m[k] for k in keys}


def attention_forward(ops: Ops):
    """K2: out [B, n, VD], lse [B, n], lsep [B, n] (sum_j A_ij phi_ij; None unless LSEP)."""
    m = ops.meta()
    B, n = ops.qk.shape[:2]
    out = ops.qk.new_empty(B, n, m["VD"])
    lse = ops.qk.new_empty(B, n)
    lsep = ops.qk.new_empty(B, n) if m["LSEP"] else ops.dummy()
    grid = (triton.cdiv(n, m["BM"]), B)
    forward_kernel[grid](*_common(ops), ops.get("zl"), ops.get("zr"), ops.get("hl"), ops.get("hr"),
                         ops.get("fac"), ops.get("mu"), ops.get("slope"), ops.consts, ops.v, out, lse, lsep,
                         n, m["HD"], m["ZD"], m["HD2"], m["VD"], **_consts(m), **ops.options())  # fmt: skip
    return out, lse, (lsep if m["LSEP"] else None)


def attention_row_grads(ops: Ops, do, lse, dd, gl, geom: dict | None):
    """K3 (geom None): (gqk, gqa, gqc, gfac, galibi); K4 (geom = dict cvar, cmu, grho, gmom):
    (gzl, ghl). Absent outputs are None."""
    m = ops.meta("row")
    B, n = ops.qk.shape[:2]
    new = ops.qk.new_zeros
    d = ops.dummy()
    geom_on = geom is not None
    if geom_on:
        outs = [d, d, d, d, d, new(B, n, m["ZD"]) if (m["SEP"] or m["COH"]) else d,
                new(B, n, m["HD2"]) if m["SEP"] else d]
        g = {key: (d if val is None else val) for key, val in geom.items()}
    else:
        outs = [new(B, n, m["HD"]), new(B, n, m["HD"]) if m["ALIGN"] else d, new(B, n, m["ZD"]) if m["COH"] else d,
                new(B, n) if m["SEP"] else d, new(B, n) if m["ALIBI"] else d, d, d]  # fmt: skip
        g = dict(cvar=d, cmu=d, grho=d, gmom=d)
    grid = (triton.cdiv(n, m["BM"]), B)
    row_grad_kernel[grid](*_common(ops), ops.get("zl"), ops.get("zr"), ops.get("hl"), ops.get("hr"),
                          ops.get("fac"), ops.get("mu"), ops.get("slope"), ops.consts, ops.v, do, lse, dd,
                          d if gl is None else gl, g["cvar"], g["cmu"], g["grho"], g["gmom"], *outs,
                          n, m["HD"], m["ZD"], m["HD2"], m["VD"], **_consts(m), GEOM=geom_on,
                          **ops.options())  # fmt: skip
    outs = [None if o is d else o for o in outs]
    return tuple(outs[5:]) if geom_on else tuple(outs[:5])


def attention_col_grads(ops: Ops, qcl, do, lse, dd, gl, geom: dict):
    """K5: (gk, gka, gz, gh, gv) for the key rows; gz / gh in the left layout."""
    m = ops.meta("col")
    B, n = ops.qk.shape[:2]
    new = ops.qk.new_zeros
    d = ops.dummy()
    g = {key: (d if val is None else val) for key, val in geom.items()}
    gk, gv = new(B, n, m["HD"]), new(B, n, m["VD"])
    gka = new(B, n, m["HD"]) if m["ALIGN"] else d
    gz = new(B, n, m["ZD"]) if (m["SEP"] or m["COH"]) else d
    gh = new(B, n, m["HD2"]) if m["SEP"] else d
    grid = (triton.cdiv(n, m["BN"]), B)
    col_grad_kernel[grid](*_common(ops), d if qcl is None else qcl, ops.get("zl"), ops.get("zr"), ops.get("hl"),
                          ops.get("hr"), ops.get("fac"), ops.get("mu"), ops.get("slope"), ops.consts, ops.v, do,
                          lse, dd, d if gl is None else gl, g["cvar"], g["cmu"], g["grho"], g["gmom"],
                          g["gmoml"], gk, gka, gz, gh, gv,
                          n, m["HD"], m["ZD"], m["HD2"], m["VD"], **_consts(m), **ops.options())  # fmt: skip
    return tuple(None if o is d else o for o in (gk, gka, gz, gh, gv))


def kernel_arg_floor(dtype: torch.dtype) -> float:
    """Lower clamp of each kernel's exponent (fast_tiles._kernel_weights: below it exp lands in the denormals)."""
    return math.log(torch.finfo(dtype).tiny) * 0.999
