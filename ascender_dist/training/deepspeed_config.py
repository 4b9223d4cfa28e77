"""The one place that turns our RunConfig into DeepSpeed's config dict (no hand-written JSON)."""

from __future__ import annotations

from ascender_dist.config.resolve import Derived
from ascender_dist.config.schema import RunConfig


def _scheduler(cfg: RunConfig) -> dict:
    """``optimizer.warmup_steps: 0`` means no warmup. DeepSpeed's schedulers refuse 0 warmup steps (and
    use at least 2), so 0 becomes one "warmup" step that starts at the peak LR: a flat line at ``lr``.
    WarmupDecayLR (``linear``) decays from the same start value, so it cannot do that: config checks
    require warmup_steps >= 1 there (:func:`ascender_dist.config.checks.check_optimizer`)."""
    o, t = cfg.optimizer, cfg.train
    warmup = max(1, o.warmup_steps)
    start_ratio = 1.0 if o.warmup_steps == 0 else 0.0
    if o.lr_schedule == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": t.train_steps, "warmup_num_steps": warmup, "warmup_min_ratio": start_ratio,
            "cos_min_ratio": o.min_lr / o.lr, "warmup_type": "linear"}}
    if o.lr_schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {
            "total_num_steps": t.train_steps, "warmup_num_steps": warmup, "warmup_min_lr": 0.0,
            "warmup_max_lr": o.lr, "warmup_type": "linear"}}
    return {"type": "WarmupLR", "params": {
        "warmup_num_steps": warmup, "warmup_min_lr": o.lr * start_ratio, "warmup_max_lr": o.lr,
        "warmup_type": "linear"}}


def to_deepspeed_config(cfg: RunConfig, derived: Derived, load_universal: bool = False) -> dict:
    o, t, p = cfg.optimizer, cfg.train, cfg.parallel
    bf16 = t.precision == "bf16"
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": derived.gradient_accumulation_steps,
        "optimizer": {"type": "AdamW", "params": {
            "lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay,
            # torch's AdamW: FusedAdam would JIT-compile CUDA/C++ for minutes and needs a GPU
            "torch_adam": True}},
        "scheduler": _scheduler(cfg),
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,  # our logger reports; DeepSpeed's own prints would interleave
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if load_universal:  # resuming at another data-parallel size (see training.checkpoint.ensure_universal)
        ds["checkpoint"] = {"load_universal": True}
    if bf16:
        # bf16 ZeRO-0 would otherwise accumulate gradients in bf16 across micro-batches
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds
