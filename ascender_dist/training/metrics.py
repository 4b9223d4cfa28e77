"""Console + TensorBoard logging from the one rank that owns the loss."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger("ascender_dist")


class MetricLogger:
    def __init__(self, tensorboard_dir: Optional[Path], enabled: bool):
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            Path(tensorboard_dir).mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)

    def line(self, step: int, total: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        parts = [f"step {step}/{total}"]
        for name, value in values.items():
            if value is None:
                continue
            short = name.removeprefix("train/").replace("/", "_")
            parts.append(f"{short} {value:.4g}" if isinstance(value, float) else f"{short} {value}")
        log.info(" | ".join(parts))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
