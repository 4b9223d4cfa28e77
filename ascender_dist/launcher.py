"""Where the ``deepspeed`` launcher of this Python environment is (commands that start ranks)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ascender_dist.config.errors import UserError

# --hostfile of a launch on this machine alone: DeepSpeed's default, /job/hostfile, would make it a
# multi-node launch over pdsh wherever that file exists (a file that is not a regular one reads as
# "no hostfile": local resources only)
NO_HOSTFILE = "/dev/null"


def deepspeed_launcher() -> Path:
    """The ``deepspeed`` launcher next to the interpreter (a virtualenv), else on PATH (a system
    Python installs scripts elsewhere, e.g. /usr/local/bin, and so does ``pip install --user``)."""
    beside = Path(sys.executable).with_name("deepspeed")
    if beside.is_file():
        return beside
    found = shutil.which("deepspeed")
    if found is None:
        raise UserError(f"the deepspeed launcher is neither next to {sys.executable} nor on PATH "
                        "(pip install deepspeed, or activate the environment that has it)")
    return Path(found)
