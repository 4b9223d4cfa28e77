"""2 real ranks through ``cli._run``: a failure one rank sees is printed once for the job, and its
peer, woken from the collective it waited in, stays quiet (tests/distributed/workers/job_errors.py)."""

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
