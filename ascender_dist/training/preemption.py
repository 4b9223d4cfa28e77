"""Stopping a run cleanly before the cluster ends it: on a signal (a scheduler's warning, a
preemption's SIGTERM) or after ``train.exit_duration_minutes``, every rank saves a checkpoint at the
next step boundary and the job exits with status 75 (EX_TEMPFAIL: resubmit the same command and it
resumes), as Megatron-LM's --exit-signal-handler and --exit-duration-in-mins do.

A signal may reach one rank only (a node's agent, one process sent a signal), and each rank's clock
is its own: the decision is collective (any rank's reason stops all of them, after the same step),
otherwise the ranks would part ways in the next collective.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Optional

from ascender_dist.training.callbacks import Callback
from ascender_dist.training.guard import first_failure

log = logging.getLogger(__name__)
EXIT_STATUS = 75  # EX_TEMPFAIL: stopped early with a checkpoint; the same command continues the run


class StopRequests(Callback):
    """After each step, whether any rank received one of ``signals`` (names, e.g. "SIGUSR1") or has
    trained longer than ``duration_minutes`` (0: no limit); if so ``trainer.request_stop(reason)``
    with the lowest such rank's reason. The handlers are installed for ``fit`` only (main thread)
    and the previous ones restored after it."""

    def __init__(self, signals: list[str], duration_minutes: float):
        self.signals = [signal.Signals[name] for name in signals]
        self.duration_s = 60.0 * duration_minutes
        self.received: Optional[str] = None
        self.started = 0.0
        self.previous: dict = {}

    def _handle(self, number, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(number).name

    def on_train_start(self, trainer) -> None:
        self.started = time.monotonic()
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for number in self.signals:
                self.previous[number] = signal.signal(number, self._handle)

    def on_step_end(self, trainer, values: dict) -> None:
        reason = None
        if self.received is not None:
            reason = f"received {self.received}"
        elif self.duration_s and time.monotonic() - self.started >= self.duration_s:
            reason = f"train.exit_duration_minutes ({self.duration_s / 60:g}) reached"
        failure = first_failure(reason)  # one all-reduce while no rank has a reason
        if failure is not None:
            rank, text = failure
            trainer.request_stop(f"{text} on rank {rank}")

    def _restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def on_train_end(self, trainer) -> None:
        self._restore()

    def on_exception(self, trainer, error: BaseException) -> None:
        self._restore()


def stop_callbacks(cfg) -> list[Callback]:
    """[StopRequests] when the run asks for a clean stop on signals or a time budget, else []: it
    goes after the default callbacks (the step is logged before the stop is decided)."""
    t = cfg.train
    return [StopRequests(t.exit_signals, t.exit_duration_minutes)] if t.exit_signals or t.exit_duration_minutes else []
