"""Ending a rank that stops making training progress outside the collectives.

A rank blocked inside a collective is ended by the process group's timeout
(``parallel.distributed_timeout_minutes``), which names the rank that did not arrive. A rank that
blocks anywhere else - a ``pipe:`` shard URL whose command hangs, a stuck network filesystem, a
deadlocked data-loader thread - never reaches a collective, so nothing ends it: a one-rank job
hangs until the scheduler's time limit, and so does a job whose every rank blocks on the same
filesystem. :class:`StallWatchdog` (``train.stall_timeout_minutes``) watches the trainer's hooks
from a thread: when none has fired for the timeout and the main thread is not waiting inside
``torch.distributed``, it writes every thread's stack to the log, reports one ``error:`` line for
the job (where the rank was stalled and since what) and ends the process with
:data:`EXIT_STATUS`, as a distributed timeout does, so a restart policy or the user resumes from
the last checkpoint.

Progress is any hook the trainer calls: a step's start and end, a validation's start and end, a
save, a checkpoint loaded, a log line, a rollback, and the progress of long work between them (a
rollback target saved at another data-parallel size is converted to a universal checkpoint first,
which can take longer than any step: each change in what the conversion has written counts, so a
converter that hangs is still caught); so the timeout must exceed the longest stretch between two
of them: a step, a validation, a checkpoint save or load of a large model on slow storage (a
rollback loads, then saves), the conversion's start-up or its largest single file, and the syncing
and publishing of the converted copy (optimizer-sized, like a save; reported once as it starts). It is checked from ``on_train_start`` to ``on_train_end``: set-up
and resume are not watched. Set it above ``parallel.distributed_timeout_minutes``: on NCCL a rank
waiting for a stalled peer is blocked in a device synchronisation, not in a ``torch.distributed``
call, and the collective's timeout names the right rank. A hang that holds the GIL (a C extension
that never releases it) stops this thread too and is not caught.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import FrameType
from typing import Optional

from ascender_dist.parallel import job_errors
from ascender_dist.training.callbacks import Callback

EXIT_STATUS = 3  # as a distributed timeout (cli._run): the job hung; the same command resumes it
COLLECTIVE_DIRS = ("torch/distributed/", "deepspeed/comm/")


def main_thread_frame() -> Optional[FrameType]:
    """The innermost Python frame the main thread is executing now (None if it has none)."""
    return sys._current_frames().get(threading.main_thread().ident)


def _filename(frame: FrameType) -> str:
    return frame.f_code.co_filename.replace(os.sep, "/")


def in_collective(frame: Optional[FrameType]) -> bool:
    """Whether a frame on this stack is inside torch.distributed (or DeepSpeed's wrapper of it):
    the rank waits for its peers there, and the collective's own timeout ends it."""
    while frame is not None:
        if any(part in _filename(frame) for part in COLLECTIVE_DIRS):
            return True
        frame = frame.f_back
    return False


def describe(frame: Optional[FrameType]) -> str:
    """``function (file:line)`` of the innermost frame, and of the innermost frame of this project's
    code when that is a different one (the call that led into a library)."""
    if frame is None:
        return "no Python frame"

    def where(f: FrameType) -> str:
        return f"{f.f_code.co_name} ({os.path.basename(_filename(f))}:{f.f_lineno})"

    text = where(frame)
    own = frame
    while own is not None and not any(f"/{pkg}/" in _filename(own) for pkg in ("ascender_dist", "data_pipeline")):
        own = own.f_back
    if own is not None and own is not frame:
        text += f", called from {where(own)}"
    return text


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class StallWatchdog(Callback):
    """Ends this rank when no trainer hook has fired for ``timeout_minutes`` while the main thread is
    outside torch.distributed (see the module docstring). ``report`` and ``exit_now`` end the job
    (injected by tests; default: :mod:`ascender_dist.parallel.job_errors`)."""

    def __init__(self, timeout_minutes: float, report=None, exit_now=None):
        self.timeout_s = 60.0 * timeout_minutes
        self._report = report or job_errors.report
        self._exit_now = exit_now or job_errors.exit_now
        self._last = time.monotonic()
        self._since = "training started"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _mark(self, since: str) -> None:
        self._last = time.monotonic()
        self._since = since

    # ---------------------------------------------------------------- progress
    def on_train_start(self, trainer) -> None:
        self._mark(f"training started at step {trainer.step}")
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def on_step_start(self, trainer) -> None:
        self._mark(f"step {trainer.step + 1} started")

    def on_step_end(self, trainer, values: dict) -> None:
        self._mark(f"step {trainer.step} ended")

    def on_validation_start(self, trainer) -> None:
        self._mark(f"the validation at step {trainer.step} started")

    def on_validation_end(self, trainer, loss: float) -> None:
        self._mark(f"the validation at step {trainer.step} ended")

    def on_log(self, trainer, values: dict) -> None:
        self._mark(f"step {trainer.step} was logged")

    def on_save(self, trainer, tag: str) -> None:
        self._mark(f"checkpoint {tag} was saved")

    def on_load(self, trainer, tag: str) -> None:
        self._mark(f"checkpoint {tag} was loaded")

    def on_rollback(self, trainer) -> None:
        self._mark(f"the rollback to step {trainer.step}")

    def on_progress(self, trainer, what: str) -> None:
        self._mark(what)  # from a helper thread: two attribute writes, read by _watch

    def on_train_end(self, trainer) -> None:
        self._halt()

    def on_exception(self, trainer, error: BaseException) -> None:
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    # ---------------------------------------------------------------- the watching thread
    def _watch(self) -> None:
        poll_s = min(5.0, max(0.05, self.timeout_s / 20))
        while not self._stop.wait(poll_s):
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            frame = main_thread_frame()
            if in_collective(frame):
                continue  # waiting for a peer: the collective's timeout ends it, naming that peer
            self._end(idle, since=self._since, where=describe(frame))
            return

    def _end(self, idle_s: float, since: str, where: str) -> None:
        job_errors.dump_every_thread(f"no training progress for {idle_s:.0f} s; ")
        self._report(f"no training progress for {_duration(idle_s)} (train.stall_timeout_minutes "
                     f"{self.timeout_s / 60:g}) since {since}; the main thread is in {where} "
                     f"(every thread's stack is in the log above)")
        self._exit_now(EXIT_STATUS)


def watchdog_callbacks(cfg) -> list[Callback]:
    """[StallWatchdog] when ``train.stall_timeout_minutes`` > 0, else []."""
    minutes = cfg.train.stall_timeout_minutes
    return [StallWatchdog(minutes)] if minutes > 0 else []
