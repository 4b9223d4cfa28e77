"""The learning-rate schedule: a pure function of the (1-based) optimizer step and the config.

The trainer sets ``lr_at(step)`` on every optimizer parameter group right before the step runs,
so the rate a step uses, the rate it logs, and the rate after any resume (also one that changes
``train.train_steps`` or ``optimizer.lr``) all come from this one function of the CURRENT config.
Its only state is the step number, which every checkpoint already records. DeepSpeed owns no
scheduler: its configured schedulers start one step behind (the first step of a zero-warmup cosine
run ran at lr 0) and restore the rate saved in the optimizer state on resume.

Shape of the schedule, with peak ``lr``, floor ``min_lr``, warmup ``W`` and ``T = train_steps``:

- warmup: step ``s <= W`` runs at ``lr * s / W`` (so step ``W`` is the first at the peak);
- decay: from the peak step ``P = max(W, 1)`` (``W = 0``: step 1 runs at ``lr``) to step ``T``,
  progress ``p = (s - P) / (T - P)`` (clamped to [0, 1]):
  ``cosine`` ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``, ``linear``
  ``lr - (lr - min_lr) * p``, ``constant`` ``lr``. Step ``T`` runs at ``min_lr`` when ``T > P``
  (with ``T = P``, i.e. ``W = T`` or ``T = 1``, no step is left to decay: the last runs at ``lr``).
- ``wsd`` (warmup-stable-decay): ``lr`` up to step ``S = max(T - D, P)`` with ``D =
  wsd_decay_steps``, then progress ``p = (s - S) / (T - S)`` scales ``lr - min_lr`` by the decay
  shape: ``linear`` ``1 - p``, ``cosine`` ``(1 + cos(pi p)) / 2``, ``sqrt`` ``1 - sqrt(p)``. A
  resume with a larger ``T`` moves the decay to the new end: checkpoints of the stable phase
  continue at ``lr`` (the point of the schedule: one run, decays branched off at several lengths).

A skipped step (non-finite or spiking loss) consumes its step number like its batch: the schedule
is a function of the step, not of how many updates were applied.
"""

from __future__ import annotations

import math

from ascender_dist.config.schema import OptimizerConfig


def lr_at(step: int, optimizer: OptimizerConfig, train_steps: int) -> float:
    """The learning rate optimizer step ``step`` (1-based) runs at."""
    if step < 1:
        raise ValueError(f"optimizer steps are numbered from 1 (got {step})")
    o, warmup = optimizer, optimizer.warmup_steps
    if step <= warmup:
        return o.lr * step / warmup
    if o.lr_schedule == "constant":
        return o.lr
    peak = max(warmup, 1)
    if o.lr_schedule == "wsd":
        return _wsd(step, o, train_steps, max(train_steps - o.wsd_decay_steps, peak))
    if step <= peak:
        progress = 0.0
    else:  # a step past train_steps (never trained) stays at the floor
        progress = min(1.0, (step - peak) / (train_steps - peak)) if train_steps > peak else 1.0
    if o.lr_schedule == "cosine":
        return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if o.lr_schedule == "linear":
        return o.lr - (o.lr - o.min_lr) * progress
    raise ValueError(f"optimizer.lr_schedule: unknown schedule {o.lr_schedule!r}")


def _wsd(step: int, o: OptimizerConfig, train_steps: int, stable_until: int) -> float:
    """Warmup-stable-decay after the warmup: ``lr`` through step ``stable_until``, then the decay."""
    if step <= stable_until:
        return o.lr
    progress = min(1.0, (step - stable_until) / (train_steps - stable_until)) if train_steps > stable_until else 1.0
    shapes = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
              "sqrt": 1.0 - math.sqrt(progress)}
    if o.wsd_decay_shape not in shapes:
        raise ValueError(f"optimizer.wsd_decay_shape: unknown shape {o.wsd_decay_shape!r}")
    return o.min_lr + (o.lr - o.min_lr) * shapes[o.wsd_decay_shape]


def set_lr(optimizer, lr: float) -> None:
    """Set ``lr`` on every parameter group (the documented way torch schedulers change the rate;
    DeepSpeed's ZeRO and bf16 optimizers forward ``param_groups`` to the optimizer that steps)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
