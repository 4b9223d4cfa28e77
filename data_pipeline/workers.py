"""Worker process pools whose workers leave a job's signals to the process that owns them.

A terminal's Ctrl-C and a scheduler's signals (a time-limit warning, a preemption) reach every
process of the job's process group. The owner (the shard command, the trainer) decides what they
mean and ends its workers itself; a worker must not act on them: it would print a traceback or die
and break the pool its owner still reads from. Setting SIG_IGN in the pool's initializer leaves a
window: a spawned worker spends its first second importing before the initializer runs. So the
signals are blocked in the owner's thread while it starts a worker: a new process inherits the mask
(fork and spawn alike), holds the signal pending, and the initializer ignores it (a pending ignored
signal is dropped) before unblocking. CPython starts its resource tracker the same way. A worker
whose owner dies exits within a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


@contextmanager
def signals_blocked(signals):
    """Block ``signals`` in this thread for the block; processes started inside inherit the mask."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # read only: a handler the call runs may raise
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _exit_when_orphaned(owner: int, every_s: float = 1.0) -> None:
    """Poll until the owner process is gone (this process re-parented), then exit. A worker blocked
    on the task queue never sees it close (it holds a copy of the write end itself) and ignores the
    signals that would end it, so an owner killed outright (SIGKILL, the OOM killer) left it behind."""
    while os.getppid() == owner:
        time.sleep(every_s)
    os._exit(1)


def _ignore_then_unblock(signals) -> None:
    """Worker start-up: ignore ``signals`` (dropping any that arrived while it started), then take
    them off the inherited block mask; exit on its own if the owner dies."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), name="exit-when-orphaned",
                     daemon=True).start()


class SignalQuietPool(ProcessPoolExecutor):
    """A pool of ``workers`` fresh (spawned: safe next to threads, torch, CUDA and NCCL) processes
    that ignore ``signals`` from their first instruction. ProcessPoolExecutor starts workers on
    demand inside ``submit``, so every submit runs with the signals blocked."""

    def __init__(self, workers: int, signals):
        self.quiet_signals = tuple(signals)
        super().__init__(workers, mp_context=multiprocessing.get_context("spawn"),
                         initializer=_ignore_then_unblock, initargs=(self.quiet_signals,))

    def submit(self, fn, /, *args, **kwargs):
        with signals_blocked(self.quiet_signals):
            return super().submit(fn, *args, **kwargs)
