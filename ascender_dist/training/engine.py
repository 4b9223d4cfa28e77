"""Engine setup: wrap the megatron model so DeepSpeed sees a module that returns the loss,
split weight-decay groups, and call ``deepspeed.initialize`` with megatron's parallel groups."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ascender_dist.config.layout import ModelLayout
from ascender_dist.config.resolve import Derived
from ascender_dist.config.schema import RunConfig
from ascender_dist.models.build import build_model, lm_loss
from ascender_dist.parallel.setup import MegatronMPU
from ascender_dist.training.deepspeed_config import adamw_params, to_deepspeed_config, uses_own_optimizer
from ascender_dist.training.guard import on_every_rank
from ascender_dist.training.weights import check_all_weights_used, copy_shards, rank_shards, set_fp32_masters
from ascender_dist.training.zero0_optimizer import ClippedAdamW


def model_layout(cfg: RunConfig, derived: Derived) -> ModelLayout:
    """The one mapping of a run config and its derived values to what model code is told about
    the launch (model code never sees the run config)."""
    p = cfg.parallel
    return ModelLayout(
        tensor_parallel=p.tensor_model_parallel_size,
        pipeline_parallel=p.pipeline_model_parallel_size,
        data_parallel=derived.data_parallel_size,
        sequence_parallel=p.sequence_parallel,
        activation_checkpointing=p.activation_checkpointing,
        padded_vocab_size=derived.padded_vocab_size,
        vocab_size=derived.vocab_size,
    )


def build_run_model(cfg: RunConfig, derived: Derived):
    """This rank's megatron GPTModel of run ``cfg`` (:func:`ascender_dist.models.build.build_model`)."""
    return build_model(cfg.model, model_layout(cfg, derived), cfg.train.precision, cfg.train.seed)


class LanguageModel(nn.Module):
    """``forward(tokens [b, s+1]) -> mean LM loss`` over the ``vocab_size`` real ids: the shape
    DeepSpeed's engine expects."""

    def __init__(self, model: nn.Module, vocab_size: int):
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, tokens, self.vocab_size)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No decay for biases, norms and other 1-D parameters (GPT-2/Megatron convention), nor for
    parameters tagged ``no_weight_decay`` (ASCender's per-head mixing weights and temperatures,
    which are [heads, 3] but are gains, not matrices)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or name.endswith(".bias") or getattr(param, "no_weight_decay", False)
        (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def apply_optimizer_config(optimizer, o) -> list[str]:
    """Put the config's AdamW settings back after a checkpoint load: loading restores the saved
    param groups' weight decay, betas and eps (and ZeRO / bf16 optimizers their clipping value), so
    a resumed run would silently keep the old ones while its config.yaml records the new. Like the
    learning rate, the config wins. Group 0 is the decay group (weight_decay_groups). Returns what
    changed, as "name old -> new"."""
    changed = []

    def put(target: dict, key: str, value) -> None:
        current = target.get(key)
        if (tuple(current) if isinstance(current, list) else current) != value:  # betas may be a list
            changed.append(f"{key} {current} -> {value}")
            target[key] = value

    for i, group in enumerate(optimizer.param_groups):
        put(group, "weight_decay", o.weight_decay if i == 0 else 0.0)
        put(group, "betas", (o.beta1, o.beta2))
        put(group, "eps", o.eps)
    for clip_attr in ("clip_grad", "max_norm"):  # DeepSpeed's ZeRO / bf16 optimizers; ClippedAdamW
        if hasattr(optimizer, clip_attr) and getattr(optimizer, clip_attr) != o.grad_clip:
            changed.append(f"grad_clip {getattr(optimizer, clip_attr)} -> {o.grad_clip}")
            setattr(optimizer, clip_attr, o.grad_clip)
    return sorted(set(changed))


def build_engine(cfg: RunConfig, derived: Derived, init_state: Optional[dict] = None, guard=None,
                 load_universal: bool = False):
    """PP=1: megatron's GPTModel in DeepSpeed's engine (ZeRO 0-3). PP>1: the same layers in
    DeepSpeed's pipeline engine (ZeRO 0-1), see :mod:`ascender_dist.models.pipeline`."""
    import deepspeed

    if cfg.parallel.pipeline_model_parallel_size > 1:
        from ascender_dist.models.pipeline import build_pipeline_module

        module = build_pipeline_module(cfg.model, model_layout(cfg, derived), cfg.train.precision,
                                       cfg.train.seed, guard)
        mpu = None  # the PipelineModule's topology carries the (megatron-ordered) groups
    else:
        module = LanguageModel(build_run_model(cfg, derived), derived.vocab_size)
        mpu = MegatronMPU()
    shards = []
    if init_state is not None:  # before DeepSpeed wraps (and, under ZeRO-3, partitions) the weights
        source, field = cfg.checkpoint.init_from or "", "checkpoint.init_from"
        shards = on_every_rank(lambda: rank_shards(module, cfg, init_state, source=source, field=field))
        check_all_weights_used(init_state, copy_shards(shards), source=source, field=field)
    groups = weight_decay_groups(module, cfg.optimizer.weight_decay)
    optimizer = own_optimizer(cfg, groups) if uses_own_optimizer(cfg) else None
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=None if optimizer is not None else groups,
        optimizer=optimizer,
        config=to_deepspeed_config(cfg, derived, load_universal),
        mpu=mpu,
    )
    set_fp32_masters(shards)  # bf16: the optimizer's masters were built from the rounded weights
    return engine


def own_optimizer(cfg: RunConfig, groups: list[dict]) -> ClippedAdamW:
    """The fp32 ZeRO-0 optimizer (see training.zero0_optimizer), with the rates and clipping of
    ``cfg.optimizer``; the gradient norm spans megatron's model-parallel group (TP x PP)."""
    from megatron.core import parallel_state as mps

    return ClippedAdamW(groups, **adamw_params(cfg.optimizer), max_norm=cfg.optimizer.grad_clip,
                        tp_rank=mps.get_tensor_model_parallel_rank(), norm_group=mps.get_model_parallel_group())


def pipeline_batches(batches):
    """Loader items -> the (inputs, labels) pairs DeepSpeed's pipeline engine reads per micro-batch."""
    for item in batches:
        tokens = item["tokens"]
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
