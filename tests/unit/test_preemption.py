"""A signal or a time budget ends a run cleanly: every rank stops after the same step (the
decision is collective), the handlers are installed for fit only, bad settings are one line."""

import os
import signal

import pytest

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.resolve import config_from_dict
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)


class _Trainer:
    def __init__(self):
        self.reasons = []

    def request_stop(self, reason):
        self.reasons.append(reason)


def test_a_signal_requests_a_stop_after_the_step_and_the_old_handler_comes_back(single_rank_group):
    from ascender_dist.training.preemption import StopRequests

    before = signal.getsignal(signal.SIGUSR1)
    stops, trainer = StopRequests(["SIGUSR1"], 0.0), _Trainer()
    stops.on_train_start(trainer)
    stops.on_step_end(trainer, {})
    assert trainer.reasons == []  # no signal yet: train on
    os.kill(os.getpid(), signal.SIGUSR1)  # would end the process with the default action
    stops.on_step_end(trainer, {})
    assert trainer.reasons == ["received SIGUSR1 on rank 0"]
    stops.on_train_end(trainer)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_time_budget_requests_a_stop(single_rank_group):
    from ascender_dist.training.preemption import StopRequests

    stops, trainer = StopRequests([], 1e-9), _Trainer()
    stops.on_train_start(trainer)
    stops.on_step_end(trainer, {})
    assert trainer.reasons == ["train.exit_duration_minutes (1e-09) reached on rank 0"]


@pytest.mark.parametrize("train,needle", [
    ({"exit_signals": ["SIGKILL"]}, "train.exit_signals: 'SIGKILL' is not a stop signal; use some of SIGTERM"),
    ({"exit_signals": ["USR1"]}, "train.exit_signals: 'USR1' is not a stop signal"),
    ({"exit_duration_minutes": -1}, "train.exit_duration_minutes: must be >= 0"),
])
def test_bad_exit_settings_are_one_line(train, needle):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"train": train})
    assert str(info.value).startswith(needle) and "\n" not in str(info.value)


def test_the_stop_callback_is_there_only_when_asked():
    from ascender_dist.training.preemption import StopRequests, stop_callbacks

    on = stop_callbacks(config_from_dict({}))
    assert len(on) == 1 and [s.name for s in on[0].signals] == ["SIGTERM", "SIGUSR1"]
    assert stop_callbacks(config_from_dict({"train": {"exit_signals": []}})) == []
    budget = stop_callbacks(config_from_dict({"train": {"exit_signals": [], "exit_duration_minutes": 5}}))
    assert isinstance(budget[0], StopRequests) and budget[0].duration_s == 300.0



def test_a_signal_received_while_the_job_sets_up_is_kept(single_rank_group):
    """The training command watches the signals from its start: a scheduler's warning during set-up or
    a resume (before fit) stops the run after its first step instead of being lost."""
    from ascender_dist.training.preemption import StopRequests, unwatch_signals, watch_signals

    before = signal.getsignal(signal.SIGUSR1)
    watch_signals(["SIGUSR1"])
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # before fit
        stops, trainer = StopRequests(["SIGUSR1"], 0.0), _Trainer()
        stops.on_train_start(trainer)
        stops.on_step_end(trainer, {})
        assert trainer.reasons == ["received SIGUSR1 on rank 0"]
        stops.on_train_end(trainer)
    finally:
        unwatch_signals()
    assert signal.getsignal(signal.SIGUSR1) == before
