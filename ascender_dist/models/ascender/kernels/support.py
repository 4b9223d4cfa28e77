"""Whether the Triton kernels cover a call, and if not, why (one line for the log)."""

from __future__ import annotations

import importlib.util
import os

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128)


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """TRITON_INTERPRET=1 in the environment: kernels run on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Shared memory per block the kernels' largest block needs at launch.block_size's rows, by head dim
# (<= 64, above): the largest over every kernel, IEEE and TF32 products, with and without the L_coh
# value columns, compiled ahead of time for sm_80 and for sm_90 (160 KiB both: the key-block backward
# at head dim 64, the row backward at 128 with L_coh). tests/integration/test_triton_compile.py
# compiles them again and fails when this table no longer is that maximum.
SHARED_BYTES_NEEDED = {64: 160 * 1024, 128: 160 * 1024}


def shared_memory_shortfall(device_name: str, optin_bytes, hd: int) -> str:
    """Why a device whose blocks may use ``optin_bytes`` of shared memory cannot run the kernels at
    head dim ``hd`` ("" when it can, or when the limit is unknown): their block sizes are tuned for
    sm_90 / sm_80 (227 / 163 KiB); sm_86 / sm_89 cards (A10, L4, L40S) allow ~99 KiB and the launch
    would fail with OutOfResources in the middle of a run."""
    need = SHARED_BYTES_NEEDED[64 if hd <= 64 else 128]
    if optin_bytes is None or optin_bytes >= need:
        return ""
    return (f"{device_name} allows {optin_bytes // 1024} KiB of shared memory per block, the kernels need "
            f"{need // 1024} KiB at head dim {hd}")


def triton_supported(q: torch.Tensor, hp=None) -> tuple[bool, str]:
    """(True, "") when the kernels cover q [b, np, s, hd] on its device; else (False, reason).

    Covered: head dim in SUPPORTED_HEAD_DIMS, triton importable, q on CUDA or the Triton
    interpreter requested (TRITON_INTERPRET=1, set before triton is first imported), and on CUDA
    a device with the shared memory the kernels' blocks need (shared_memory_shortfall)."""
    hd = q.shape[-1]
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {hd} is not one of the Triton kernels' {SUPPORTED_HEAD_DIMS}"
    if not triton_importable():
        return False, "triton is not installed"
    if not q.is_cuda and not interpreter_requested():
        return False, f"tensors on {q.device.type} and TRITON_INTERPRET is not set (the kernels need CUDA)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False, f"dtype {q.dtype} is not supported by the Triton kernels"
    if q.is_cuda:
        props = torch.cuda.get_device_properties(q.device)
        short = shared_memory_shortfall(props.name, getattr(props, "shared_memory_per_block_optin", None), hd)
        if short:
            return False, short
    return True, ""
