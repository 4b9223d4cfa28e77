"""Small file helpers shared by the pipeline: atomic, durable writes and hashing.

Every file the pipeline produces is written under a temporary name in the same directory
and renamed into place, so an interrupted or failed write never destroys a file that was
already there (rename is atomic on POSIX within one filesystem). The file gets the mode a plain
``open()`` would give it (0666 minus the umask, 0644 by default), not mkstemp's private 0600, so
a group sharing the directory can read it.

Atomic is not durable: after a power loss or kernel crash the rename may have reached the disk
while the bytes it names did not (a zero-length or zero-filled file under the final name), or
neither. So a file's data is fsynced before the rename that makes it count, and its directory
after (:func:`fsync_file`, :func:`fsync_dir`); the same order holds for what is committed by a
later record rather than a rename (shards before their manifest, part files before their job mark).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from .errors import DataError

log = logging.getLogger(__name__)


def file_identity(path) -> str:
    """What makes two spellings of a local path one file, for the checks that refuse reading one
    twice (shards, corpus inputs): the resolved path (``x``, ``./x``, ``dir/../x``, a symlink to it)."""
    return os.path.realpath(path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary sibling and a rename, so readers never see half a file.

    An output path that cannot be written (an existing directory, a path under a regular file, no
    permission, a full disk) is a one-line DataError naming it, not an OSError traceback."""
    path = Path(path)
    try:
        _write_via_temporary(path, data)
    except OSError as e:
        raise DataError(str(path), f"cannot write ({_write_problem(path, e)})") from None


def exclusive_temporary(path: Path) -> tuple[Path, int]:
    """``.<name>.tmp.<pid>`` beside ``path``, created afresh, and a descriptor open for writing it:
    whatever had that name goes first (a crashed writer's leftover, or a symbolic link planted at
    the predictable name in a shared directory, which would redirect the write to its target), then
    the file is created exclusively without following a link (O_EXCL | O_NOFOLLOW), mode 0666 less
    the umask. The caller writes, then renames it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    return tmp, fd


def check_writable(path: Path) -> None:
    """Refuse, before the work that produces it, an output file ``path`` that cannot be written:
    an existing directory, a path under a regular file, or a directory the user may not write."""
    path = Path(path)
    if path.is_dir():
        raise DataError(str(path), "cannot write (Is a directory)")
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise DataError(str(path), f"cannot write ({ancestor} is not a directory)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise DataError(str(path), f"cannot write ({ancestor} is not writable)")


def refuse_existing(path: Path, advice: str) -> None:
    """Refuse an output file that already exists (a dangling symlink included): a corpus or a
    tokenizer is never replaced, since a user's own file or what was made from the old one
    (shards, checkpoints: they record its hash) would be lost or stop matching."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise DataError(str(path), f"exists; not replaced ({advice})")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (the root at worst)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_problem(path: Path, error: OSError) -> str:
    """Why ``path`` could not be written, in words: mkdir under a regular file says only "File
    exists", so name the ancestor that is not a directory instead."""
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    return error.strerror or str(error)


def cannot_write(path: Path, error: OSError) -> DataError:
    """The one-line error for creating ``path`` (a file or folder) that failed with ``error``, named
    by the folder that refused it (its closest existing ancestor): ``out: cannot write (Permission
    denied)``, where the OSError would name a temporary file the user never chose."""
    return DataError(str(_nearest_existing(Path(path).parent)), f"cannot write ({_write_problem(Path(path), error)})")


def make_dirs(directory: Path) -> Path:
    """``directory`` created with its parents where missing; one that cannot be (no permission, a
    read-only file system) is a one-line DataError (:func:`cannot_write`), not a traceback."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cannot_write(directory, e) from None
    return directory


@contextmanager
def writing_into(directory: Path):
    """Turn an OSError of the writes in the block (a full disk, a quota, an I/O error) into a one-line
    DataError naming ``directory``, the output folder, and the OS error: ``out: cannot write (No space
    left on device)``. Use it around writes only, so a read error is never reported as a write's;
    the caller's ``finally`` still removes its temporary files."""
    try:
        yield
    except OSError as e:
        raise DataError(str(directory), f"cannot write ({e.strerror or e})") from None


