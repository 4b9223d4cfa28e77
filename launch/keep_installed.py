"""Print pip constraint lines that keep the torch already installed, and the triton that came with
it, exactly as they are (launch/setup.sh and docker/Dockerfile install everything else under them).

A GPU container's torch is built against its own triton (an NGC image's differs from PyPI's); the
project's triton requirement is a range, so on such a host pip keeps that triton, and on a CPU host,
where torch brings none, it installs one from the range (for the Triton interpreter's tests).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

KEPT = ("torch", "triton")


def constraint_lines() -> list[str]:
    lines = []
    for name in KEPT:
        try:
            lines.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            if name == "torch":
                raise SystemExit("keep_installed: error: torch is not installed (install it first)") from None
    return lines


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in constraint_lines()))
