"""Entry point the megatron adapter calls for the TP-local heads of one layer.

    out = ascender_attention(q, k, v, z, h, params, hp, *, step, return_decomposition=False,
                             impl="auto")
    out, info = ascender_attention(..., return_decomposition=True)

q, k, v: [b, np, s, hd]; z: [b, np, s, d_z]; h: [b, np, s, d_a] (np = local heads);
params: AscenderHeadParams for those np heads; hp: AscenderHParams; step: the optimizer step
(Separation and the aux losses join after their warm-up steps). Returns out [b, np, s, hd].

impl: "reference" (dense, O(s^2), for tests and small-n visualisation), "fast" (chunked,
O(s * (window + chunk)) memory, any device), "triton" (the Triton kernels of kernels/: CUDA, or
CPU tensors under TRITON_INTERPRET=1) or "auto" (triton on CUDA, fast on CPU). When the kernels
do not cover a call (head dim, no triton, no CUDA) "triton" and "auto" run "fast", and say why
in one log line (once per reason).

Aux losses (section 8, when a weight > 0 and step >= aux_start_step) do not change what is
returned: their weighted sum is attached to ``out`` so that backward adds its gradient
(common.AttachAuxLoss; scale with common.set_aux_loss_scale).

info (return_decomposition=True): {"stats": per-head [np] detached tensors for TensorBoard
(mass_moved_{align,sep,coh,all}: mean over rows of the total-variation distance between the
attention row with and without that bias / without all biases; omega_{align,sep,coh}; means of
the gates and of eta), "aux": aux-loss values, "rows": per-row statistics [b, np, s, ...],
"maps": (reference only) S_base, align, sep, coh, other, S, A as [b, np, s, s]}.
"""

from __future__ import annotations

import logging

import torch

from .common import AttachAuxLoss
from .fast import fast_attention
from ascender_dist.config.ascender_hparams import AscenderHParams
from .params import ALIGN, COH, SEP, AscenderHeadParams
from .reference import reference_attention

IMPLS = ("auto", "fast", "reference", "triton")

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # log lines already written (the choice is made on every call)


