"""Bad-step guard pieces that need no training run: where collective flags live, the pipeline loss
that poisons a bad micro-batch only when it is trained on, the spike baseline, the rollback policy."""

import math

import pytest
import torch
import torch.distributed as dist

from ascender_dist.models import pipeline
from ascender_dist.training import guard
from ascender_dist.training.rollback import RollbackPolicy


def test_collective_flags_live_where_the_backend_wants_them(monkeypatch):
    """NCCL takes CUDA tensors only: a CPU flag all-reduced over NCCL raises on every GPU step."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert guard.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert guard.collective_device() == torch.device("cpu")


class AlwaysBad:
    def is_bad(self, loss: float) -> bool:
        return True


def test_pipeline_loss_is_poisoned_in_training_only(monkeypatch):
    monkeypatch.setattr(pipeline, "pipeline_loss", lambda logits, labels, vocab_size: logits.sum())
    loss_fn = pipeline.GuardedPipelineLoss(vocab_size=2, guard=AlwaysBad())
    logits = torch.ones(2, requires_grad=True)
    loss = loss_fn(logits, None)
    assert loss.item() == 2.0  # the loss the guard judged bad is reported as it is
    loss.backward()
    assert torch.isnan(logits.grad).all()  # NaN gradients: the step is skipped on every rank
    with torch.no_grad():  # DeepSpeed's eval_batch: validation reports the loss as it is
        assert loss_fn(logits, None).item() == 2.0


def test_spike_guard_judges_from_the_first_step():
    """Before any accepted step the baseline is ln(vocab): the jump 6.9 -> 3.5e4 at step 2 (seen in a
    run with a far too high LR) is bad, and so is a first loss far above a uniform prediction's."""
    g = guard.LossGuard(spike_factor=3.0, initial_loss=math.log(512))
    assert g.threshold == pytest.approx(3 * math.log(512))
    assert not g.is_bad(6.9) and g.is_bad(3 * math.log(512) + 0.01) and g.is_bad(float("nan"))
    g.accept(6.9)
    assert g.is_bad(3.5e4) and g.is_bad(20.8) and not g.is_bad(20.6)  # 3 x 6.9 = 20.7
    g.accept(float("inf"))  # never part of the baseline
    assert g.running_mean == 6.9 and g.accepted_steps == 1
    g.accept(5.9)
    assert g.running_mean == pytest.approx(0.9 * 6.9 + 0.1 * 5.9)
    restored = guard.LossGuard(spike_factor=3.0, initial_loss=1.0)
    restored.load_state_dict(g.state_dict())
    assert restored.threshold == g.threshold
    assert guard.LossGuard(spike_factor=0.0, initial_loss=1.0).threshold is None  # spike test off
    assert not guard.LossGuard(spike_factor=0.0, initial_loss=1.0).is_bad(1e9)


def test_first_rollback_goes_to_the_newest_checkpoint_before_the_trouble():
    policy = RollbackPolicy(max_rollbacks=3)
    assert policy.next_target(bad_step=12, good_steps=[3, 6, 9]) == 9


def test_repeated_rollbacks_go_older_and_are_bounded():
    policy = RollbackPolicy(max_rollbacks=3)
    assert policy.next_target(12, [3, 6, 9]) == 9
    policy.saved(12)  # a save AT the trigger step is not past the trouble
    assert policy.next_target(12, [3, 6, 9]) == 6
    policy.saved(9)
    assert policy.next_target(11, [3, 6, 9]) == 3
    assert policy.next_target(8, [3, 6]) is None  # the fourth in a row: the job stops
    assert policy.in_a_row == 3


def test_a_repeat_with_nothing_older_reuses_the_oldest_checkpoint():
    policy = RollbackPolicy(max_rollbacks=2)
    assert policy.next_target(5, [4]) == 4
    assert policy.next_target(6, [4]) == 4
    assert policy.next_target(6, [4]) is None


def test_saving_past_the_trouble_ends_the_row():
    policy = RollbackPolicy(max_rollbacks=1)
    assert policy.next_target(12, [9]) == 9
    policy.saved(15)
    assert policy.in_a_row == 0
    assert policy.next_target(20, [9, 15, 18]) == 18  # a new row: the newest again


def test_no_checkpoint_or_no_rollbacks_allowed_stops_at_once():
    assert RollbackPolicy(max_rollbacks=3).next_target(4, []) is None
    assert RollbackPolicy(max_rollbacks=0).next_target(4, [2]) is None


def test_the_guard_keeps_the_worst_micro_batch_loss_of_a_step():
    import math

    from ascender_dist.training.guard import LossGuard

    guard = LossGuard(spike_factor=3.0, initial_loss=2.0)
    assert [guard.is_bad(x) for x in (2.1, 7.0, 1.9)] == [False, True, False]
    assert guard.take_worst() == 7.0  # the spike, not the step's mean
    assert guard.take_worst() == -math.inf  # forgotten once taken
    guard.is_bad(float("nan"))
    assert guard.take_worst() == math.inf  # a NaN reports as inf: max() would drop it


def test_a_restarted_job_goes_on_counting_the_row():
    """The row is checkpointed: a job restarted inside it continues it (the next rollback goes older,
    and the bound still stops it) instead of getting max_rollbacks fresh tries on every restart."""
    before = RollbackPolicy(max_rollbacks=2)
    assert before.next_target(12, [3, 6, 9]) == 9
    state = before.state_dict()
    assert "max_rollbacks" not in state  # the bound comes from the (possibly changed) config
    after = RollbackPolicy(max_rollbacks=2)
    after.load_state_dict(state)
    assert (after.in_a_row, after.trigger_step, after.target_step) == (1, 12, 9)
    assert after.next_target(12, [3, 6, 9]) == 6  # a repeat: older than the previous target
    assert after.next_target(12, [3, 6, 9]) is None  # the bound, counted across the restart


def test_an_earlier_bad_step_does_not_move_the_trigger_back():
    """A repeat triggered by bad steps ending before the first trigger (12, then 10): the row ends only
    with a save past 12, the furthest trouble; a save at 11 is not past it."""
    policy = RollbackPolicy(max_rollbacks=3)
    assert policy.next_target(12, [3, 6, 9]) == 9
    assert policy.next_target(10, [3, 6, 9]) == 6
    assert policy.trigger_step == 12
    policy.saved(11)
    assert policy.in_a_row == 2 and policy.trigger_step == 12
    assert policy.next_target(12, [3, 6, 9]) == 3  # still a repeat: older again
