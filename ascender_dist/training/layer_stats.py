"""Per-layer statistics that custom layers expose for TensorBoard, and the step they need.

A layer takes part by having these attributes:
  ``training_step``  (int)  - set before every optimizer step (ASCender's Separation warm-up);
  ``collect_stats``  (bool) - set on logging steps, so the extra work is paid only then;
  ``last_stats``     (dict[str, Tensor]) - filled by its forwards while ``collect_stats`` is on:
                       over all forwards of the step (models.specs.step_stats: mean, ``*_max``: max);
  ``stats_forwards`` (int)  - how many forwards ``last_stats`` covers;
  ``stats_prefix``   (str)  - TensorBoard namespace, e.g. "ascender";
  ``stats_per_head`` (bool) - 1-D stats hold this TP rank's heads and are gathered over TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ascender_dist.models.specs.step_stats import is_max_stat


def _participants(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "last_stats") and hasattr(m, "collect_stats")]


def set_training_step(model: nn.Module, step: int) -> None:
    for module in model.modules():
        if hasattr(module, "training_step"):
            module.training_step = step


def last_training_step(saved_step: int) -> int:
    """The training_step the weights of a checkpoint saved at ``saved_step`` last ran with: the
    trainer sets training_step = step before each optimizer step and counts the step after it,
    so a save at N follows the steps 0 .. N - 1 (and the validation at N ran with N - 1)."""
    return max(int(saved_step) - 1, 0)


def set_collect_stats(model: nn.Module, enabled: bool) -> None:
    for module in _participants(model):
        module.collect_stats = enabled
        if enabled:
            module.last_stats = {}
            module.stats_forwards = 0


def _gather_heads(values: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return values
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, values.contiguous(), group=tp_group)
    return torch.cat(parts)


def gather_layer_stats(model: nn.Module, tp_group=None, pp_group=None, dp_group=None) -> dict[str, float]:
    """``{"<prefix>/<stat>/layer03": mean, "<prefix>/<stat>/layer03/head05": value}``. Collective over
    TP (heads), over the pipeline stages (each holds its own layers; the logging rank sits on the
    last stage and would otherwise see only that stage's layers) and over the data-parallel
    replicas (each saw its own share of the global batch): the statistics of the whole step."""
    scalars = _local_layer_stats(model, tp_group)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        stages = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, scalars, group=pp_group)
        scalars = {key: value for stage in stages for key, value in stage.items()}
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        scalars = _reduce_over_replicas(scalars, dp_group, _device(model))
    return scalars


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _reduce_over_replicas(scalars: dict[str, float], dp_group, device) -> dict[str, float]:
    """Mean over the data-parallel replicas (equal shares of the batch), maximum for ``*_max``
    statistics. Every replica holds the same keys (same model, same stages)."""
    keys = sorted(scalars)
    maxed = [k for k in keys if is_max_stat(k.split("/")[1])]
    meaned = [k for k in keys if k not in set(maxed)]
    out = {}
    for names, op in ((meaned, dist.ReduceOp.SUM), (maxed, dist.ReduceOp.MAX)):
        if not names:
            continue
        values = torch.tensor([scalars[k] for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op, group=dp_group)
        if op == dist.ReduceOp.SUM:
            values /= dist.get_world_size(dp_group)
        out.update(zip(names, values.tolist()))
    return out


def _local_layer_stats(model: nn.Module, tp_group=None) -> dict[str, float]:
    scalars: dict[str, float] = {}
    for module in _participants(model):
        layer = f"layer{int(getattr(module, 'layer_number', 0)):02d}"
        prefix = getattr(module, "stats_prefix", type(module).__name__)
        for key in sorted(module.last_stats):
            stat = module.last_stats[key].detach().float()
            value = stat.reshape(-1)
            if getattr(module, "stats_per_head", False):
                value = _gather_heads(value, tp_group)
                if stat.dim():  # 0-d: a value over this rank's heads (an aux loss): the layer's is their mean
                    for head, v in enumerate(value.tolist()):
                        scalars[f"{prefix}/{key}/{layer}/head{head:02d}"] = v
            scalars[f"{prefix}/{key}/{layer}"] = value.mean().item()
    return scalars
