"""Where a run that keeps producing bad steps rolls back to, and when it gives up.

After ``train.max_consecutive_bad_steps`` skipped steps in a row the trainer rolls back to a
checkpoint from before those steps and goes on with the data where it was, so the batches that
failed (and those since the checkpoint) are skipped, as PaLM's training did (Chowdhery et al.
2022, section 5.1). A rollback that comes before the run has saved a checkpoint past the step
that triggered the previous one is a *repeat*: the trouble is not behind it, so it goes to an
older checkpoint than the previous rollback did (the checkpoints in between may already hold
the start of the divergence). After ``train.max_rollbacks`` rollbacks in a row the job stops with
:class:`DivergenceError`, one line naming the step, the loss and the last good checkpoint: every
further retry would burn accelerator hours on a run that needs a person (lower LR, other data).
The row is part of the checkpoint (``state_dict``): a job restarted inside a row goes on counting
it, rather than granting a diverging run ``max_rollbacks`` more tries on every restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ascender_dist.config.errors import UserError


class DivergenceError(UserError, RuntimeError):
    """The run keeps diverging; ``str(e)`` is one line naming the step, the loss and the last good
    checkpoint."""


@dataclass
class RollbackPolicy:
    max_rollbacks: int
    in_a_row: int = 0  # rollbacks since the run last saved a checkpoint past the trouble
    trigger_step: Optional[int] = None  # furthest step whose bad steps caused a rollback in this row
    target_step: Optional[int] = None  # checkpoint step the previous rollback of this row went to

    def state_dict(self) -> dict:
        """The current row (checkpointed with the run; the bound comes from the config)."""
        return {key: value for key, value in asdict(self).items() if key != "max_rollbacks"}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.trigger_step, self.target_step = (
            state["in_a_row"], state["trigger_step"], state["target_step"])

    def saved(self, step: int) -> None:
        """A checkpoint was saved at ``step``; past the trigger of the last rollback, the row ends."""
        if self.trigger_step is not None and step > self.trigger_step:
            self.in_a_row, self.trigger_step, self.target_step = 0, None, None

    def protected_steps(self, steps: list[int]) -> set[int]:
        """The checkpoint steps among ``steps`` (ascending) that pruning must keep while a row is open:
        the previous rollback's target and the newest one older than it, where a repeat goes. Without
        them a small ``checkpoint.keep_last`` (or saves inside the row) pruned the older checkpoint and
        a repeat rollback went to the same or a newer one."""
        if self.target_step is None:
            return set()
        older = [step for step in steps if step < self.target_step]
        return {self.target_step, *older[-1:]}

    def next_target(self, bad_step: int, good_steps: list[int]) -> Optional[int]:
        """The checkpoint step to roll back to after bad steps ending at ``bad_step``, chosen among
        ``good_steps`` (ascending steps of complete checkpoints from before the bad steps began);
        None when the bound is reached or there is nothing to go back to."""
        if self.in_a_row >= self.max_rollbacks or not good_steps:
            return None
        if self.target_step is None:  # a first rollback: the newest checkpoint before the trouble
            target = good_steps[-1]
        else:  # a repeat: older than the previous target, or the oldest there is
            older = [step for step in good_steps if step < self.target_step]
            target = older[-1] if older else good_steps[0]
        self.in_a_row += 1
        self.trigger_step = bad_step if self.trigger_step is None else max(self.trigger_step, bad_step)
        self.target_step = target
        return target
