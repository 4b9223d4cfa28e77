"""Pool workers leave a job's signals to their owner from their first instruction on, and do not
outlive it (data_pipeline.workers)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_pipeline.workers import SignalQuietPool
from tests.helpers.procs import has_signal, spawned_children

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads signal masks in Linux's /proc")


def _spawned_children(pid: int | None = None) -> set[int]:
    return set(spawned_children(pid or os.getpid()))


def _worker_state(signum: int) -> tuple[int, bool, bool]:
    return os.getpid(), has_signal(os.getpid(), "SigIgn", signum), has_signal(os.getpid(), "SigBlk", signum)


def test_a_worker_holds_the_signals_off_while_it_starts_then_ignores_them():
    before = _spawned_children()
    with SignalQuietPool(1, (signal.SIGUSR1,)) as pool:
        future = pool.submit(_worker_state, signal.SIGUSR1)
        started = _spawned_children() - before  # the submit started the worker; it may still be importing
        assert len(started) == 1, started
        (pid,) = started
        # at any moment of its start-up: blocked (inherited) or already ignored
        assert has_signal(pid, "SigBlk", signal.SIGUSR1) or has_signal(pid, "SigIgn", signal.SIGUSR1)
        os.kill(pid, signal.SIGUSR1)  # its default action would end the worker and break the pool
        assert future.result(timeout=120) == (pid, True, False)  # ignored, no longer blocked
        assert pool.submit(_worker_state, signal.SIGUSR1).result(timeout=120)[0] == pid
    assert not has_signal(os.getpid(), "SigBlk", signal.SIGUSR1)  # the owner's mask is restored


OWNER = """
import os, signal, sys, time
from data_pipeline.workers import SignalQuietPool
pool = SignalQuietPool(2, (signal.SIGINT, signal.SIGTERM))
futures = [pool.submit(time.sleep, 0.5) for _ in range(2)]
[f.result() for f in futures]
print("ready", flush=True)
time.sleep(600)
"""


def test_workers_exit_when_their_owner_is_killed_outright():
    """SIGKILL (the OOM killer, kill -9) gives the owner no chance to end its workers, which ignore
    SIGTERM and wait on a task queue whose write end they hold themselves: they stayed, re-parented."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        workers = _spawned_children(owner.pid)
        assert len(workers) == 2, workers
    finally:
        owner.kill()
        owner.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [w for w in workers if Path(f"/proc/{w}").exists()]
    for w in left:  # do not leave them to the rest of the suite
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived their owner by 30 s"
