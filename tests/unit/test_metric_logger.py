"""MetricLogger: what happens when TensorBoard cannot write."""


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
