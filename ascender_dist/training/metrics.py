"""Console + TensorBoard logging from the one rank that owns the loss."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger("ascender_dist")


# dense bf16 tensor-core datasheet peaks, matched in this order against torch.cuda.get_device_name()
# (so the PCIe and NVL H100s, 756 and 835, and the H200 NVL, 835, are found before the SXM ones). MFU
# is against this peak whatever train.precision is (as Megatron and PaLM report it); an fp32 run reads low.
PEAK_TFLOPS = {"H200 NVL": 835.0, "H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,
               "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def cuda_peak_mib(fn) -> float:
    """Peak CUDA memory allocated while ``fn()`` runs, above what was allocated before it (MiB)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def peak_tflops_per_device(configured):
    """Configured value, else the datasheet peak of the visible GPU, else None (CPU: no MFU)."""
    import torch

    if configured:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


def throughput(flops_per_token: float, tokens_per_s: float, world_size: int, peak_tflops) -> dict[str, float]:
    """Achieved TFLOP/s per device and model FLOPs utilisation (the PaLM/Megatron definition:
    model FLOPs of forward + backward, recomputation not counted)."""
    achieved = flops_per_token * tokens_per_s / world_size / 1e12
    values = {"train/tflops_per_device": achieved}
    if peak_tflops:
        values["train/mfu"] = achieved / peak_tflops
    return values


# counters that would only clutter the console line while they are zero
_QUIET_UNLESS_NONZERO = {"train/skipped_steps", "train/step_skipped", "data/skipped_shards"}


def prepare_log_dir(log_dir: Path) -> None:
    """Create the TensorBoard directory at start-up on every rank (as the checkpoint directory), so
    that an output_dir that is a file or not writable stops the run in one line before the engine
    is built, not with an OSError on the logging rank alone while the others go on."""
    from ascender_dist.config.errors import ConfigError

    log_dir = Path(log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("output_dir", f"{log_dir}: cannot create the TensorBoard directory "
                                        f"({exc.strerror or exc})") from None
    if not os.access(log_dir, os.W_OK):
        raise ConfigError("output_dir", f"{log_dir}: TensorBoard directory is not writable")


class MetricLogger:
    """Scalars to TensorBoard and, when ``wandb.project`` is set, to Weights & Biases (same names,
    same steps); console lines. Only the logging rank (``enabled``) writes anything."""

    def __init__(self, tensorboard_dir: Optional[Path], enabled: bool, wandb=None, run_dir: Optional[Path] = None,
                 run_name: str = "run", run_config: Optional[dict] = None):
        self.enabled = enabled
        self.writer = None
        self.wandb = None
        self.tensorboard_dir = tensorboard_dir
        if enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            Path(tensorboard_dir).mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(tensorboard_dir))
        if enabled and wandb is not None and wandb.project:
            from ascender_dist.training.wandb_sink import WandbSink

            self.wandb = WandbSink(wandb, Path(run_dir or "."), run_name, run_config)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.wandb is not None:
            try:
                self.wandb.log(step, values)
            except Exception as exc:  # W&B's own types (a finished run, a dead service): logging rank only
                self._stop_wandb(exc)
        if self.writer is None:
            return
        try:
            for name, value in values.items():
                if value is not None:
                    self.writer.add_scalar(name, value, step)
        except OSError as exc:  # the writer thread's failure (disk full), raised on the logging rank only
            self._stop_tensorboard(exc)

    def line(self, step: int, total: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        parts = [f"step {step}/{total}"]
        for name, value in values.items():
            if value is None or name in _QUIET_UNLESS_NONZERO and not value:
                continue
            short = name.removeprefix("train/").replace("/", "_")
            parts.append(f"{short} {value:.4g}" if isinstance(value, float) else f"{short} {value}")
        log.info(" | ".join(parts))

    def continue_at(self, step: int) -> None:
        """The run continues after ``step`` (a resume, a rollback): a new TensorBoard event file whose
        purge step hides what an earlier job or the rolled-back steps logged after ``step`` (the
        curves would otherwise zig-zag over the steps logged twice)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer.close()
            self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=step + 1)
        except OSError as exc:  # as a failed write (the logging rank alone would raise)
            self._stop_tensorboard(exc)

    def _stop_tensorboard(self, exc: OSError) -> None:
        """TensorBoard logging ends, training goes on: the logging rank raising alone would leave the
        others waiting in the next collective, and the checkpoints matter more than the curves."""
        log.error("TensorBoard logging stopped at a write failure in %s (%s: %s); training goes on",
                  self.tensorboard_dir, type(exc).__name__, exc)
        self.writer = None

    def _stop_wandb(self, exc: Exception) -> None:
        """As _stop_tensorboard, for Weights & Biases."""
        log.error("Weights & Biases logging stopped at a failure (%s: %s); training goes on", type(exc).__name__,
                  str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "")
        self.wandb = None

    def flush(self) -> None:
        if self.writer is not None:
            try:
                self.writer.flush()
            except OSError as exc:
                self._stop_tensorboard(exc)

    def close(self) -> None:
        """Close both sinks; a failure is logged, not raised (the other ranks wait at the shutdown
        barrier, and the run itself is complete)."""
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as exc:
                self._stop_tensorboard(exc)
        if self.wandb is not None:
            try:
                self.wandb.close()
            except Exception as exc:
                self._stop_wandb(exc)
