"""Errors of a 2-rank job through the real `deepspeed` launcher: each is ONE line on stderr for the
whole job (never one per rank, never two merged), naming the rank; the job exits non-zero.

- bad input that every rank sees (a config value);
- a damaged checkpoint file of rank 1 (all ranks stop before loading, within seconds);
- a rank stopped with SIGSTOP: the others give up after parallel.distributed_timeout_minutes,
  dump the stack they waited in, and name the collective and the rank that did not arrive."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.multiproc import run_job_ok, start_launcher_job, wait_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("data"))


def _config(tmp_path: Path, data: dict, name: str, **sections) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tiny_run_config(data, tmp_path / name, **sections)))
    return path


def _error_lines(err: Path) -> list[str]:
    text = err.read_text()
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if "error" in line.lower()]


def test_bad_input_on_two_ranks_is_one_error_line(data, tmp_path):
    config = _config(tmp_path, data, "bad")
    out, err = tmp_path / "bad.out", tmp_path / "bad.err"
    assert wait_job(start_launcher_job(config, out, err, "--set", "train.train_steps=0"), 120) == 2
    assert _error_lines(err) == ["error: rank 0: --set train.train_steps=0: train.train_steps: must be >= 1 (got 0)"]


def test_a_damaged_file_of_rank1_ends_the_job_with_one_line_before_loading(data, tmp_path):
    config = _config(tmp_path, data, "damaged", train={"train_steps": 2})
    run_job_ok(config, tmp_path / "first.log", 300)
    shard = tmp_path / "damaged" / "checkpoints" / "step_00000002" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    out, err = tmp_path / "again.out", tmp_path / "again.err"
    config.write_text(config.read_text().replace("train_steps: 2", "train_steps: 4"))
    proc = start_launcher_job(config, out, err)
    status = wait_job(proc, 300)
    assert status == 2
    lines = _error_lines(err)
    assert len(lines) == 1, err.read_text()[-3000:]
    assert re.fullmatch(rf"error: rank 1: {re.escape(str(shard))}: truncated \(\d+ of \d+ bytes\) \(rank 1's file, "
                        r"checked before anything was loaded\)", lines[0]), lines[0]
    assert "resumed from" not in out.read_text() + err.read_text()


def test_a_stopped_rank_ends_the_job_after_the_distributed_timeout(data, tmp_path):
    config = _config(tmp_path, data, "hung", train={"train_steps": 100000},
                     parallel={"distributed_timeout_minutes": 1})
    out, err = tmp_path / "hung.out", tmp_path / "hung.err"
    proc = start_launcher_job(config, out, err)
    deadline = time.monotonic() + 180
    while "step 2/" not in err.read_text() + out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
        time.sleep(0.5)
    ranks = subprocess.run(["pgrep", "-f", f"launch/train.py --local_rank=1 --config {config}"],
                           capture_output=True, text=True)
    os.kill(int(ranks.stdout.split()[0]), signal.SIGSTOP)
    stopped = time.monotonic()
    status = wait_job(proc, 240)
    assert status != 0 and time.monotonic() - stopped < 180
    text = err.read_text()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text[-3000:]
    assert re.fullmatch(r"error: rank 0: (all_reduce|barrier|broadcast|all_gather\w*|reduce_scatter\w*) timed out "
                        r"after 1 min \(parallel.distributed_timeout_minutes\); rank 1 did not arrive",
                        lines[0]), lines[0]
    assert "rank 0: Python stack at the distributed timeout:" in text  # the stack rank 0 waited in
    assert "trainer.py" in text.split("Python stack at the distributed timeout:")[1]
    assert "rank 0: every thread now (faulthandler):" in text and "Current thread" in text
