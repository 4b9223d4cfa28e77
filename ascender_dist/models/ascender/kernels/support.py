"""Whether the Triton kernels cover a call, and if not, why (one line for the log)."""

from __future__ import annotations

import importlib.util
import os

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128)
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y; Triton passes the grid to cuLaunchKernel unchecked


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """TRITON_INTERPRET=1 in the environment: kernels run on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def padded(width: int) -> int:
    """Power-of-two block width >= 16 of an operand ``width`` columns wide (launch pads so)."""
    return max(16, 1 << (max(1, width) - 1).bit_length())


def kernel_widths(hd: int, d_z: int, d_a: int, *, sep: bool, coh: bool, lcoh: bool) -> tuple[int, int, int, int]:
    """Padded operand widths (HDP, ZP, HP, VP) a call launches the kernels with (launch.Ops.meta):
    head dim; Zr = [z, 1, |z|^2] (d_z + 2) when Separation or Cohesion is on; Hr = [h, 1, .]
    (d_a + 2) with Separation; v with the L_coh value columns [z, |z|^2] (hd + d_z + 1). An absent
    operand is a 1-wide dummy. With the block rows (launch.block_size: by the widest of the four)
    they are what the kernels' shared memory depends on (plus the feature flags: every feature on
    needs the most)."""
    zd = d_z + 2 if (sep or coh) else 1
    hd2 = d_a + 2 if sep else 1
    vd = hd + (d_z + 1 if lcoh else 0)
    return padded(hd), padded(zd), padded(hd2), padded(vd)


def launch_widths(hd: int, hp) -> list[tuple[int, int, int, int]]:
    """Every kernel_widths a layer with hparams ``hp`` can launch at head dim ``hd``: Separation
    joins at separation_start_step and the aux losses (L_coh's value columns) at aux_start_step,
    so a run launches both with and without them."""
    seps = (False, True) if hp.use_sep else (False,)
    lcohs = (False, True) if (hp.use_coh and hp.aux_compactness_weight > 0) else (False,)
    found = {kernel_widths(hd, hp.d_z, hp.d_a, sep=sep, coh=hp.use_coh, lcoh=lcoh) for sep in seps for lcoh in lcohs}
    return sorted(found)


# Shared memory per block the kernels need at launch.block_size's rows, by padded operand widths
# (HDP, ZP, HP, VP) and whether the inputs are fp64 (tests; half the rows, twice the bytes), with
# every feature on (L_sep's gradient included): the largest over the five kernels and, for fp32 /
# bf16 / fp16 inputs, IEEE and TF32 products, compiled ahead of time for sm_90 (at both fp32 entries
# every kernel's sm_80 compile needs as much or less). An entry covers the widths it bounds column by
# column that get the same block rows (the widest at most 64, or above): (64, 64, 64, 64): every
# width <= 64 (d_z, d_a <= 62; head dim plus any L_coh value columns <= 64), the key-block backward
# at 32 rows with TF32 products; (128, 64, 64, 256): head dim <= 128, d_z, d_a <= 62, any value
# columns, the row backward at head dim 128 with L_coh's (in fp64 the key-block backward, over
# H100's 227 KiB). Wider Zr / Hr (d + 2 columns: d_z or d_a > 62) need more (head dim 128 with
# d_z = d_a = 64 and L_coh: 192 KiB, over A100's 163; with 128: 240-320 KiB, over H100's 227) and
# have no entry, so they are not covered. tests/integration/test_triton_compile.py compiles each
# entry again (it must be the largest need) and the presets' widths nearest their bounds (within).
SHARED_BYTES_NEEDED = {
    (64, 64, 64, 64, False): 160 * 1024,
    (128, 64, 64, 256, False): 160 * 1024,
    (64, 64, 64, 64, True): 152 * 1024,
    (128, 64, 64, 256, True): 272 * 1024,
}


def shared_bytes_needed(widths: tuple[int, int, int, int], f64: bool = False) -> int | None:
    """The measured need (SHARED_BYTES_NEEDED) that bounds kernel_widths ``widths``, or None."""
    small = max(widths) <= 64
    bounds = [need for (*key, key_f64), need in SHARED_BYTES_NEEDED.items()
              if key_f64 == f64 and (max(key) <= 64) == small and all(w <= k for w, k in zip(widths, key))]  # fmt: skip
    return min(bounds) if bounds else None


def _shape(hd: int, hp, f64: bool) -> str:
    lcoh = hp.use_coh and hp.aux_compactness_weight > 0
    return (f"head dim {hd}, d_z {hp.d_z}, d_a {hp.d_a}" + (" with the L_coh value columns" if lcoh else "")
            + (" in float64" if f64 else ""))  # fmt: skip


def shared_memory_shortfall(device_name: str, optin_bytes, hd: int, hp=None, f64: bool = False) -> str:
    """Why a device whose blocks may use ``optin_bytes`` of shared memory cannot run the kernels
    for a layer with hparams ``hp`` (default AscenderHParams()) at head dim ``hd``, fp64 inputs if
    ``f64`` ("" when it can): operand widths without a measured need (SHARED_BYTES_NEEDED), or a
    need above the limit (the block sizes are tuned for sm_90 / sm_80, 227 / 163 KiB; sm_86 / sm_89
    cards such as A10, L4, L40S allow ~99 KiB and the launch would fail with OutOfResources in the
    middle of a run). An unknown limit (``optin_bytes`` None, older torch) passes a known need."""
    if hp is None:
        from ascender_dist.config.ascender_hparams import AscenderHParams

        hp = AscenderHParams()
    needs = [shared_bytes_needed(w, f64) for w in launch_widths(hd, hp)]
    if None in needs:
        return (f"{_shape(hd, hp, f64)}: no measured shared-memory need of the Triton kernels at these widths "
                f"(covered: d_z, d_a <= 62)")
    need = max(needs)
    if optin_bytes is None or optin_bytes >= need:
        return ""
    return (f"{device_name} allows {optin_bytes // 1024} KiB of shared memory per block, the kernels need "
            f"{need // 1024} KiB at {_shape(hd, hp, f64)}")


def triton_supported(q: torch.Tensor, hp=None) -> tuple[bool, str]:
    """(True, "") when the kernels cover q [b, np, s, hd] on its device for a layer with hparams
    ``hp`` (default AscenderHParams()); else (False, reason).

    Covered: head dim in SUPPORTED_HEAD_DIMS, triton importable, q on CUDA or the Triton
    interpreter requested (TRITON_INTERPRET=1, set before triton is first imported), batch x local
    heads at most MAX_GRID_Y, and on CUDA operand widths whose shared memory is measured and fits the
    device (shared_memory_shortfall)."""
    hd = q.shape[-1]
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {hd} is not one of the Triton kernels' {SUPPORTED_HEAD_DIMS}"
    if not triton_importable():
        return False, "triton is not installed"
    if not q.is_cuda and not interpreter_requested():
        return False, f"tensors on {q.device.type} and TRITON_INTERPRET is not set (the kernels need CUDA)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False, f"dtype {q.dtype} is not supported by the Triton kernels"
    batch_heads = q.shape[0] * q.shape[1]
    if batch_heads > MAX_GRID_Y:  # the launch grid's second axis is b * np (kernels/launch.py)
        return False, (f"batch x local heads = {batch_heads} is above CUDA's {MAX_GRID_Y} blocks on a grid's "
                       "second axis")
    if q.is_cuda:
        props = torch.cuda.get_device_properties(q.device)
        optin = getattr(props, "shared_memory_per_block_optin", None)
        short = shared_memory_shortfall(props.name, optin, hd, hp, f64=q.dtype == torch.float64)
        if short:
            return False, short
    return True, ""
