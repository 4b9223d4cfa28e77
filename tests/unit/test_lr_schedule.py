"""The LR schedule against hand-written closed forms, every step of warmup / cosine / linear / constant."""

import math

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict
from ascender_dist.training.lr_schedule import lr_at, set_lr


def _optimizer(schedule: str, warmup: int, lr: float = 6e-4, min_lr: float = 6e-5):
    return config_from_dict({"optimizer": {"lr": lr, "min_lr": min_lr, "warmup_steps": warmup,
                                           "lr_schedule": schedule}}).optimizer


def test_cosine_with_warmup_every_step():
    o = _optimizer("cosine", warmup=4)
    # warmup 1..4: 6e-4 * s/4; then cosine over steps 4 -> 10 (6 intervals) to 6e-5
    expected = [1.5e-4, 3e-4, 4.5e-4, 6e-4] + [
        6e-5 + 5.4e-4 * (1 + math.cos(math.pi * k / 6)) / 2 for k in range(1, 7)]
    got = [lr_at(s, o, train_steps=10) for s in range(1, 11)]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert got[-1] == pytest.approx(6e-5, rel=1e-12)  # the last step runs at the floor


def test_zero_warmup_starts_at_the_peak():
    for schedule in ("cosine", "linear", "constant"):
        assert lr_at(1, _optimizer(schedule, warmup=0), train_steps=5) == 6e-4, schedule
    cosine = [lr_at(s, _optimizer("cosine", warmup=0), train_steps=5) for s in range(1, 6)]
    assert cosine == pytest.approx([6e-5 + 5.4e-4 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(5)],
                                   rel=1e-12, abs=0)
    assert lr_at(1, _optimizer("cosine", warmup=0), train_steps=1) == 6e-4  # a one-step run


def test_one_warmup_step_is_the_peak():
    assert lr_at(1, _optimizer("cosine", warmup=1), train_steps=3) == 6e-4
    assert lr_at(2, _optimizer("cosine", warmup=1), train_steps=3) == pytest.approx(3.3e-4, rel=1e-12)


def test_linear_and_constant_every_step():
    linear = [lr_at(s, _optimizer("linear", warmup=2), train_steps=6) for s in range(1, 7)]
    assert linear == pytest.approx([3e-4, 6e-4, 4.65e-4, 3.3e-4, 1.95e-4, 6e-5], rel=1e-12, abs=0)
    constant = [lr_at(s, _optimizer("constant", warmup=3), train_steps=6) for s in range(1, 7)]
    assert constant == pytest.approx([2e-4, 4e-4, 6e-4, 6e-4, 6e-4, 6e-4], rel=1e-12, abs=0)
    warmup_all = [lr_at(s, _optimizer("linear", warmup=4), train_steps=4) for s in range(1, 5)]
    assert warmup_all == pytest.approx([1.5e-4, 3e-4, 4.5e-4, 6e-4], rel=1e-12, abs=0)


def test_a_longer_run_follows_the_new_schedule():
    """Resuming with more train_steps: the next steps are the new schedule's, which decays monotonically."""
    o = _optimizer("cosine", warmup=2)
    extended = [lr_at(s, o, train_steps=8) for s in range(1, 9)]
    assert extended[6:] == pytest.approx([6e-5 + 5.4e-4 * (1 + math.cos(math.pi * k / 6)) / 2 for k in (5, 6)],
                                         rel=1e-12, abs=0)
    assert extended[1:] == sorted(extended[1:], reverse=True)


def test_past_the_end_stays_at_the_floor_and_step_0_is_refused():
    o = _optimizer("cosine", warmup=2)
    assert lr_at(12, o, train_steps=10) == pytest.approx(6e-5, rel=1e-12)
    with pytest.raises(ValueError, match="numbered from 1"):
        lr_at(0, o, train_steps=10)


def test_set_lr_reaches_every_group():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": 0.1},
              {"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1.0)
    set_lr(optimizer, 0.25)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25]
