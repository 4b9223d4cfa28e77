"""Per-head learned parameters of ASCender attention for the heads local to this rank.

Tensor parallelism shards whole heads, so every tensor here has a leading head dimension
(partition dim 0) of size ``num_heads`` = local heads. The megatron wiring tags the names in
``PER_HEAD_TENSORS`` with ``set_tensor_model_parallel_attributes(partition_dim=0)``.
Column 0/1/2 of the ``[num_heads, 3]`` tensors is align/sep/coh.

``share_omega_across_heads`` (the shared vs per-head ablation axis) replaces the per-head
``omega`` parameter by one ``omega_shared`` ``[1, 3]`` parameter for all heads of the layer; the
attention math still reads ``params.omega`` as ``[num_heads, 3]`` (an expanded view, so the
gradient of every head sums into the shared gains). ``omega_shared`` is not per head: it is
replicated on every tensor-parallel rank, not in ``PER_HEAD_TENSORS``, and its gradient (a partial
sum over this rank's heads) is summed over the TP group by the megatron wiring.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ascender_dist.config.ascender_hparams import KAPPA_MIN, TAU_SCORE_MIN, AscenderHParams

ALIGN, SEP, COH = 0, 1, 2


class _Floor(torch.autograd.Function):
    """max(x, floor), whose gradient reaches an entry below the floor only when it would raise it
    (a descent step on a negative gradient): a clamp's zero gradient there would hold a parameter
    that trained below its floor at the floor for good. At or above the floor: the clamp's value and
    gradient exactly."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, floor: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.floor = floor
        return x.clamp(min=floor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return torch.where((x >= ctx.floor) | (grad < 0), grad, torch.zeros_like(grad)), None


def alibi_slopes(global_num_heads: int) -> torch.Tensor:
    """ALiBi slopes m_h = 2^(-8 (h+1) / H) for all heads of the model (press et al.).

    Non-power-of-two head counts interleave the next power of two, as in the ALiBi paper's code.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(global_num_heads).is_integer():
        slopes = power_of_two(global_num_heads)
    else:
        p = 2 ** math.floor(math.log2(global_num_heads))
        slopes = power_of_two(p) + power_of_two(2 * p)[0::2][: global_num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


class AscenderHeadParams(nn.Module):
    """omega, lambdas, delta, kappa, tau_score (+ ALiBi slopes) for ``num_heads`` local heads.

    ``global_num_heads`` / ``head_offset`` place these heads inside the whole model so that
    per-head constants that depend on the global head index (ALiBi slopes) are the same at
    every tensor-parallel size.
    """

    # names of tensors whose dim 0 is the head dim (parameters or buffers, see is_trainable)
    PER_HEAD_TENSORS = ("omega", "lambdas", "delta", "kappa", "tau_score", "alibi_slope")
    # names of parameters shared by all heads of the layer (replicated over TP, never sharded)
    SHARED_TENSORS = ("omega_shared",)

    def __init__(
        self,
        hp: AscenderHParams,
        num_heads: int,
        *,
        global_num_heads: int | None = None,
        head_offset: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.num_heads = num_heads
        full = lambda *shape, v: torch.full(shape, float(v), dtype=dtype)  # noqa: E731
        lambdas = torch.tensor([hp.lambda_align, hp.lambda_sep, hp.lambda_coh], dtype=dtype)
        if hp.share_omega_across_heads:  # one [align, sep, coh] gain vector for the whole layer
            self.omega_shared = nn.Parameter(full(1, 3, v=hp.omega_init))
        else:
            self.omega = nn.Parameter(full(num_heads, 3, v=hp.omega_init))
        self._register("lambdas", lambdas.repeat(num_heads, 1), hp.trainable_lambdas)
        learn = hp.trainable_delta_kappa_temp
        self._register("delta", full(num_heads, v=hp.delta_init), learn)
        self._register("kappa", full(num_heads, v=hp.kappa_init), learn)
        self._register("tau_score", full(num_heads, v=hp.tau_score_init), learn)
        total = global_num_heads or num_heads
        slopes = alibi_slopes(total)[head_offset : head_offset + num_heads].to(dtype)
        self.register_buffer("alibi_slope", slopes, persistent=False)  # a function of the layout

    def _register(self, name: str, value: torch.Tensor, trainable: bool) -> None:
        """A learned tensor is an nn.Parameter, a fixed one a persistent buffer (kept in ckpts)."""
        if trainable:
            setattr(self, name, nn.Parameter(value))
        else:
            self.register_buffer(name, value, persistent=True)

    def __getattr__(self, name: str):
        # only reached when normal lookup fails: ``omega`` is then the shared gains seen per head
        # (an expanded view: writing into it raises instead of silently changing a copy)
        # (indexing, not .get: DeepSpeed ZeRO-3's _parameters dict gathers a partitioned parameter
        # in __getitem__ only)
        if name == "omega" and "omega_shared" in self._parameters:
            return self._parameters["omega_shared"].expand(self.num_heads, 3)
        return super().__getattr__(name)

    def score_temperature(self) -> torch.Tensor:
        """tau_score [np] as the attention uses it: at least TAU_SCORE_MIN. A learned value that
        trained below it is used at the floor and gets only the gradients that would raise it (_Floor)."""
        return _Floor.apply(self.tau_score, TAU_SCORE_MIN)

    def density_scale(self) -> torch.Tensor:
        """kappa [np] as Separation uses it: at least KAPPA_MIN (see score_temperature)."""
        return _Floor.apply(self.kappa, KAPPA_MIN)

    @property
    def shares_omega(self) -> bool:
        return "omega_shared" in self._parameters

    @classmethod
    def per_head_parameter_names(cls, module: "AscenderHeadParams") -> list[str]:
        """Names of the trainable per-head parameters (partition dim 0) of ``module``."""
        return [n for n, _ in module.named_parameters(recurse=False) if n in cls.PER_HEAD_TENSORS]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}" + (", shared omega" if self.shares_omega else "")
