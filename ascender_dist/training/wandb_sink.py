"""Weights & Biases as a second scalar sink beside TensorBoard (``logging.wandb``).

The same scalars at the same step numbers as TensorBoard: every record carries ``step`` and all
metrics are plotted against it (``define_metric``), so a rollback that logs an earlier step again
is shown at that step instead of being dropped by W&B's own monotonic counter. ``mode: offline``
writes the run under ``<output_dir>/wandb`` with no network (``wandb sync`` uploads it later).
Console capture is off: the launcher's rank-prefixed output stays as it is.
"""

from __future__ import annotations

from pathlib import Path

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.schema import WandbConfig

STEP_KEY = "step"


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: Path, run_name: str, run_config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb", "needs the wandb package: pip install 'ascender-dist[wandb]'") from None
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir), name=run_name,
                              config=run_config or {}, settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log(self, step: int, values: dict[str, float]) -> None:
        scalars = {k: float(v) for k, v in values.items() if v is not None}
        if scalars:
            self.run.log({**scalars, STEP_KEY: step})

    def close(self) -> None:
        self.run.finish()
