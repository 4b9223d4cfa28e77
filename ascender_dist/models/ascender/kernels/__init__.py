"""ASCender attention through Triton kernels (the GPU path; on CPU tensors under TRITON_INTERPRET=1).

Its two entry points, ``triton_supported`` and ``triton_attention`` (imported from this package):

    ok, why = triton_supported(q, hp)          # (False, "one line for the log") when not covered
    result = triton_attention(q, k, v, z, h, params, hp, use_sep=..., with_aux=..., with_stats=...)

``triton_attention`` has fast.fast_attention's signature and result. Importing this package does
not import triton (the kernels are loaded on the first call), so CPU-only installs and exported
remote-code models load without it.
"""

from .support import SUPPORTED_HEAD_DIMS, triton_supported


def triton_attention(q, k, v, z, h, params, hp, *, use_sep: bool, with_aux: bool = False, with_stats: bool = False):
    """fast.fast_attention's contract through the Triton kernels (see function.triton_attention)."""
    from .function import triton_attention as run

    return run(q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=with_aux, with_stats=with_stats)


__all__ = ["SUPPORTED_HEAD_DIMS", "triton_attention", "triton_supported"]
