"""Pool workers leave a job's signals to their owner from their first instruction on (data_pipeline.workers)."""

import os
import signal
from pathlib import Path

import pytest

from data_pipeline.workers import SignalQuietPool

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads signal masks in Linux's /proc")


def _mask(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:")), 16)


def _has(bits: int, signum: int) -> bool:
    return bool(bits >> (signum - 1) & 1)


def _spawned_children() -> set[int]:
    me = os.getpid()
    children = {int(c) for task in Path(f"/proc/{me}/task").iterdir() for c in (task / "children").read_text().split()}
    return {c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()}


def _worker_state(signum: int) -> tuple[int, bool, bool]:
    return os.getpid(), _has(_mask(os.getpid(), "SigIgn"), signum), _has(_mask(os.getpid(), "SigBlk"), signum)


def test_a_worker_holds_the_signals_off_while_it_starts_then_ignores_them():
    before = _spawned_children()
    with SignalQuietPool(1, (signal.SIGUSR1,)) as pool:
        future = pool.submit(_worker_state, signal.SIGUSR1)
        started = _spawned_children() - before  # the submit started the worker; it may still be importing
        assert len(started) == 1, started
        (pid,) = started
        # at any moment of its start-up: blocked (inherited) or already ignored
        assert _has(_mask(pid, "SigBlk"), signal.SIGUSR1) or _has(_mask(pid, "SigIgn"), signal.SIGUSR1)
        os.kill(pid, signal.SIGUSR1)  # its default action would end the worker and break the pool
        assert future.result(timeout=120) == (pid, True, False)  # ignored, no longer blocked
        assert pool.submit(_worker_state, signal.SIGUSR1).result(timeout=120)[0] == pid
    assert not _has(_mask(os.getpid(), "SigBlk"), signal.SIGUSR1)  # the owner's mask is restored
