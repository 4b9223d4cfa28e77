"""Worker process pools whose workers leave a job's signals to the process that owns them.

A terminal's Ctrl-C and a scheduler's signals (a time-limit warning, a preemption) reach every
process of the job's process group. The owner (the shard command, the trainer) decides what they
mean and ends its workers itself; a worker must not act on them: it would print a traceback or die
and break the pool its owner still reads from. Setting SIG_IGN in the pool's initializer leaves a
window: a spawned worker spends its first second importing before the initializer runs. So the
signals are blocked in the owner's thread while it starts a worker: a new process inherits the mask
(fork and spawn alike), holds the signal pending, and the initializer ignores it (a pending ignored
signal is dropped) before unblocking. CPython starts its resource tracker the same way.
"""

from __future__ import annotations

import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


@contextmanager
def signals_blocked(signals):
    """Block ``signals`` in this thread for the block; processes started inside inherit the mask."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _ignore_then_unblock(signals) -> None:
    """Worker start-up: ignore ``signals`` (dropping any that arrived while it started), then take
    them off the inherited block mask."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


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
