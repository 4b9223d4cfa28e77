"""What a result or checkpoint records of the code it came from: the installed versions of the
packages, and the git commit of this checkout (with a hash of its uncommitted changes).

A package that is not installed (a source checkout run through ``PYTHONPATH``, as on a cluster image
that keeps its own torch) is recorded as ``None``: recording versions must never stop a run, least of
all at its final checkpoint save."""

from __future__ import annotations

import hashlib
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parents[1]  # the checkout this package runs from
UNTRACKED_HASH_BYTES = 1 << 20  # larger untracked files count by name and size (uncommitted_changes_sha256)


def package_version(name: str) -> Optional[str]:
    """The installed distribution version of ``name``, or None when it has no metadata."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def package_versions(names: Iterable[str]) -> dict:
    """``{name: version or None}`` for each of ``names``, in their order."""
    return {name: package_version(name) for name in names}


def git_state(root: Path = REPO) -> dict:
    """``{"git_commit": sha or None, "git_dirty": bool or None, "git_changes_sha256": sha or None}``
    (None: not a git checkout). Dirty: tracked files differ from the commit, or files that git does
    not ignore are untracked (a new module that is not committed changes what runs as much as an
    edit); the changes' hash then tells two different sets of uncommitted changes apart (the commit
    and the flag alone do not)."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=normal"],
                                capture_output=True, text=True, timeout=60, check=True).stdout
        changes = uncommitted_changes_sha256(root) if status.strip() else None
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None, "git_changes_sha256": None}
    return {"git_commit": commit or None, "git_dirty": bool(status.strip()), "git_changes_sha256": changes}


def uncommitted_changes_sha256(root: Path = REPO) -> str:
    """sha256 over ``git diff HEAD`` (binary) and the name and bytes of every untracked file git does
    not ignore: what a dirty checkout runs beyond its commit. An untracked file over
    UNTRACKED_HASH_BYTES counts by name and size only: a run directory or dataset left inside the
    checkout (not code) would otherwise be read in full by every rank of every run."""
    digest = hashlib.sha256()
    digest.update(subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--binary"], capture_output=True,
                                 timeout=120, check=True).stdout)
    untracked = subprocess.run(["git", "-C", str(root), "ls-files", "--others", "--exclude-standard", "-z"],
                               capture_output=True, timeout=60, check=True).stdout.split(b"\0")
    for name in sorted(n for n in untracked if n):
        digest.update(b"\0" + name + b"\0")
        path = root / name.decode("utf-8", "surrogateescape")
        try:
            size = path.stat().st_size
            digest.update(path.read_bytes() if size <= UNTRACKED_HASH_BYTES else b"size %d" % size)
        except OSError:  # gone meanwhile, or a directory entry git lists: its name counts
            pass
    return digest.hexdigest()