def _log_once(level: int, msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.log(level, msg)


def _pick_impl(impl: str, q: torch.Tensor, hp: AscenderHParams | None = None) -> str:
    """auto -> triton on CUDA when the kernels cover the call, else fast; triton -> triton
    when covered, else fast (logged once, with the reason)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (got {impl!r})")
    if impl in ("fast", "reference") or (impl == "auto" and not q.is_cuda):
        return "fast" if impl == "auto" else impl
    from .kernels import triton_supported

    ok, why = triton_supported(q, hp)
    if ok:
        _log_once(logging.INFO, f"ascender attention: impl {impl} -> triton ({q.device.type}, head dim {q.shape[-1]})")
        return "triton"
    _log_once(logging.WARNING, f"ascender attention: impl {impl} -> fast: {why}")
    return "fast"


def attention_paths(head_dim: int, hp: AscenderHParams, impl: str = "auto") -> str:
    """The path ``impl`` takes per device for a layer with hparams ``hp``, one line for
    print-config. On CUDA the kernels need a covered head dim, operand widths with a measured
    shared-memory need and a GPU that allows it (known only on the GPU: the line names the need)."""
    from .kernels.support import (SUPPORTED_HEAD_DIMS, interpreter_requested, launch_widths, shared_bytes_needed,
                                  shared_memory_shortfall, triton_importable)

    if impl in ("fast", "reference"):
        return f"ascender attention (impl {impl}): CUDA -> {impl}, CPU -> {impl}"
    if not triton_importable():  # triton_supported's answer on every device
        cuda = "fast (triton is not installed)"
    elif head_dim not in SUPPORTED_HEAD_DIMS:
        cuda = f"fast (head dim {head_dim} is not one of the Triton kernels' {SUPPORTED_HEAD_DIMS})"
    elif shortfall := shared_memory_shortfall("", None, head_dim, hp):
        cuda = f"fast ({shortfall})"
    else:
        need = max(shared_bytes_needed(w) for w in launch_widths(head_dim, hp))
        cuda = f"triton on GPUs allowing >= {need // 1024} KiB of shared memory per block, else fast"
    covered = not cuda.startswith("fast")
    cpu = "triton (interpreter)" if impl == "triton" and interpreter_requested() and covered else "fast"
    return f"ascender attention (impl {impl}): CUDA -> {cuda}, CPU -> {cpu}"


def _touch_unused(out: torch.Tensor, params: AscenderHeadParams, hp, use_sep: bool) -> torch.Tensor:
    """Give parameters that this step does not use an exact zero gradient (not None), so
    data-parallel gradient reduction sees every parameter every step."""
    unused = []
    if not use_sep:
        unused += [params.delta, params.kappa]
    if not hp.use_align and not hp.use_coh and not use_sep:  # no bias this step: no gain or weight is read
        unused += [params.lambdas, params.omega_shared if params.shares_omega else params.omega]
    unused = [p for p in unused if isinstance(p, torch.nn.Parameter)]
    if not unused or not torch.is_grad_enabled():
        return out
    return out + 0.0 * sum(p.sum() for p in unused).to(out.dtype)


def _summary(result, params: AscenderHeadParams, hp: AscenderHParams) -> dict:
    """Per-head scalars for logging (all detached), and 0-d per-layer ones (the auxiliary losses)."""
    stats = {k: v.detach() for k, v in result.stats.items()}
    omega = params.omega.detach()
    for name, col in (("align", ALIGN), ("sep", SEP), ("coh", COH)):
        stats[f"omega_{name}"] = omega[:, col]
    # the learned thresholds and score temperature (trainable_delta_kappa_temp) as trained: kappa and
    # tau_score are used at their floors (TAU_SCORE_MIN, KAPPA_MIN) when they train below them
    for name in ("delta", "kappa", "tau_score"):
        stats[name] = getattr(params, name).detach()
    for key in ("gate_align", "gate_coh", "eta"):
        if key in result.rows:
            stats[f"{key}_mean"] = result.rows[key].detach().mean((0, 2))
    # the auxiliary losses (while active): one 0-d value over this call's heads each, logged per layer
    # (train/loss is the task loss alone; these enter the gradient through AttachAuxLoss)
    for name, value in result.aux.items():
        if isinstance(value, torch.Tensor):
            stats[f"aux_{name}"] = value.detach().reshape(())
    return stats


def ascender_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    h: torch.Tensor,
    params: AscenderHeadParams,
    hp: AscenderHParams,
    *,
    step: int,
    return_decomposition: bool = False,
    impl: str = "auto",
):
    """ASCender attention for the local heads: see the module docstring."""
    use_sep = hp.separation_active(step)
    with_aux = hp.aux_active(step)
    kind = _pick_impl(impl, q, hp)
    if kind == "reference":
        result = reference_attention(q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=with_aux)
    elif kind == "triton":
        from .kernels import triton_attention

        result = triton_attention(
            q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=with_aux, with_stats=return_decomposition
        )
    else:
        result = fast_attention(
            q, k, v, z, h, params, hp, use_sep=use_sep, with_aux=with_aux, with_stats=return_decomposition
        )
    out = _touch_unused(result.out, params, hp, use_sep)
    if with_aux and isinstance(result.aux.get("total"), torch.Tensor) and result.aux["total"].requires_grad:
        out = AttachAuxLoss.apply(out, result.aux["total"])
    if not return_decomposition:
        return out
    info = {
        "stats": _summary(result, params, hp),
        "aux": {k_: v_.detach() for k_, v_ in result.aux.items() if isinstance(v_, torch.Tensor)},
        "rows": result.rows,
    }
    if result.maps:
        info["maps"] = result.maps
    return out, info
