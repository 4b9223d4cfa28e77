"""Crashes through the real `deepspeed` launcher: SIGKILL at random moments never corrupts the
latest checkpoint and auto-resume ends bit-identical to an uninterrupted run; a dying rank ends
the whole job with a non-zero status instead of hanging."""

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.multiproc import REPO_ROOT, run_job_ok, start_launcher_job, wait_job

pytestmark = pytest.mark.slow
STEPS = 30


def _config(tmp_path: Path, data: dict, name: str, steps: int = STEPS, train: dict | None = None,
            **sections) -> Path:
    raw = tiny_run_config(data, tmp_path / name, train={"train_steps": steps, **(train or {})},
                          checkpoint={"save_interval": 2, "keep_last": 2}, **sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _assert_latest_loadable(checkpoint_dir: Path) -> None:
    from ascender_dist.training.checkpoint import latest_tag

    tag = latest_tag(checkpoint_dir)  # raises if `latest` names an incomplete checkpoint
    if tag is not None:
        torch.load(checkpoint_dir / tag / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")


def _final_weights(checkpoint_dir: Path) -> dict:
    state = torch.load(checkpoint_dir / f"step_{STEPS:08d}" / "mp_rank_00_model_states.pt", weights_only=False,
                       map_location="cpu")
    return state["module"]


def _wait_for(proc, log: Path, text: str, offset: int = 0, poll_s: float = 0.05) -> None:
    """Until ``text`` appears in ``log`` (after byte ``offset``), while the job runs (at most 120 s)."""
    deadline = time.monotonic() + 120
    while text not in log.read_text()[offset:]:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(poll_s)


def _rank_pid(rank: int) -> int:
    """The pid of this test's training rank ``rank`` (launch/train.py --local_rank=R)."""
    found = subprocess.run(["pgrep", "-f", f"launch/train.py --local_rank={rank}"], capture_output=True, text=True)
    return int(found.stdout.split()[0])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("data"))


def test_random_sigkills_then_auto_resume_match_straight_run(data, tmp_path):
    straight = _config(tmp_path, data, "straight")
    run_job_ok(straight, tmp_path / "straight.log", 300)

    killed = _config(tmp_path, data, "killed")
    checkpoints = tmp_path / "killed" / "checkpoints"
    log = tmp_path / "killed.log"
    rng = random.Random(1234)
    kills = 0
    while kills < 5:
        from ascender_dist.training.checkpoint import latest_tag, step_of_tag

        tag = latest_tag(checkpoints) if checkpoints.exists() else None
        resume_step = step_of_tag(tag) if tag else 0
        if resume_step >= STEPS - 2:
            break
        target = resume_step + rng.randint(1, 4)  # a random step of this attempt ...
        offset = log.stat().st_size if log.exists() else 0
        proc = start_launcher_job(killed, log)
        _wait_for(proc, log, f"step {target}/", offset, poll_s=0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # ... and a random moment after it (saves happen every 2 steps)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        _assert_latest_loadable(checkpoints)
    assert kills >= 3, "the run finished too early for the kill test to mean anything"
    run_job_ok(killed, tmp_path / "killed.log", 300)
    _assert_latest_loadable(checkpoints)
    ours, reference = _final_weights(checkpoints), _final_weights(tmp_path / "straight" / "checkpoints")
    assert ours.keys() == reference.keys()
    tensors = [name for name, value in reference.items() if isinstance(value, torch.Tensor)]
    assert len(tensors) > 10
    for name in tensors:
        assert torch.equal(ours[name], reference[name]), name
    assert "resumed from" in (tmp_path / "killed.log").read_text()
    # TensorBoard: every step once, in order, though the killed jobs logged steps past their last
    # checkpoint that the next job trained again (each resume's purge step hides them)
    from tests.helpers.tensorboard import read_scalars

    assert [step for step, _ in read_scalars(tmp_path / "killed" / "tensorboard")["train/loss"]] == \
        list(range(1, STEPS + 1))


def test_a_signal_to_one_rank_saves_on_every_rank_and_the_same_command_continues(data, tmp_path):
    """SIGUSR1 (a scheduler's warning) reaches rank 1 only: both ranks stop after the same step with a
    checkpoint, the job exits 75, and running the command again finishes the run from there."""
    from ascender_dist.training.checkpoint import latest_tag, step_of_tag

    # saves only at the end; 400 steps: at ~0.02 s a step, 40 were over before the signal (sent once the
    # log shows step 3) arrived, and the job exited 0
    raw = tiny_run_config(data, tmp_path / "signalled", train={"train_steps": 400})
    config = tmp_path / "signalled.yaml"
    config.write_text(yaml.safe_dump(raw))
    log = tmp_path / "signalled.log"
    proc = start_launcher_job(config, log)
    _wait_for(proc, log, "step 3/")
    os.kill(_rank_pid(1), signal.SIGUSR1)
    assert wait_job(proc, 120) == 75, log.read_text()[-3000:]
    text = log.read_text()
    stopped = int(re.search(r"stopped at step (\d+) of 400 \(received SIGUSR1 on rank 1\)", text).group(1))
    assert stopped >= 3 and step_of_tag(latest_tag(tmp_path / "signalled" / "checkpoints")) == stopped
    run_job_ok(config, tmp_path / "continued.log", 300)
    assert f"resumed from {tmp_path / 'signalled' / 'checkpoints' / f'step_{stopped:08d}'}" in \
        (tmp_path / "continued.log").read_text()
    assert step_of_tag(latest_tag(tmp_path / "signalled" / "checkpoints")) == 400


def test_a_dying_rank_ends_the_job(data, tmp_path):
    config = _config(tmp_path, data, "dying", steps=100000)
    log = tmp_path / "dying.log"
    proc = start_launcher_job(config, log)
    _wait_for(proc, log, "step 2/", poll_s=0.5)
    os.kill(_rank_pid(1), signal.SIGKILL)
    started = time.monotonic()
    status = wait_job(proc, 60)
    assert status != 0
    assert time.monotonic() - started < 60


def test_a_diverging_run_ends_in_bounded_time_with_one_line(data, tmp_path):
    """A healthy start (checkpoints at steps 2 and 4), then the same run resumed at a far too high LR:
    each rollback diverges again, and after train.max_rollbacks the job exits non-zero, naming the
    step, the loss and the last good checkpoint, instead of rolling back forever."""
    guard = {"loss_spike_factor": 3.0, "max_consecutive_bad_steps": 2, "max_rollbacks": 2}
    healthy = _config(tmp_path, data, "diverging", steps=4, train=guard)
    run_job_ok(healthy, tmp_path / "healthy.log", 300)
    diverging = _config(tmp_path, data, "diverging", steps=1000, train=guard,
                        optimizer={"lr": 50.0, "min_lr": 0.0, "warmup_steps": 0, "lr_schedule": "constant"})
    log = tmp_path / "diverging.log"
    started = time.monotonic()
    status = wait_job(start_launcher_job(diverging, log), 300)
    elapsed = time.monotonic() - started
    text = log.read_text()
    assert status != 0 and elapsed < 240, text[-3000:]
    checkpoints = tmp_path / "diverging" / "checkpoints"
    line = re.compile(r"error: rank \d+: step (\d+): loss (\S+), 2 bad steps in a row after 2 rollbacks in a row "
                      r"\(train\.max_rollbacks: 2\); last good checkpoint (\S+)$", re.MULTILINE)
    found = line.findall(text)
    assert len(found) == 1, text[-3000:]  # every rank diverges; the job shows the error once
    step, loss, last_good = found[0]
    assert Path(last_good).parent == checkpoints and (Path(last_good) / "COMPLETE").is_file()
    assert int(last_good.rsplit("_", 1)[1]) < int(step)
    assert text.count("rolled back from step") == 2
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("how", ["USR1 to the job's process group", "TERM to the script alone"])
def test_a_stop_request_saves_and_stops_the_job_through_the_launch_script(data, tmp_path, how):
    """Slurm's --signal=USR1@N signals every process of the job step: the `deepspeed` launcher too,
    whose default action would end it (and the job) at once. single_node.sh (as multi_node.sh) makes
    the launcher ignore it, so the ranks save and the job exits 75. `docker stop`, Kubernetes and
    `kill <pid>` send SIGTERM to the script alone: it passes the request on to the ranks (before, it
    had exec'd the launcher, which died of it and left the ranks running without the signal)."""
    from ascender_dist.training.checkpoint import latest_tag, step_of_tag

    raw = tiny_run_config(data, tmp_path / "warned", train={"train_steps": 40})
    config = tmp_path / "warned.yaml"
    config.write_text(yaml.safe_dump(raw))
    log = tmp_path / "warned.log"
    # not the launcher variables an in-process test's group left in os.environ: single_node.sh would take
    # that MASTER_PORT, which this pytest process still listens on
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "NUM_RANKS": "2", "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu"}
    proc = subprocess.Popen(["bash", "launch/single_node.sh", "--config", str(config)], cwd=REPO_ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    _wait_for(proc, log, "step 3/")
    if how.startswith("USR1"):
        os.killpg(proc.pid, signal.SIGUSR1)  # every process of the script's group, as a scheduler may
    else:
        proc.send_signal(signal.SIGTERM)  # the script's process only
    assert wait_job(proc, 120) == 75, log.read_text()[-3000:]
    # every rank receives the signal, but one may check for it a step before the other: the stop names
    # the lowest rank that had it at the deciding step, 0 or 1
    found = re.search(r"stopped at step (\d+) of 40 \(received SIGUSR1 on rank [01]\)", log.read_text())
    assert found, log.read_text()[-3000:]
    stopped = int(found.group(1))
    assert step_of_tag(latest_tag(tmp_path / "warned" / "checkpoints")) == stopped
