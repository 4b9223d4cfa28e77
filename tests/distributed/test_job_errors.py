"""2 real ranks through ``cli._run``: a failure one rank sees is printed once for the job, and its
peer, woken from the collective it waited in, stays quiet (tests/distributed/workers/job_errors.py);
a rank stalled outside any collective is ended by its stall watchdog the same way."""

import re
import time
from pathlib import Path

import pytest

from tests.helpers.multiproc import run_ranks

pytestmark = pytest.mark.distributed


def _texts(root: Path, case: str) -> list[str]:
    return [(root / f"{case}.rank{rank}.err").read_text() for rank in range(2)]


def test_a_user_error_on_rank1_only_is_one_line_naming_rank1(tmp_path):
    results = run_ranks("tests.distributed.workers.job_errors:user_error_on_rank1", world_size=2, timeout=120,
                        args={"root": str(tmp_path)})
    assert [r["status"] for r in results] == [2, 2]
    texts = _texts(tmp_path, "user")
    assert "Traceback" not in "".join(texts), texts
    lines = [line for text in texts for line in text.splitlines() if "error" in line.lower()]
    assert lines == ["error: rank 1: data.manifest: only rank 1 reads this"], texts


def test_an_unexpected_error_prints_one_traceback_for_the_job(tmp_path):
    results = run_ranks("tests.distributed.workers.job_errors:bug_on_rank0", world_size=2, timeout=120,
                        args={"root": str(tmp_path)})
    assert [r["status"] for r in results] == [1, 2]  # the failing rank, then its quiet peer
    texts = _texts(tmp_path, "bug")
    assert texts[0].count("Traceback") == 1 and "ZeroDivisionError: a bug, not a user error" in texts[0]
    assert texts[0].startswith("rank 0: Traceback")
    assert "Traceback" not in texts[1] and "Error" not in texts[1], texts[1]


def test_a_rank_stalled_outside_collectives_is_ended_by_its_watchdog_with_one_line(tmp_path):
    """Rank 1 blocks in a (simulated) shard read after step 2; rank 0 waits in step 3's collectives,
    where its own watchdog leaves it to the collective's timeout. Rank 1's watchdog dumps every
    thread's stack, reports one line for the job naming where it is stuck, and exits 3; rank 0,
    woken from its collective, stays quiet. Both end long before the distributed timeout."""
    from tests.helpers.data import make_tiny_dataset

    data = make_tiny_dataset(tmp_path / "data")
    start = time.monotonic()
    results = run_ranks("tests.distributed.workers.job_errors:stall_on_rank1", world_size=2, timeout=240,
                        args={"root": str(tmp_path), "data": data, "stall_timeout_minutes": 0.1}, exits={1: 3})
    assert time.monotonic() - start < 200  # the distributed timeout (10 min) played no part
    assert results[0]["status"] == 2  # the quiet peer of a reported failure
    texts = _texts(tmp_path, "stall")
    assert "Traceback" not in "".join(texts), texts
    lines = [line for text in texts for line in text.splitlines() if line.startswith("error")]
    assert len(lines) == 1, texts
    assert re.fullmatch(r"error: rank 1: no training progress for \d+ s \(train\.stall_timeout_minutes 0\.1\) "
                        r"since step 2 ended; the main thread is in read_a_hanging_pipe \(job_errors\.py:\d+\), "
                        r"called from _call \(trainer\.py:\d+\) \(every thread's stack is in the log above\)",
                        lines[0]), lines[0]
    dump = texts[1].split("every thread now (faulthandler):")[1]
    assert "read_a_hanging_pipe" in dump and "stall-watchdog" not in lines[0]