@contextmanager
def signals_deferred(signals=(signal.SIGTERM, signal.SIGINT)):
    """Hold ``signals`` back during the block, then deliver them: each that arrives is recorded, and
    raised again to the handler that was in place once the block has ended (also when it fails).
    For a commit of several steps (a dataset's shards, manifest and stale-shard removal) that a
    polite stop (SIGTERM from timeout, scancel or docker stop; Ctrl-C) must not cut in half. Python
    runs handlers in the main thread only, which alone may set them: elsewhere the block runs as is.
    A signal the process ignores stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in signals if signal.getsignal(signum) not in (signal.SIG_IGN, None)}
    try:
        yield
    except BaseException:  # the block's own error wins: the stop it raced with is not raised over it
        caught.clear()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        # SIGTERM first: a handler that raises (SIGINT's KeyboardInterrupt) would drop the ones after it
        for signum in sorted(dict.fromkeys(caught), key=lambda s: s != signal.SIGTERM):
            signal.raise_signal(signum)


def _write_via_temporary(path: Path, data: bytes) -> None:
    """The write-and-rename of :func:`atomic_write_bytes`: the bytes fsynced before the rename, the
    directory after it (see the module docstring); the temporary file never outlives a failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync it before returning: for files
    that a later rename or record commits (shards in a temporary directory, part streams), whose
    bytes must be on disk before that commit is."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    """Flush a file written (and closed) elsewhere, e.g. by a worker process, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# errnos of file systems that cannot fsync a directory (some FUSE and network mounts): they give
# no way to make an entry durable, and refusing to write there at all would help no one
_NO_DIR_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (files created or renamed in it) survive a power loss (the
    pipeline's writes and the checkpoints'); a file system that cannot sync a directory is let be."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (a set-and-restore would
    race with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode() -> int:
    """Mode of a regular file created by ``open()`` under the current umask."""
    return 0o666 & ~current_umask()


def honour_umask(path: Path) -> None:
    """Give a file a writer created private (mkstemp, safetensors' ``save_file``: 0600) the mode
    ``open()`` would have given it. Call before renaming it into place."""
    os.chmod(path, umask_mode())


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    """Write ``obj`` as indented, key-sorted JSON (stable bytes for stable diffs and hashes)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of an in-memory buffer."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so large files do not need to fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _unlink_quietly(path) -> None:
    """Remove a temporary file if it still exists; cleanup must never mask the real error."""
    try:
        os.unlink(path)
    except OSError:
        pass


def run_temp_dir(parent: Path, kind: str) -> Path:
    """A new temporary directory in ``parent`` for one run's work (``.<kind>-tmp-<machine>-<pid>-*``),
    after removing the ones runs on this machine left when they were killed outright (SIGKILL, out
    of memory, a scheduler's kill: no ``finally`` ran), which may hold a dataset's worth of shards.
    A directory of a live process, of another machine or of another container is left alone:
    another job may be writing it."""
    prefix = f".{kind}-tmp-{_machine_tag()}-"
    for path in sorted(Path(parent).glob(f"{prefix}*")):
        pid = re.fullmatch(r"(\d+)-.+", path.name[len(prefix):])
        if pid is not None and path.is_dir() and not _process_alive(int(pid.group(1))):
            log.warning("removing %s, left by a run on this machine that was killed (process %s)", path, pid.group(1))
            shutil.rmtree(path, ignore_errors=True)
    try:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    except OSError as e:  # a folder this user may not write, a read-only file system
        raise cannot_write(Path(parent) / prefix, e) from None


def _machine_tag() -> str:
    """This host and process-id namespace (containers on one host number processes apart), as
    one name-safe word: process ids are only comparable within it."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return f"{host}_{namespace}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
