"""Stopping a run cleanly before the cluster ends it: on a signal (a scheduler's warning, a
preemption's SIGTERM) or after ``train.exit_duration_minutes``, every rank saves a checkpoint at the
next step boundary and the job exits with status 75 (EX_TEMPFAIL: resubmit the same command and it
resumes), as Megatron-LM's --exit-signal-handler and --exit-duration-in-mins do.

A signal may reach one rank only (a node's agent, one process sent a signal), and each rank's clock
is its own: the decision is collective (any rank's reason stops all of them, after the same step),
otherwise the ranks would part ways in the next collective. The training command watches the
signals from its start (:func:`watch_signals`): a warning that arrives while the job sets up or
resumes is kept, not lost; the time budget counts from the process's start, as the scheduler's does.
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


def die_with_parent(parent: int, sig: int) -> None:
    """In a child between fork and exec (``preexec_fn``): the kernel sends it ``sig`` when ``parent``
    dies (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing), and it gets ``sig`` at once if the parent
    already has. A child that ignores the watched signals needs SIGKILL here."""
    import ctypes
    import os

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


class _Signals:
    """The first watched signal this process received (a name), and the handlers it replaced."""

    received: Optional[str] = None
    previous: dict = {}


def _handle(number, frame) -> None:
    if _Signals.received is None:  # only an attribute is set: safe whenever the signal arrives
        _Signals.received = signal.Signals(number).name


def watch_signals(names: list[str]) -> None:
    """Record the first of these signals (names, e.g. "SIGUSR1") instead of dying of it, from now
    until :func:`unwatch_signals`. Main thread only (elsewhere: nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in names:
        number = signal.Signals[name]
        if number not in _Signals.previous:
            _Signals.previous[number] = signal.signal(number, _handle)


def watched_signal_names() -> list[str]:
    """The signals watch_signals installed its handler for (names), in the order installed."""
    return [signal.Signals(number).name for number in _Signals.previous]


def unwatch_signals() -> None:
    """Give the watched signals their previous handlers back and forget what was received."""
    for number, handler in _Signals.previous.items():
        signal.signal(number, handler)
    _Signals.previous = {}
    _Signals.received = None


def process_age_s() -> float:
    """Seconds since this process started (psutil, as the scheduler counts a job's time), or since this
    module was imported when that cannot be read."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001 (no psutil, or no /proc): the import time is the next best start
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class StopRequests(Callback):
    """After each step, whether any rank received one of ``signals`` (names, e.g. "SIGUSR1") or its
    process has run longer than ``duration_minutes`` (0: no limit); if so
    ``trainer.request_stop(reason)`` with the lowest such rank's reason. The signals are watched from
    ``fit``'s start if the command did not watch them earlier, and given back after ``fit``."""

    def __init__(self, signals: list[str], duration_minutes: float):
        self.signals = [signal.Signals[name] for name in signals]
        self.duration_s = 60.0 * duration_minutes

    def on_train_start(self, trainer) -> None:
        watch_signals([number.name for number in self.signals])

    def on_step_end(self, trainer, values: dict) -> None:
        reason = None
        if _Signals.received is not None:
            reason = f"received {_Signals.received}"
        elif self.duration_s and process_age_s() >= self.duration_s:
            reason = f"train.exit_duration_minutes ({self.duration_s / 60:g}) reached"
        failure = first_failure(reason)  # one all-reduce while no rank has a reason
        if failure is not None:
            rank, text = failure
            trainer.request_stop(f"{text} on rank {rank}")

    def on_train_end(self, trainer) -> None:
        unwatch_signals()

    def on_exception(self, trainer, error: BaseException) -> None:
        unwatch_signals()


def stop_callbacks(cfg) -> list[Callback]:
    """[StopRequests] when the run asks for a clean stop on signals or a time budget, else []: it
    goes after the default callbacks (the step is logged before the stop is decided)."""
    t = cfg.train
    return [StopRequests(t.exit_signals, t.exit_duration_minutes)] if t.exit_signals or t.exit_duration_minutes else []
