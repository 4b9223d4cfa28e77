"""Read scalars back from TensorBoard event files (what a user would look at)."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

# events.out.tfevents.<seconds>.<host>.<pid>.<writer counter>: TensorBoard reads a run's files in name
# order, and within one second of one process the counter decides, as text (".10" before ".9")
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.(\d+)$")


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) points as TensorBoard shows them (a later file's purge step hides
    what earlier files logged at or after it). The files are read in the order they were written: a test
    process creates many writers, so files of one second can carry counters 9 and 10, which TensorBoard's
    name order would swap (a training process writes a new file at a resume or a rollback, seconds apart)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((f for f in Path(logdir).iterdir() if _EVENT_FILE.match(f.name)),
                   key=lambda f: tuple(int(g) if g.isdigit() else g for g in _EVENT_FILE.match(f.name).groups()))
    with tempfile.TemporaryDirectory() as ordered:
        for i, f in enumerate(files):  # names in written order
            shutil.copyfile(f, Path(ordered) / f"events.out.tfevents.{i:06d}.ordered")
        acc = EventAccumulator(ordered, size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
