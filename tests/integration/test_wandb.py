"""Weights & Biases offline logging through the real training loop (2 ranks, deepspeed launcher):
the W&B history holds the TensorBoard scalars at the same steps."""

from __future__ import annotations

import pytest

from tests.helpers.tensorboard import read_scalars
from tests.integration.test_demo import _run_demo
from tests.unit.test_wandb_logging import read_wandb_history

pytestmark = pytest.mark.slow
pytest.importorskip("wandb", reason="wandb is in the [wandb] and [dev] extras")


def test_demo_logs_the_same_scalars_to_wandb_offline(tmp_path_factory):
    demo_dir = tmp_path_factory.mktemp("demo_wandb")
    proc = _run_demo(demo_dir, "--set", "train.train_steps=10", "--set", "checkpoint.save_interval=0",
                     "--set", "train.eval_interval=5", "--set", "logging.wandb.project=demo",
                     "--set", "logging.wandb.mode=offline")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tb = {(tag, step): v for tag, rows in read_scalars(demo_dir / "tensorboard").items() for step, v in rows}
    runs = list((demo_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # one run, from the logging rank only
    wb = {(k, row["step"]): v for row in read_wandb_history(runs[0]) for k, v in row.items()
          if not k.startswith("_") and k != "step"}
    assert len([k for k in tb if k[0] == "train/loss"]) == 10 and ("val/loss", 10) in tb
    assert set(wb) == set(tb)
    assert all(abs(wb[k] - tb[k]) <= 1e-6 * max(1.0, abs(tb[k])) for k in tb)
