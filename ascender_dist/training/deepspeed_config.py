"""The one place that turns our RunConfig into DeepSpeed's config dict (no hand-written JSON)."""

from __future__ import annotations

from ascender_dist.config.resolve import Derived
from ascender_dist.config.schema import OptimizerConfig, RunConfig


def adamw_params(o: OptimizerConfig) -> dict:
    """torch AdamW's arguments from ``optimizer`` (DeepSpeed builds it from the same dict)."""
    return {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay}


def uses_own_optimizer(cfg: RunConfig) -> bool:
    """ZeRO-0 (always fp32: config.checks refuses it with bf16): DeepSpeed runs the bare torch
    optimizer there, so the run brings its own (training.zero0_optimizer.ClippedAdamW: global
    gradient norm, clipping, non-finite skip)."""
    return cfg.parallel.zero_stage == 0


def to_deepspeed_config(cfg: RunConfig, derived: Derived, load_universal: bool = False) -> dict:
    o, t, p = cfg.optimizer, cfg.train, cfg.parallel
    bf16 = t.precision == "bf16"
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": derived.gradient_accumulation_steps,
        "optimizer": {"type": "AdamW", "params": {
            **adamw_params(o),
            # torch's AdamW: FusedAdam would JIT-compile CUDA/C++ for minutes and needs a GPU
            "torch_adam": True}},
        # no "scheduler": the trainer sets each step's rate itself (training.lr_schedule)
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,  # our logger reports; DeepSpeed's own prints would interleave
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if uses_own_optimizer(cfg):  # built and clipped by the run (training.engine), not by DeepSpeed
        del ds["optimizer"]
        ds["gradient_clipping"] = 0.0
    if load_universal:  # resuming at another data-parallel size (see training.checkpoint.ensure_universal)
        ds["checkpoint"] = {"load_universal": True}
    if p.sequence_parallel and p.pipeline_model_parallel_size > 1:
        ds["pipeline"] = whole_stage_tensors()
    if bf16:
        # gradients accumulate over micro-batches in fp32 (ZeRO-1: BF16_Optimizer's fp32 buffer; ZeRO-2:
        # the fp32 gradient partition) and, by default, are reduced across data-parallel ranks in fp32:
        # DeepSpeed's default for bf16 reduces in bf16, which rounds every reduced gradient (measured by
        # tests/distributed/test_bf16_weights.py: 2.4-2.8e-3 relative at DP=2 against 0 in fp32)
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        ds["communication_data_type"] = t.grad_reduce_dtype
    return ds


def whole_stage_tensors() -> dict:
    """DeepSpeed's pipeline section under sequence parallelism: each tensor-parallel rank sends its
    whole activation (and activation gradient) to the next stage. DeepSpeed's default
    (``pipe_partitioned`` / ``grad_partitioned``) sends 1/TP of it from each rank and all-gathers the
    pieces on the other side, which is right only when every TP rank holds the same tensor; under
    sequence parallelism each holds its own slice of the sequence, and the next stage would train on
    a mix of the slices (loss off by 1e-2 at the first step, without an error). Whole tensors cost no
    more here: a rank's slice is already 1/TP of the sequence."""
    return {"pipe_partitioned": False, "grad_partitioned": False}
