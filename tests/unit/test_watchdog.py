"""The stall watchdog (training/watchdog.py): ends a process whose main thread makes no training
progress outside torch.distributed, leaves one waiting in a collective to the collective's timeout,
and stays quiet while hooks keep firing. The 2-rank case: tests/distributed/test_job_errors.py."""

import re
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.resolve import config_from_dict
from ascender_dist.training.watchdog import StallWatchdog, in_collective, watchdog_callbacks
from tests.helpers.project import REPO_ROOT


class Recorder:
    """Stands in for job_errors.report / exit_now: records instead of ending the process."""

    def __init__(self):
        self.lines, self.statuses = [], []
        self.ended = threading.Event()

    def report(self, line):
        self.lines.append(line)

    def exit_now(self, status):
        self.statuses.append(status)
        self.ended.set()


def _dog(seconds: float, recorder: Recorder) -> StallWatchdog:
    return StallWatchdog(seconds / 60, report=recorder.report, exit_now=recorder.exit_now)


def test_a_stalled_process_dumps_every_stack_and_ends_with_one_line_and_status_3():
    script = textwrap.dedent("""
        import time, types
        from ascender_dist.training.watchdog import StallWatchdog

        def read_a_hanging_pipe():
            time.sleep(60)

        trainer = types.SimpleNamespace(step=4)
        dog = StallWatchdog(0.01)
        dog.on_train_start(trainer)
        dog.on_step_start(trainer)
        read_a_hanging_pipe()
    """)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=REPO_ROOT)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert time.monotonic() - start < 60
    lines = proc.stderr.strip().splitlines()
    assert re.fullmatch(r"error: no training progress for \d+ s \(train\.stall_timeout_minutes 0\.01\) since step 5 "
                        r"started; the main thread is in read_a_hanging_pipe \(<string>:\d\) \(every thread's stack "
                        r"is in the log above\)", lines[-1]), lines[-1]
    assert [line for line in lines if line.startswith("error")] == [lines[-1]]
    dump = proc.stderr.split("every thread now (faulthandler):")[1]
    assert 'File "<string>", line 6 in read_a_hanging_pipe' in dump and "Current thread" in dump


def test_hooks_firing_keep_it_quiet_and_train_end_stops_its_thread():
    recorder = Recorder()
    dog = _dog(0.4, recorder)
    trainer = types.SimpleNamespace(step=0)
    dog.on_train_start(trainer)
    for _ in range(25):  # 1.25 s of steps, each well inside the 0.4 s timeout
        dog.on_step_start(trainer)
        time.sleep(0.025)
        trainer.step += 1
        dog.on_step_end(trainer, {})
        time.sleep(0.025)
    thread = dog._thread
    dog.on_train_end(trainer)
    assert recorder.lines == [] and recorder.statuses == []
    assert thread is not None and not thread.is_alive()
    time.sleep(0.6)  # ended: no report after the timeout either
    assert recorder.lines == []


def test_no_hook_for_the_timeout_is_reported_once_naming_the_last_progress():
    recorder = Recorder()
    dog = _dog(0.3, recorder)
    trainer = types.SimpleNamespace(step=7)
    dog.on_train_start(trainer)
    dog.on_save(trainer, "step_00000007")
    assert recorder.ended.wait(10)
    dog.on_train_end(trainer)
    assert recorder.statuses == [3]
    assert len(recorder.lines) == 1
    assert "since checkpoint step_00000007 was saved; the main thread is in " in recorder.lines[0]


def test_a_rank_waiting_in_a_collective_is_left_to_the_collectives_timeout():
    """The main thread inside torch.distributed (a peer is late) is not a stall of this rank; once it
    returns without progress, the watchdog reports."""
    waiting_in_all_reduce = {}
    exec(compile("import time\ndef all_reduce(seconds):\n    time.sleep(seconds)\n",
                 "/site-packages/torch/distributed/distributed_c10d.py", "exec"), waiting_in_all_reduce)
    recorder = Recorder()
    dog = _dog(0.2, recorder)
    trainer = types.SimpleNamespace(step=1)
    dog.on_train_start(trainer)
    waiting_in_all_reduce["all_reduce"](1.2)
    assert recorder.lines == []
    assert recorder.ended.wait(10)
    dog.on_train_end(trainer)
    assert recorder.statuses == [3]
    assert in_collective(sys._getframe()) is False


def test_config_turns_it_on_and_refuses_a_negative_timeout():
    assert watchdog_callbacks(config_from_dict({})) == []
    (dog,) = watchdog_callbacks(config_from_dict({"train": {"stall_timeout_minutes": 30}}))
    assert isinstance(dog, StallWatchdog) and dog.timeout_s == 1800
    for bad, why in ((-1, "must be >= 0"), (float("inf"), "finite")):
        with pytest.raises(ConfigError, match=rf"train\.stall_timeout_minutes: .*{why}"):
            config_from_dict({"train": {"stall_timeout_minutes": bad}})


def test_a_rollback_marks_progress_between_its_load_and_its_save():
    """A rollback loads the last checkpoint and saves it again with no step hook between: the load
    and the save each within the timeout, but not together, ended a healthy rollback (status 3),
    and the restart replayed the same bad batches."""
    recorder = Recorder()
    dog = _dog(0.5, recorder)
    trainer = types.SimpleNamespace(step=11)
    dog.on_train_start(trainer)
    dog.on_step_end(trainer, {})
    time.sleep(0.35)  # loading the checkpoint
    dog.on_load(trainer, "step_00000010")
    time.sleep(0.35)  # saving it again
    dog.on_save(trainer, "step_00000010")
    dog.on_rollback(trainer)
    dog.on_train_end(trainer)
    assert recorder.lines == []


def test_a_conversion_that_advances_keeps_it_quiet_and_one_that_stops_is_reported():
    """A rollback target saved at another data-parallel size is converted to a universal checkpoint
    first, with no trainer hook for as long as that takes: its progress reports (from the
    conversion's heartbeat thread) keep the watchdog quiet; once they stop, it reports, naming the
    last one."""
    recorder = Recorder()
    dog = _dog(0.4, recorder)
    trainer = types.SimpleNamespace(step=11)
    dog.on_train_start(trainer)

    def converting():
        for i in range(8):  # 1.2 s of conversion, a report every 0.15 s
            dog.on_progress(trainer, f"the universal conversion of step_00000010: {i + 1} files, {i} bytes written")
            time.sleep(0.15)

    heartbeat = threading.Thread(target=converting)
    heartbeat.start()
    heartbeat.join()
    assert recorder.lines == []
    assert recorder.ended.wait(10)  # then nothing more
    dog.on_train_end(trainer)
    assert recorder.statuses == [3] and len(recorder.lines) == 1
    assert "since the universal conversion of step_00000010: 8 files, 7 bytes written; " in recorder.lines[0]
