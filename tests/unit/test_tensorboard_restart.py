"""TensorBoard after a job that died before its first checkpoint: the next job starts from step 0
again, and its curves must show each step once, as an uninterrupted run's (no zig-zag over the
steps the dead job logged)."""

from __future__ import annotations

from types import SimpleNamespace

from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.metrics import MetricLogger
from ascender_dist.training.trainer import Trainer
from tests.helpers.tensorboard import read_scalars


def test_a_fresh_start_hides_what_a_job_that_died_before_its_first_checkpoint_logged(tmp_path, monkeypatch):
    board = tmp_path / "tensorboard"
    dead = MetricLogger(board, enabled=True)
    for step in (1, 2, 3):
        dead.scalars(step, {"train/loss": 10.0 + step})
    dead.flush()  # killed here: no checkpoint was written

    trainer = Trainer.__new__(Trainer)  # only what resume() reads when no checkpoint exists
    trainer.derived = SimpleNamespace(checkpoint_dir=tmp_path / "checkpoints")
    trainer.resume_tag, trainer.step, trainer.engine = None, 0, None
    trainer.metrics = MetricLogger(board, enabled=True)
    trainer._engine_for = lambda tag: None
    monkeypatch.setattr(ckpt, "agreed_latest_tag", lambda directory: None)
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda engine, directory, tag: None)
    assert trainer.resume() is False
    for step in (1, 2):
        trainer.metrics.scalars(step, {"train/loss": float(step)})
    trainer.metrics.close()
    assert read_scalars(board)["train/loss"] == [(1, 1.0), (2, 2.0)]
