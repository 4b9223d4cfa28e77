"""An exclusive lock on a file, for work that processes started together must do once."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


@contextmanager
def exclusive_lock(path: Path, error: Callable[[str], Exception], what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` body: a second
    process waits until the first leaves it (or dies: the kernel releases the lock with the file).
    A lock file that cannot be created raises ``error("<path>: cannot create <what> (<reason>)")``."""
    try:
        handle = open(path, "a")
    except OSError as exc:
        raise error(f"{path}: cannot create {what} ({exc.strerror or exc})") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
