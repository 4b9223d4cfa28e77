"""The README's main job at a tiny size, through the real `deepspeed` launcher on 2 CPU ranks."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO_ROOT
from tests.helpers.tensorboard import read_scalars

pytestmark = pytest.mark.slow

TINY = ["--set", "model.seq_length=32", "--set", "model.num_layers=2", "--set", "model.hidden_size=64",
        "--set", "model.ffn_hidden_size=128", "--set", "train.train_steps=30", "--set", "train.global_batch_size=16",
        "--set", "train.micro_batch_size=4", "--set", "train.eval_interval=15", "--set", "optimizer.warmup_steps=3",
        "--set", "checkpoint.save_interval=15", "--set", "logging.log_interval=5"]


def _run_demo(demo_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEMO_DIR": str(demo_dir), "DEMO_CORPUS_BYTES": "400000", "DEMO_VOCAB": "512",
           "DEMO_SEQ": "32"}
    return subprocess.run(["bash", "launch/demo.sh", *TINY, *extra], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    demo_dir = tmp_path_factory.mktemp("demo")
    proc = _run_demo(demo_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return demo_dir, proc


def test_demo_trains_and_loss_decreases(demo_run):
    demo_dir, _ = demo_run
    scalars = read_scalars(demo_dir / "tensorboard")
    losses = [v for _, v in scalars["train/loss"]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    for tag in ("train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"):
        assert scalars[tag], tag
    assert all(v > 0 for _, v in scalars["train/tokens_per_s"])


def test_demo_writes_complete_checkpoint(demo_run):
    demo_dir, proc = demo_run
    ckpt = demo_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000030"
    for tag in ("step_00000015", "step_00000030"):
        assert (ckpt / tag / "COMPLETE").is_file()
        assert (ckpt / tag / "config.yaml").is_file()
        assert list((ckpt / tag).glob("mp_rank_00_model_states.pt"))
    assert "checkpoint in" in proc.stderr + proc.stdout
    # the TensorBoard line to copy: absolute paths, shell-quoted (it was relative to the repository root)
    tensorboard = shlex.split(proc.stdout.split("TensorBoard: ")[-1].splitlines()[0])
    assert tensorboard == [str(REPO_ROOT / ".venv" / "bin" / "tensorboard"), "--logdir",
                           str(demo_dir.resolve() / "tensorboard")], tensorboard


def test_demo_rerun_resumes_from_latest_and_continues(demo_run):
    """A second launch with a larger step budget auto-resumes instead of starting over."""
    demo_dir, _ = demo_run
    proc = _run_demo(demo_dir, "--set", "train.train_steps=35")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "step_00000030 at step 30" in out
    assert "from step 30 to 35" in out


def test_demo_mixed_ascender_connection_logs_layer_statistics(tmp_path_factory):
    """`architecture: connection` with an ASCender + Connection pattern through the same launcher, on
    two pipeline stages (layer 1 on the first, layer 2 on the last, where the logging rank is): per-head
    omega / moved attention mass and Connection reasoning steps of both stages reach TensorBoard."""
    demo_dir = tmp_path_factory.mktemp("demo_mixed")
    proc = _run_demo(demo_dir, "--set", "model.architecture=connection", "--set", "model.layer_pattern=SC",
                     "--set", "model.ascender.d_z=8", "--set", "model.ascender.d_a=8", "--set", "model.ascender.k=4",
                     "--set", "model.ascender.window=16", "--set", "model.ascender.num_global=2",
                     "--set", "model.connection.num_slots=8", "--set", "model.connection.rank=4",
                     "--set", "model.connection.causal_chunk_size=16", "--set", "train.train_steps=10",
                     "--set", "train.eval_interval=0", "--set", "checkpoint.save_interval=0",
                     "--set", "parallel.pipeline_model_parallel_size=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scalars = read_scalars(demo_dir / "tensorboard")
    assert len(scalars["train/loss"]) == 10
    for tag in ("ascender/omega_align/layer01/head00", "ascender/mass_moved_all/layer01",
                "ascender/tau_score/layer01/head00", "ascender/kappa/layer01/head01",
                "connection/steps_mean/layer02", "connection/steps_max/layer02"):
        assert scalars[tag], tag
    steps = [v for _, v in scalars["connection/steps_max/layer02"]]
    assert all(1 <= s <= 3 for s in steps)  # the debug preset's max_steps is 3
