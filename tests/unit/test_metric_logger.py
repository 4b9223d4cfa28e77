"""MetricLogger: what happens when TensorBoard or Weights & Biases cannot write."""


def test_a_tensorboard_write_failure_stops_its_logging_not_the_run(tmp_path, caplog):
    """A full disk surfaces in add_scalar on the logging rank only: raising there left the other ranks
    waiting in the next collective."""
    import errno

    from ascender_dist.training.metrics import MetricLogger

    metrics = MetricLogger(tmp_path / "tb", enabled=True)
    metrics.scalars(1, {"train/loss": 2.0})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    metrics.writer.add_scalar = full
    metrics.scalars(2, {"train/loss": 1.9})
    assert metrics.writer is None and "TensorBoard logging stopped at a write failure" in caplog.text
    metrics.scalars(3, {"train/loss": 1.8})  # and nothing more is tried
    metrics.flush()


class _FailingSink:
    """A W&B sink whose service went away (wandb raises its own exception types)."""

    def __init__(self):
        self.calls = 0

    def log(self, step, values):
        self.calls += 1
        raise RuntimeError("wandb service is gone\nsecond line")

    def close(self):
        raise RuntimeError("finish failed")


def test_a_wandb_failure_stops_its_logging_not_the_run(tmp_path, caplog):
    """Only the logging rank logs: a W&B exception raised there (or at the final close) would leave
    the other ranks waiting in the next collective; TensorBoard goes on."""
    import errno

    from ascender_dist.training.metrics import MetricLogger

    metrics = MetricLogger(tmp_path / "tb", enabled=True)
    metrics.wandb = sink = _FailingSink()
    metrics.scalars(1, {"train/loss": 2.0})
    assert metrics.wandb is None and sink.calls == 1
    assert "Weights & Biases logging stopped at a failure (RuntimeError: wandb service is gone)" in caplog.text
    metrics.scalars(2, {"train/loss": 1.9})  # not tried again; TensorBoard still writes
    assert sink.calls == 1 and metrics.writer is not None
    metrics.wandb = _FailingSink()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    metrics.writer.close = full
    metrics.close()  # neither failure is raised
    assert "finish failed" in caplog.text and metrics.writer is None and metrics.wandb is None
