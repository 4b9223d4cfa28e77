"""What a result or checkpoint records of the code it came from: the installed versions of the
packages, and the git commit of this checkout (with a hash of its uncommitted changes).

A package that is not installed (a source checkout run through ``PYTHONPATH``, as on a cluster image
that keeps its own torch) is recorded as ``None``: recording versions must never stop a run, least of
all at its final checkpoint save."""

from __future__ import annotations

import hashlib
import os
import stat
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


def unknown_git_state() -> dict:
    """git_state's record when the code's checkout is not known."""
    return {"git_commit": None, "git_dirty": None, "git_changes_sha256": None}


def _git(root: Path, *args: str, timeout: float = 60) -> str:
    """``git -C root ARGS``'s output (a file name that is not UTF-8 kept as surrogate escapes)."""
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, errors="surrogateescape",
                          timeout=timeout, check=True).stdout


def git_state(root: Path = REPO) -> dict:
    """``{"git_commit": sha or None, "git_dirty": bool or None, "git_changes_sha256": sha or None}``
    (None: ``root`` is not the top of a git checkout, e.g. a copy installed into a virtual environment
    that lies inside some other checkout, whose commit says nothing about this code). Dirty: tracked
    files differ from the commit, or files that git does not ignore are untracked (a new module that
    is not committed changes what runs as much as an edit); the changes' hash then tells two different
    sets of uncommitted changes apart (the commit and the flag alone do not). Never raises: recording
    must not stop a run."""
    try:
        if Path(_git(root, "rev-parse", "--show-toplevel", timeout=30).strip()).resolve() != Path(root).resolve():
            return unknown_git_state()
        commit = _git(root, "rev-parse", "HEAD", timeout=30).strip()
        status = _git(root, "status", "--porcelain", "--untracked-files=normal")
        changes = uncommitted_changes_sha256(root) if status.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return unknown_git_state()
    return {"git_commit": commit or None, "git_dirty": bool(status.strip()), "git_changes_sha256": changes}


def uncommitted_changes_sha256(root: Path = REPO) -> str:
    """sha256 over ``git diff HEAD`` (binary) and the name and bytes of every untracked file git does
    not ignore: what a dirty checkout runs beyond its commit. Only regular files up to
    UNTRACKED_HASH_BYTES are read; a larger one counts by name and size (a run directory or dataset
    left inside the checkout would otherwise be read in full by every rank of every run), a symbolic
    link by its target (one to /dev/zero would be read forever), anything else by its name."""
    digest = hashlib.sha256()
    digest.update(subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--binary"], capture_output=True,
                                 timeout=120, check=True).stdout)
    untracked = subprocess.run(["git", "-C", str(root), "ls-files", "--others", "--exclude-standard", "-z"],
                               capture_output=True, timeout=60, check=True).stdout.split(b"\0")
    for name in sorted(n for n in untracked if n):
        digest.update(b"\0" + name + b"\0")
        path = root / name.decode("utf-8", "surrogateescape")
        try:
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                digest.update(b"link " + os.fsencode(os.readlink(path)))
            elif stat.S_ISREG(info.st_mode):
                digest.update(path.read_bytes() if info.st_size <= UNTRACKED_HASH_BYTES else b"size %d" % info.st_size)
        except OSError:  # gone meanwhile: its name counts
            pass
    return digest.hexdigest()
