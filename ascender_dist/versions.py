"""Installed versions of the packages a result or checkpoint records.

A package that is not installed (a source checkout run through ``PYTHONPATH``, as on a cluster image
that keeps its own torch) is recorded as ``None``: recording versions must never stop a run, least of
all at its final checkpoint save."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Iterable, Optional


def package_version(name: str) -> Optional[str]:
    """The installed distribution version of ``name``, or None when it has no metadata."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def package_versions(names: Iterable[str]) -> dict:
    """``{name: version or None}`` for each of ``names``, in their order."""
    return {name: package_version(name) for name in names}
