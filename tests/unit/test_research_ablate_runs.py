"""How ablate runs a training process: its error line, stopping it with ablate, one process per run
directory (found by a review: a killed ablate left its run training, a second ablate could delete a
run directory another was training in, and a failed run was reported by the launcher's exit line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ascender_dist.research.ablate import launch

SLEEPER = [sys.executable, "-c", "import subprocess, sys; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "print(child.pid, flush=True); child.wait()"]


def _group_alive(pgid: int, within_s: float = 5.0) -> bool:
    """Whether a process of group ``pgid`` is still there after ``within_s`` (a killed one takes a
    moment to be reaped)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


def _wait_for_pid(log_file) -> int:
    for _ in range(200):
        text = log_file.read_text().strip() if log_file.exists() else ""
        if text:
            return int(text.split()[0])
        time.sleep(0.05)
    raise AssertionError("the sleeper did not start")


def test_the_error_line_is_the_ranks_cause_not_the_launchers_exit(tmp_path):
    log_file = tmp_path / "run.log"
    log_file.write_text(
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]:   File \"x.py\", line 1, in <module>\n"
        "[rank0]: data_pipeline.errors.DataError: /x/tok.model: cannot read tokenizer model (No such file)\n"
        "[2026-12-01 20:00:17,105] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python', '-u'] exits "
        "with return code = 1\n")
    assert launch._last_error_line(log_file) == ("data_pipeline.errors.DataError: /x/tok.model: cannot read "
                                                  "tokenizer model (No such file)")


def test_a_timed_out_run_is_stopped_with_its_children(tmp_path):
    log_file = tmp_path / "run.log"
    with pytest.raises(subprocess.TimeoutExpired):
        launch._train(SLEEPER, dict(os.environ), log_file, timeout=3)
    grandchild = int(log_file.read_text().split()[0])
    for _ in range(100):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the run's child outlived it")
    assert not launch._LIVE_RUNS


def test_stopping_ablate_stops_every_live_run(tmp_path):
    log_file = tmp_path / "run.log"
    status = []
    worker = threading.Thread(target=lambda: status.append(launch._train(SLEEPER, dict(os.environ), log_file, None)))
    worker.start()
    _wait_for_pid(log_file)
    (proc,) = list(launch._LIVE_RUNS)
    launch.stop_live_runs(grace_s=10)
    worker.join(30)
    assert not worker.is_alive() and status == [-signal.SIGTERM]
    assert not _group_alive(proc.pid)


def test_a_signal_stops_the_runs_then_interrupts_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    stopped = []
    original = launch.stop_live_runs
    launch.stop_live_runs = lambda grace_s=30.0: stopped.append(True)
    try:
        with pytest.raises(KeyboardInterrupt):
            with launch.runs_stopped_on_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler interrupts this
    finally:
        launch.stop_live_runs = original
    assert stopped == [True] and signal.getsignal(signal.SIGTERM) is before


def test_one_process_at_a_time_trains_a_run_directory(tmp_path, monkeypatch):
    """Two launch_run calls for one (variant, seed) (two ablate processes sharing the baseline): the
    second waits for the first, then finds its result (here: runs after it, never beside it)."""
    from types import SimpleNamespace

    monkeypatch.setattr(launch, "run_dir", lambda grid, variant, seed: tmp_path / "gpt" / f"seed{seed}")
    spans = []

    def locked(grid, variant, seed, threads, timeout, launcher, slot):
        start = time.monotonic()
        time.sleep(0.5)
        spans.append((start, time.monotonic()))
        return {}

    monkeypatch.setattr(launch, "_launch_run_locked", locked)
    calls = [threading.Thread(target=launch.launch_run, args=(None, SimpleNamespace(name="gpt"), 1, 1),
                              kwargs={"launcher": SimpleNamespace()}) for _ in range(2)]
    for call in calls:
        call.start()
    for call in calls:
        call.join(30)
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 >= a1, spans


@pytest.mark.parametrize("part", [["--only", "asc"], ["--seeds", "1"]])
def test_a_part_of_the_grid_does_not_replace_its_full_report(tmp_path, capsys, part):
    """--only / --seeds wrote their partial report (fewer variants, another Holm family) over the
    grid's own report_dir, e.g. a committed benchmarks/results/research/<grid>/ (found by a review)."""
    from ascender_dist.research import ablate

    grid = tmp_path / "g.yaml"
    grid.write_text(f"name: g\nbase: {{model: {{preset: debug}}}}\nseeds: [1, 2]\nbaseline: gpt\n"
                    f"variants: {{gpt: {{model.architecture: gpt}}, asc: {{model.architecture: ascender}}}}\n"
                    f"runs_dir: {tmp_path / 'runs'}\nreport_dir: {tmp_path / 'report'}\n")
    assert ablate.ablate_main([str(grid), *part, "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "give --report-dir" in err and str(tmp_path / "report") in err, err
    assert not (tmp_path / "report").exists()
