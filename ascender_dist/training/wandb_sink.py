"""Weights & Biases as a second scalar sink beside TensorBoard (``logging.wandb``).

The same scalars at the same step numbers as TensorBoard: every record carries ``step`` and all
metrics are plotted against it (``define_metric``), so a rollback that logs an earlier step again
is shown at that step instead of being dropped by W&B's own monotonic counter. ``mode: offline``
writes the run under ``<output_dir>/wandb`` with no network (``wandb sync`` uploads it later).
Console capture is off: the launcher's rank-prefixed output stays as it is.

Online, one W&B run per output directory, as TensorBoard has one event directory: the run id is
kept in ``<output_dir>/wandb/run_id`` and a restarted job (auto-resume after a crash or preemption)
resumes that run (``resume="allow"``) instead of starting a new one per restart. Offline, every job
writes a run of its own: an offline run cannot resume, and ``wandb sync`` of several offline runs
under one id replaces the earlier history with the later one.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.schema import WandbConfig
from data_pipeline._io import exclusive_temporary

STEP_KEY = "step"
RUN_ID_FILE = "run_id"
RUN_ID = re.compile(r"[A-Za-z0-9_-]+")


def persistent_run_id(wandb_dir: Path) -> str:
    """The W&B run id of this output directory: read from ``wandb_dir/run_id``, or drawn and
    written there (atomically) by the first job that logs into it."""
    path = Path(wandb_dir) / RUN_ID_FILE
    if path.is_file():
        run_id = path.read_text().strip()
        if run_id and not RUN_ID.fullmatch(run_id):
            raise ConfigError("logging.wandb", f"{path}: {run_id[:40]!r} is not a W&B run id (letters, digits, "
                                               "- and _); delete the file to start a new run")
        if run_id:
            return run_id
    run_id = secrets.token_hex(6)  # W&B ids: letters and digits
    tmp, fd = exclusive_temporary(path)
    with open(fd, "w") as fh:
        fh.write(run_id + "\n")
    tmp.replace(path)
    return run_id


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: Path, run_name: str, run_config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb", "needs the wandb package: pip install 'ascender-dist[wandb]'") from None
        wandb_dir = Path(run_dir) / "wandb"  # where wandb.init(dir=run_dir) writes its runs
        wandb_dir.mkdir(parents=True, exist_ok=True)
        resume = {"id": persistent_run_id(wandb_dir), "resume": "allow"} if cfg.mode == "online" else {}
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir),
                                  name=run_name, config=run_config or {},
                                  settings=wandb.Settings(console="off", silent=True), **resume)
        except Exception as exc:  # network, authentication, a bad entity: W&B's own types
            text = str(exc).strip().splitlines() or [""]
            raise ConfigError("logging.wandb", f"wandb.init failed ({type(exc).__name__}: {text[0][:200]}); "
                                               "mode: offline logs without a network") from None
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log(self, step: int, values: dict[str, float]) -> None:
        scalars = {k: float(v) for k, v in values.items() if v is not None}
        if scalars:
            self.run.log({**scalars, STEP_KEY: step})

    def close(self) -> None:
        self.run.finish()
