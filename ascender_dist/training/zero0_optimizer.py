"""The fp32 ZeRO-0 optimizer: torch's AdamW plus the global gradient norm, clipping and the
non-finite skip that DeepSpeed's own optimizer wrappers (ZeRO-1/2/3, bf16) provide and its plain
fp32 path lacks.

DeepSpeed runs fp32 ZeRO-0 with the bare torch optimizer: it clips through ``clip_grad_norm_``
with its ``mpu``, which under a pipeline is the pipeline grid, whose model-parallel rank numbers
all TP and PP ranks of a replica: a parameter that is not TP-partitioned counts only on model-parallel
rank 0 (the later stages' norms and biases were left out) and a pipeline-tied embedding counts on
two stages; and the norm is never reported (``engine.get_global_grad_norm()`` stays None).

This optimizer computes the norm of the whole model's gradients, each counted once, over the
model-parallel group (every TP and PP rank of one replica), clips by it, skips the update on every
rank when it is not finite, and exposes it under the attribute DeepSpeed's engine reads after a
step (``_global_grad_norm``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ascender_dist.training.guard import any_rank, collective_device


def counted_once(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` enters the model's gradient norm: a TP-partitioned
    weight on every TP rank, a TP-replicated one on TP rank 0 only, a pipeline-tied copy only on
    the stage that owns it (DeepSpeed marks the others ``ds_pipe_replicated``)."""
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def model_grad_norm(params: list, tp_rank: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """2-norm of the gradients of one model replica (the ranks of ``group``), each counted once;
    not finite when any gradient of this rank, counted or not, is not finite."""
    device = collective_device(group) if dist.is_initialized() else torch.device("cpu")
    counted = [p.grad for p in params if p.grad is not None and counted_once(p, tp_rank)]
    copies = [p.grad for p in params if p.grad is not None and not counted_once(p, tp_rank)]
    local = torch.nn.utils.get_total_norm(counted, norm_type=2.0) if counted else torch.zeros((), device=device)
    squared = local.float().pow(2).reshape(1).to(device)
    if copies:  # + 0 x their norm: NaN or inf in a copy reaches the sum, a finite one adds nothing
        squared += 0.0 * torch.nn.utils.get_total_norm(copies, norm_type=2.0).float().to(device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squared, group=group)
    return squared.sqrt()[0]


class ClippedAdamW(torch.optim.AdamW):
    """torch AdamW whose step clips the gradients to ``max_norm`` (0: no clipping) by the
    model's global gradient norm and skips itself on every rank when that norm is not finite."""

    def __init__(self, params, *, max_norm: float, tp_rank: int, norm_group: Optional[dist.ProcessGroup],
                 **adamw):  # fmt: skip
        super().__init__(params, **adamw)
        self.max_norm, self.tp_rank, self.norm_group = max_norm, tp_rank, norm_group
        self.overflow = False  # DeepSpeed's engine counts a skipped step when set after step()
        self._global_grad_norm: Optional[float] = None  # read by DeepSpeed's engine after step()

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        norm = model_grad_norm(params, self.tp_rank, self.norm_group)
        value = float(norm)
        # the gradients are identical on every data-parallel rank and the norm on every rank of a
        # replica; one flag over the world keeps the decision identical even so
        self.overflow = any_rank(not math.isfinite(value))
        self._global_grad_norm = None if self.overflow else value
        if self.overflow:
            return None
        if self.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], self.max_norm,
                                                 norm.to(params[0].device))  # fmt: skip
        return super().step(closure)
