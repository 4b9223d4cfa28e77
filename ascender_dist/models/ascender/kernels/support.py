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


def triton_supported(q: torch.Tensor, hp=None) -> tuple[bool, str]:
    """(True, "") when the kernels cover q [b, np, s, hd] on its device; else (False, reason).

    Covered: head dim in SUPPORTED_HEAD_DIMS, triton importable, and q on CUDA or the Triton
    interpreter requested (TRITON_INTERPRET=1, set before triton is first imported)."""
    hd = q.shape[-1]
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {hd} is not one of the Triton kernels' {SUPPORTED_HEAD_DIMS}"
    if not triton_importable():
        return False, "triton is not installed"
    if not q.is_cuda and not interpreter_requested():
        return False, f"tensors on {q.device.type} and TRITON_INTERPRET is not set (the kernels need CUDA)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False, f"dtype {q.dtype} is not supported by the Triton kernels"
    return True, ""
