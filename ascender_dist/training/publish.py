"""Replace a directory by a finished one without a moment where a crash leaves neither.

Checkpoints (``checkpoint._publish``) and the converters' outputs (``tools.convert.staged_output``:
consolidate, export-hf, the lm-eval export cache) are written into a staging directory next to
their final path, then published here: what the final path holds is renamed aside, the staging
directory is renamed in (two atomic renames), and the caller deletes the copy moved aside once the
new one is in use. Deleting the old directory first would leave nothing at the final path if the
process died before the second rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from data_pipeline._io import fsync_dir


def publish_directory(staged: Path, final: Path, aside: Path,
                      keep_old: Callable[[Path], bool] = lambda old: True) -> bool:
    """Rename the finished directory ``staged`` to ``final``. What ``final`` holds is first renamed
    to ``aside`` (a stale ``aside`` is deleted before), or deleted when ``keep_old(final)`` says it
    is not worth keeping (an incomplete directory). Returns whether ``aside`` now holds the previous
    ``final``: the caller deletes it when the new one is in use, and reads it if this raises
    between the renames. The renames are forced to stable storage before it returns: whatever
    the caller writes next to point at ``final`` (a checkpoint's ``latest``) must not outlive them
    in a power loss."""
    moved = False
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        if keep_old(final):
            os.replace(final, aside)
            moved = True
        else:
            shutil.rmtree(final)
    os.replace(staged, final)
    fsync_dir(final.parent)
    return moved
