"""This repository's pyproject.toml, parsed (tomllib from Python 3.11, tomli before it)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the dev extra installs tomli on Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    """The ``[project]`` table."""
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
