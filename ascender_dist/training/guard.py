"""Bad-step protection: a non-finite or spiking loss skips the optimizer step on EVERY rank.

Mechanism (one for all layouts): when a rank sees a bad micro-batch loss, the backward of the
step's last micro-batch (PP=1; the decision is all-reduced first) or of the bad micro-batch itself
(PP>1, inside the pipeline's loss function) runs through ``models.build.poison``: the same loss
value, NaN gradients. The non-finite gradients then reach every rank through the gradient
all-reduce, and the optimizer's non-finite-gradient check skips the update everywhere: DeepSpeed's
own check for ZeRO-1/2/3 (gradient norm is NaN -> "overflow"), and the run's own ZeRO-0 optimizer
(:mod:`ascender_dist.training.zero0_optimizer`). DeepSpeed then counts ``engine.skipped_steps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class LossGuard:
    """Decides whether a loss is bad: non-finite, or above ``spike_factor`` x a baseline
    (``spike_factor`` 0 disables the spike test). It judges each micro-batch's loss, as Megatron's
    spiky-loss check does (one bad micro-batch skips the step), and keeps the step's worst one
    (``take_worst``) so that a skipped step can report the value that skipped it. The baseline is
    the running mean of accepted step losses; before the first accepted step it is ``initial_loss``,
    the loss of a uniform prediction over the vocabulary (ln V), which is what a freshly initialised
    LM scores. So the guard judges
    from step 1: a run whose loss jumps from 6.9 to 3.5e4 at step 2 is stopped there, instead of
    feeding the diverged losses into its own baseline."""

    spike_factor: float
    initial_loss: float
    ema_beta: float = 0.9
    running_mean: Optional[float] = None
    accepted_steps: int = 0
    worst: float = -math.inf  # largest micro-batch loss judged since the last take_worst (NaN: inf)

    @property
    def threshold(self) -> Optional[float]:
        if self.spike_factor <= 0:
            return None
        return self.spike_factor * (self.initial_loss if self.running_mean is None else self.running_mean)

    def is_bad(self, loss: float) -> bool:
        threshold = self.threshold
        self.worst = max(self.worst, loss if not math.isnan(loss) else math.inf)
        return not math.isfinite(loss) or (threshold is not None and loss > threshold)

    def take_worst(self) -> float:
        """The largest micro-batch loss judged since the last call (-inf if none), then forget it."""
        worst, self.worst = self.worst, -math.inf
        return worst

    def accept(self, step_loss: float) -> None:
        """Record the loss of a step that was applied (identical on all ranks)."""
        if not math.isfinite(step_loss):
            return
        self.accepted_steps += 1
        self.running_mean = step_loss if self.running_mean is None else (
            self.ema_beta * self.running_mean + (1 - self.ema_beta) * step_loss)

    def state_dict(self) -> dict:
        return {"running_mean": self.running_mean, "accepted_steps": self.accepted_steps}

    def load_state_dict(self, state: dict) -> None:
        self.running_mean, self.accepted_steps = state["running_mean"], state["accepted_steps"]


def collective_device(group=None) -> torch.device:
    """Where a tensor made for a collective must live: NCCL groups take CUDA tensors only (a CPU
    tensor raises "No backend type associated with device type cpu"), gloo groups CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(value: float, group=None) -> float:
    """Collective: the largest ``value`` over the ranks of ``group``."""
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def any_rank(flag: bool, group=None) -> bool:
    """Collective: whether ``flag`` is set on any rank of ``group``."""
    return max_over_ranks(1.0 if flag else 0.0, group) > 0


def first_failure(problem):
    """Collective: (rank, problem) of the lowest rank that passed a problem (any picklable object,
    usually its one-line message), else None on every rank."""
    if not any_rank(problem is not None):
        return None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((rank, found) for rank, found in enumerate(gathered) if found is not None)


def on_every_rank(fn):
    """``fn()``; an error it raises on some ranks is raised on every rank, so that the others do not
    go on into the next collective and wait there until the process group's timeout (a pipeline
    stage finds a layer missing from the weights, the logging rank cannot start W&B, one node's
    mount is read-only). The failing ranks raise their own error; the others the lowest failing
    rank's, as a ConfigError naming the same field when it was one, else a UserError with its line,
    and with ``.rank`` set to that rank (the job's one error line names it). Collective when
    distributed."""
    from ascender_dist.config.errors import ConfigError, UserError

    try:
        result, error = fn(), None
    except Exception as exc:  # a UserError, or an OSError and the like: the peers must hear of it too
        result, error = None, exc
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    failure = first_failure(None if error is None else _as_line(error)) if distributed else None
    if error is not None:
        raise error
    if failure is not None:
        rank, (path, message) = failure
        peer_error = ConfigError(path, message) if path is not None else UserError(message)
        peer_error.rank = rank
        raise peer_error
    return result


def _as_line(error: Exception) -> tuple:
    """(field or None, one-line message) of an error, for the ranks that did not raise it."""
    from ascender_dist.config.errors import ConfigError, UserError

    if isinstance(error, ConfigError):
        return error.path, error.message
    if isinstance(error, UserError):
        return None, str(error)
    text = str(error).strip().splitlines() or [""]
    return None, f"{type(error).__name__}: {text[0]}"
