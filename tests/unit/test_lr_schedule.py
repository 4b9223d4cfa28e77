"""The LR schedule against hand-written closed forms, every step of warmup / cosine / linear / constant."""

import math

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict
from ascender_dist.training.lr_schedule import lr_at, set_lr


def _optimizer(schedule: str, warmup: int, lr: float = 6e-4, min_lr: float = 6e-5):
    floor = {} if schedule == "constant" else {"min_lr": min_lr}  # constant has none (refused if set)
    return config_from_dict({"optimizer": {"lr": lr, **floor, "warmup_steps": warmup,
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


def _wsd(decay: int, shape: str = "linear", warmup: int = 2):
    return config_from_dict({"optimizer": {"lr": 6e-4, "min_lr": 6e-5, "warmup_steps": warmup, "lr_schedule": "wsd",
                                           "wsd_decay_steps": decay, "wsd_decay_shape": shape}}).optimizer


@pytest.mark.parametrize("shape,fraction", [
    ("linear", lambda p: 1 - p), ("cosine", lambda p: (1 + math.cos(math.pi * p)) / 2),
    ("sqrt", lambda p: 1 - math.sqrt(p))])
def test_warmup_stable_decay_every_step(shape, fraction):
    """Warmup 2 steps, stable at lr through step 6, then 4 decay steps to min_lr at step 10."""
    got = [lr_at(s, _wsd(4, shape), train_steps=10) for s in range(1, 11)]
    expected = [3e-4, 6e-4, 6e-4, 6e-4, 6e-4, 6e-4] + [6e-5 + 5.4e-4 * fraction(k / 4) for k in range(1, 5)]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert got[-1] == pytest.approx(6e-5, rel=1e-12) and lr_at(12, _wsd(4, shape), train_steps=10) == got[-1]


def test_a_decay_longer_than_the_run_starts_after_the_warmup_and_a_longer_run_moves_it_to_the_new_end():
    short = [lr_at(s, _wsd(20), train_steps=6) for s in range(1, 7)]  # decay over steps 3..6 from the peak at 2
    assert short == pytest.approx([3e-4, 6e-4, 4.65e-4, 3.3e-4, 1.95e-4, 6e-5], rel=1e-12, abs=0)
    extended = [lr_at(s, _wsd(4), train_steps=20) for s in range(1, 21)]  # a resume at step 10 with T = 20
    assert extended[5:16] == [6e-4] * 11 and extended[-1] == pytest.approx(6e-5, rel=1e-12)


@pytest.mark.parametrize("optimizer,message", [
    ({"lr_schedule": "wsd"}, "optimizer.wsd_decay_steps: must be >= 1 with lr_schedule: wsd (got 0)"),
    ({"lr_schedule": "cosine", "wsd_decay_steps": 5},
     "optimizer.wsd_decay_steps: applies to lr_schedule: wsd only (the schedule is cosine; got 5)"),
    ({"wsd_decay_shape": "sqrt"},
     "optimizer.wsd_decay_shape: applies to lr_schedule: wsd only (the schedule is cosine; got sqrt)"),
    ({"lr_schedule": "wsd", "wsd_decay_steps": 3, "wsd_decay_shape": "exp"},
     "optimizer.wsd_decay_shape: expected one of"),
])
def test_wsd_settings_are_checked(optimizer, message):
    from ascender_dist.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        config_from_dict({"optimizer": optimizer})
    assert str(info.value).startswith(message), str(info.value)


def test_a_decay_without_a_stable_phase_is_logged():
    from ascender_dist.config.architectures import unreached_warmups

    cfg = config_from_dict({"optimizer": {"lr_schedule": "wsd", "wsd_decay_steps": 95, "warmup_steps": 10},
                            "train": {"train_steps": 100}})
    assert unreached_warmups(cfg) == ["optimizer.wsd_decay_steps = 95 > the 90 steps after the warmup: the decay "
                                      "starts right after it, without a stable phase"]
    fits = config_from_dict({"optimizer": {"lr_schedule": "wsd", "wsd_decay_steps": 90, "warmup_steps": 10},
                             "train": {"train_steps": 100}})
    assert unreached_warmups(fits) == []


def test_a_wsd_run_ending_in_its_warmup_says_no_step_decays():
    from ascender_dist.config.architectures import unreached_warmups

    cfg = config_from_dict({"optimizer": {"lr_schedule": "wsd", "wsd_decay_steps": 5, "warmup_steps": 10},
                            "train": {"train_steps": 10}})
    assert unreached_warmups(cfg) == ["optimizer.lr_schedule = wsd: no step of train.train_steps = 10 is left "
                                      "after the warmup to decay: the run ends at optimizer.lr = 0.0003"]
