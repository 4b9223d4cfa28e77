"""Crash-safe checkpoints on top of DeepSpeed's save/load.

DeepSpeed writes one directory per tag; it moves its own ``latest`` file as it goes, so a crash
mid-save can leave ``latest`` naming a half-written tag. We never let DeepSpeed touch ``latest``,
and never write into a directory a complete checkpoint lives in:

1. every rank writes its shard into a staging directory ``<dir>/<tag>.partial/``;
2. all ranks meet at a barrier; rank 0 drops a ``COMPLETE`` marker into the staging directory
   and renames it to ``<dir>/<tag>`` (a complete checkpoint of the same step, left by an earlier
   run into the same directory, is first renamed aside to ``<tag>.replaced``, removed last);
3. only then rank 0 replaces ``<dir>/latest`` atomically (temporary file + ``os.replace``).

A crash at any moment therefore leaves ``latest`` naming a complete checkpoint; in the one window
where it names a tag just renamed aside, ``latest_tag`` reads the ``.replaced`` copy, which is
complete. Before the first save publishes its tag, rank 0 writes a placeholder ``latest``
(NO_CHECKPOINT_YET): a crash between that rename and the first real ``latest`` leaves the
placeholder next to a complete tag, which ``latest_tag`` then resumes from, while a ``latest``
missing next to complete checkpoints (deleted by hand) is still refused. Per-rank RNG states are
saved next to DeepSpeed's files so a resumed run draws the same random numbers (dropout) as an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ascender_dist.config.errors import UserError
from ascender_dist.training.guard import any_rank, first_failure
from ascender_dist.training.publish import publish_directory
from data_pipeline._io import exclusive_temporary, fsync_dir, fsync_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of the files we add next to DeepSpeed's (COMPLETE, meta.json, config.yaml, rng/)
LATEST = "latest"
COMPLETE = "COMPLETE"
PARTIAL = ".partial"  # suffix of a tag being written
REPLACED = ".replaced"  # suffix of a complete tag moved aside by a save of the same step
DELETING = ".deleting"  # suffix of a tag being pruned (renamed first: a crash never leaves half a tag)
UNIVERSAL = "-universal"  # suffix of a tag's DeepSpeed universal copy (ensure_universal)
NO_CHECKPOINT_YET = "(no checkpoint yet)"  # what ``latest`` holds from just before the first save publishes
_TAG_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; ``str(e)`` is one line naming it. ``rank``: the
    rank that found the problem, when it is not the one reporting it (a collective check)."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of_tag(tag: str) -> int:
    match = _TAG_RE.match(tag)
    if not match:
        raise CheckpointError(f"checkpoint tag {tag!r} is not of the form step_<N>")
    return int(match.group(1))


def atomic_write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` by a fsynced temporary file renamed over it (exclusive_temporary: a link
    planted at the temporary's name is not followed)."""
    tmp, fd = exclusive_temporary(path)
    with open(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def sync_tree(directory: Path) -> None:
    """Force every file below ``directory`` and then every directory's entries (``directory``'s
    included) to stable storage, as checkpoints do before they are published: without it a power
    loss after the rename could leave the new output's names pointing at data never written, once
    the previous output is gone. An error is an OSError (the caller's "writing the output failed")."""
    files, directories = [], [directory]
    for path in directory.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            directories.append(path)
        elif path.is_file() and not path.is_symlink():
            files.append(path)
    for path in sorted(files):
        fsync_file(path)
    for path in sorted(directories, key=lambda p: len(p.parts), reverse=True):  # the deepest first
        fsync_dir(path)


def prepare_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Create the checkpoint directory at start-up (every rank; shared storage), so that a path that
    is a file or not writable stops the run before it trains, not at its first save."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory is an existing file")
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{checkpoint_dir}: cannot create the checkpoint directory "
                              f"({exc.strerror or exc})") from None
    if not os.access(checkpoint_dir, os.W_OK):
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory is not writable")


def check_shared_dir(checkpoint_dir: Path) -> None:
    """Collective: every rank sees the file rank 0 writes into ``checkpoint_dir``. Each rank writes
    its own shards into the staging directory and rank 0 publishes it, so a node-local directory on
    another node would lose that node's shards at every save, unnoticed until a resume. The file's
    name is new each time (an NFS client may cache an old lookup of a fixed name), and a rank that
    does not see it yet looks again for a few seconds (attribute caches)."""
    import time

    token = _rank0_nonce(lambda nonce: atomic_write_text(Path(checkpoint_dir) / f".shared-check-{nonce}", nonce))
    probe = Path(checkpoint_dir) / f".shared-check-{token}"
    deadline = time.monotonic() + SHARED_CHECK_WAIT_S
    while (seen := _read_text(probe)) != token and time.monotonic() <= deadline:
        time.sleep(0.2)
    problem = None if seen == token else (
        f"{checkpoint_dir}: not the directory rank 0 sees ({'no' if seen is None else 'another'} probe file from "
        "rank 0): checkpoint.dir must be on storage every rank shares")
    failure = first_failure(problem)
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    if failure is not None:
        raise CheckpointError(f"rank {failure[0]}: {failure[1]}")


SHARED_CHECK_WAIT_S = 3.0


def _rank0_nonce(publish=None) -> str:
    """Collective: a random hex string drawn by rank 0 (which first calls ``publish(nonce)``, e.g.
    to write a file the other ranks then look for), the same on every rank."""
    box = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0 and publish is not None:
        publish(box[0])
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read_text(path: Path) -> Optional[str]:
    """The file's text, or None while it does not exist or cannot be read (polled files on shared
    storage: it may appear, or be replaced, between two looks)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def latest_tag(checkpoint_dir: Path) -> Optional[str]:
    """The tag ``latest`` names, if it is complete; None when there is no checkpoint yet.

    ``latest`` holding the placeholder NO_CHECKPOINT_YET: the first save crashed after it published
    its tag, before it moved ``latest`` (or before it published: then there is nothing to resume);
    the newest complete tag is the run's checkpoint (:func:`_first_save_tag`).

    Refuses a directory that holds complete checkpoints but no ``latest`` (deleted by hand?):
    starting from step 0 there would silently orphan them, and later saves could replace them."""
    pointer = Path(checkpoint_dir) / LATEST
    if not pointer.is_file():
        found = complete_tags(checkpoint_dir)
        if found:
            raise CheckpointError(f"{pointer}: missing, but the directory holds complete checkpoints (newest "
                                  f"{found[-1]}); restore it (`echo {found[-1]} > {pointer}`) or use a new "
                                  f"checkpoint.dir")
        return None
    try:
        tag = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        found = complete_tags(checkpoint_dir)
        raise CheckpointError(f"{pointer}: unreadable ({_first_line(exc)}); newest complete checkpoint: "
                              f"{found[-1] if found else 'none'}") from None
    if tag == NO_CHECKPOINT_YET:
        found = _first_save_tag(checkpoint_dir)
        if found is not None:
            log.warning("%s: the first save crashed before naming its checkpoint; reading the complete %s",
                        pointer, found)
        return found
    if (Path(checkpoint_dir) / tag / COMPLETE).is_file():
        return tag
    if (Path(checkpoint_dir) / (tag + REPLACED) / COMPLETE).is_file():  # a save crashed mid-swap
        log.warning("%s: %s is being replaced; reading the complete copy %s%s", pointer, tag, tag, REPLACED)
        return tag + REPLACED
    found = complete_tags(checkpoint_dir)
    newest = f"; newest complete checkpoint: {found[-1]}" if found else "; no complete checkpoint"
    if not tag:
        raise CheckpointError(f"{pointer}: is empty (names no checkpoint){newest}")
    if not (Path(checkpoint_dir) / tag).is_dir():
        raise CheckpointError(f"{pointer}: names {tag!r}, which does not exist{newest}")
    raise CheckpointError(f"{pointer}: names {tag!r}, which has no {COMPLETE} marker (corrupt checkpoint dir){newest}")


def _first_save_tag(checkpoint_dir: Path) -> Optional[str]:
    """With the placeholder ``latest``: the newest complete tag, or when a save of that step crashed
    between its two renames (the run re-saved the step it resumed at), the complete copy moved
    aside (``<tag>.replaced``); None when no save published a tag (a fresh start)."""
    found = held_tags(checkpoint_dir)
    if not found:
        return None
    newest = found[-1].removesuffix(REPLACED)  # the step's own tag when both are there
    return newest if (Path(checkpoint_dir) / newest / COMPLETE).is_file() else newest + REPLACED


def _write_placeholder_latest(checkpoint_dir: Path) -> None:
    """Rank 0, before a save publishes its tag: a directory without ``latest`` and without complete
    checkpoints (the run's first save) gets the placeholder, so that a crash before the real
    ``latest`` is written reads as that (:func:`latest_tag` resumes from the published tag), not as
    a ``latest`` deleted by hand (refused)."""
    pointer = checkpoint_dir / LATEST
    if not pointer.is_file() and not complete_tags(checkpoint_dir):
        atomic_write_text(pointer, NO_CHECKPOINT_YET + "\n")
        fsync_dir(checkpoint_dir)


def from_rank0(read):
    """Collective: ``read()`` as rank 0 evaluates it (a look at the checkpoint directory every rank
    must act on alike), broadcast; a CheckpointError it raises there is raised on every rank.
    Without a process group: ``read()``."""
    if not dist.is_initialized():
        return read()
    box: list = [None, None]  # [value, rank 0's error]
    if dist.get_rank() == 0:
        try:
            box[0] = read()
        except CheckpointError as exc:
            box[1] = str(exc)
        except OSError as exc:  # a directory listing that failed: the others must not wait for it
            box[1] = _first_line(exc)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointError(box[1], rank=0)
    return box[0]


def agreed_latest_tag(checkpoint_dir: Path) -> Optional[str]:
    """Collective: :func:`latest_tag` as rank 0 reads it, the same on every rank. Ranks reading
    ``latest`` themselves could resume from different steps (an NFS client's cached copy of the
    pointer from before the last save) and train on, silently, from mixed weights; and a rank whose
    read failed alone would leave the others waiting in the next collective. Every rank then waits
    a few seconds (attribute caches) to see the tag's marker itself; otherwise all stop with the
    lowest such rank's message."""
    import time

    if not dist.is_initialized():  # one process: nothing to agree on
        return latest_tag(checkpoint_dir)
    tag = from_rank0(lambda: latest_tag(checkpoint_dir))
    if tag is None:
        return None
    marker = Path(checkpoint_dir) / tag / COMPLETE
    deadline = time.monotonic() + SHARED_CHECK_WAIT_S
    while not marker.is_file() and time.monotonic() <= deadline:
        time.sleep(0.2)
    problem = None if marker.is_file() else (
        f"{marker.parent}: rank 0's latest checkpoint, but its {COMPLETE} marker is not visible here: "
        "checkpoint.dir must be storage every rank shares")
    failure = first_failure(problem)
    if failure is not None:
        raise CheckpointError(f"rank {failure[0]}: {failure[1]}", rank=failure[0])
    return tag


def complete_tags(checkpoint_dir: Path) -> list[str]:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    tags = [p.name for p in checkpoint_dir.iterdir()
            if p.is_dir() and _TAG_RE.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(tags, key=step_of_tag)


def held_tags(checkpoint_dir: Path) -> list[str]:
    """Every complete checkpoint the directory holds, by step (a moved-aside copy after the step's own
    tag): the complete tags, and a complete ``<tag>.replaced`` that a same-step save killed between
    its two renames left, which may be the run's only good checkpoint (:func:`latest_tag` resumes
    from it). Named as on disk. What a new run or a reshard must not write over."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    aside = [p.name for p in checkpoint_dir.iterdir()
             if p.is_dir() and p.name.endswith(REPLACED) and _TAG_RE.match(p.name.removesuffix(REPLACED))
             and (p / COMPLETE).is_file()]
    return sorted(complete_tags(checkpoint_dir) + aside,
                  key=lambda tag: (step_of_tag(tag.removesuffix(REPLACED)), tag.endswith(REPLACED)))


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _remove_tag(path: Path) -> None:
    """Delete a tag directory: renamed aside first, so a crash mid-delete leaves no tag that looks
    complete with files missing (_prune removes the leftover)."""
    aside = path.with_name(path.name + DELETING)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _step_tag_of(name: str) -> str:
    """The step tag a directory name derives from: ``step_N`` of ``step_N-universal`` and of
    ``step_N.replaced-universal`` (a universal copy made while ``latest`` read the moved-aside copy)."""
    return name.removesuffix(UNIVERSAL).removesuffix(REPLACED)


def _crash_leftover(path: Path) -> bool:
    """Whether ``path`` is what a crashed save, prune or universal conversion left behind and nothing
    reads: a staging (``.partial``) or half-deleted (``.deleting``) tag directory, or a universal
    conversion's work file (ensure_universal). Optimizer-sized, so removed before a save writes too;
    so are the small files a crash leaves: an atomic write's temporary (``.<name>.tmp.<pid>``, of
    ``latest`` or the conversion's heartbeat) and a shared-storage probe (``.shared-check-*``)."""
    name = path.name
    if name.startswith(".") and UNIVERSAL in name and name.endswith((".tmp", ".old", ".failed", ".alive")):
        return True
    if name.startswith(".shared-check-") or (name.startswith(".") and re.search(r"\.tmp\.\d+$", name)):
        return True
    return name.endswith((PARTIAL, DELETING)) and bool(_TAG_RE.match(_step_tag_of(name.rsplit(".", 1)[0])))


def _remove_leftover(path: Path) -> None:
    """Delete a leftover directory (or file) that is no checkpoint: its COMPLETE marker first, so a
    crash mid-delete never leaves a ``.replaced`` that a later _prune, after its step's tag is
    pruned, would rename back as a complete checkpoint."""
    if path.is_dir():
        (path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_leftover_or_warn(path: Path) -> None:
    """_remove_leftover before a save: a leftover that cannot go (a stale handle or a busy file on
    shared storage, another user's file) is a warning, as in _prune_after_save, not a failed save."""
    try:
        _remove_leftover(path)
    except OSError as exc:
        log.warning("%s: could not remove what a crashed save left (%s); the next save tries again", path, exc)


def _prune(checkpoint_dir: Path, keep_last: int, latest: str, protect=None) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last``, except those ``protect`` names (see
    save_checkpoint) (and their universal copies),
    incomplete ones older than latest, and what crashed saves and conversions left behind (staging,
    moved-aside and half-deleted directories, universal conversions' work directories). A universal
    copy of a moved-aside tag (``step_N.replaced-universal``) goes at the first save after it was
    read: its source is renamed back or deleted here, and a resume makes a copy of ``step_N``."""
    latest_step = step_of_tag(latest)
    # after a rollback, the tags above latest are the abandoned run's: never a rollback target, they
    # take no place among the keep_last
    line = [tag for tag in complete_tags(checkpoint_dir) if step_of_tag(tag) <= latest_step]
    keep = set(line[-keep_last:]) | {latest}
    if protect is not None:
        wanted = protect([step_of_tag(tag) for tag in line])
        keep |= {tag for tag in line if step_of_tag(tag) in wanted}
    listing = list(Path(checkpoint_dir).iterdir())
    names = {path.name for path in listing}  # what existed before this pass deleted anything
    for path in listing:
        if _crash_leftover(path):
            _remove_leftover(path)
            continue
        if not path.is_dir() or path.name in keep:
            continue
        base = path.with_name(path.name.rsplit(".", 1)[0])
        if path.name.endswith(REPLACED) and base.name not in names and (path / COMPLETE).is_file():
            os.replace(path, base)  # a save crashed mid-swap: this is still that step's checkpoint
        elif path.name.endswith(REPLACED) and _TAG_RE.match(_step_tag_of(base.name)):
            _remove_leftover(path)
        elif path.name.endswith(UNIVERSAL) and _TAG_RE.match(_step_tag_of(path.name)):
            if path.name.removesuffix(UNIVERSAL) not in keep:  # (a .replaced source is never kept)
                _remove_tag(path)  # its source is pruned: a copy is made again when needed
        elif _TAG_RE.match(path.name) and ((path / COMPLETE).is_file() or step_of_tag(path.name) < latest_step):
            _remove_tag(path)


def _publish(checkpoint_dir: Path, tag: str) -> None:
    """Rename the finished staging directory to ``tag``; a complete tag of the same name is moved
    aside first (both renames are atomic) and deleted only after ``latest`` has moved (_prune)."""
    # an incomplete directory of that name (written by an older version) is deleted: nothing to keep
    publish_directory(checkpoint_dir / (tag + PARTIAL), checkpoint_dir / tag, checkpoint_dir / (tag + REPLACED),
                      keep_old=lambda old: (old / COMPLETE).is_file())


def _sha256(path: Path, sync: bool = False) -> str:
    """sha256 of a file; with ``sync`` its data is also forced to stable storage (fsync)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
        if sync:
            os.fsync(fh.fileno())
    return digest.hexdigest()


def _files_under(directory: Path) -> list[str]:
    """Every regular file below ``directory``, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def _free_space(directory: Path) -> str:
    for path in (directory, *directory.parents):
        if path.exists():
            free = shutil.disk_usage(path).free
            return f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
    return "unknown"


def _write_failure(exc: BaseException) -> str:
    reason = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "read-only file system",
              errno.EFBIG: "file too large"}.get(getattr(exc, "errno", None))
    return f"{reason or 'write failed'} ({_first_line(exc)})"


def _save_failed(checkpoint_dir: Path, tag: str, failure: tuple[int, str]) -> CheckpointError:
    """Every rank: remove the staging directory (rank 0) and build the one-line error."""
    staged = checkpoint_dir / (tag + PARTIAL)
    if dist.get_rank() == 0:
        shutil.rmtree(staged, ignore_errors=True)
    latest = (_read_text(checkpoint_dir / LATEST) or "").strip() or None
    if latest == NO_CHECKPOINT_YET:  # before the first save named a tag: the one a resume reads, if any
        found = _first_save_tag(checkpoint_dir)
        where = f"a resume reads {found}" if found else "no checkpoint was written yet"
    else:
        where = f"latest still names {latest}" if latest else "no checkpoint was written yet"
    rank, message = failure
    # a failure after the tag was published (writing latest): it is complete, only latest did not move
    done = f"{tag} is complete but latest was not moved to it" if (checkpoint_dir / tag / COMPLETE).is_file() \
        else f"removed {staged.name}"
    return CheckpointError(f"{checkpoint_dir}: saving {tag} failed on rank {rank}: {message}; {done}, {where}",
                           rank=rank)


def _writing(fn, checkpoint_dir: Path) -> Optional[str]:
    """Run a write step; its failure (disk full, permission, torch's stream writer) as one line,
    with the free space the failing rank saw."""
    try:
        fn()
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, dist.DistError):  # a peer is gone: not a write problem of ours
            raise
        return f"{_write_failure(exc)}; {_free_space(checkpoint_dir)} free there"
    return None


def _hash_share(staged_dir: Path) -> dict:
    """Collective: size and sha256 of every file of the staging directory; each rank hashes (and
    fsyncs, so that ``latest`` never names data still in a page cache) every world-size-th file
    (in parallel on shared storage), every rank receives them all. The file list is the union of
    every rank's listing: a node whose directory cache is stale lists fewer files, and splitting
    each rank's own list would leave files unhashed (unchecked on resume) without a word."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing: list = []
    failure = first_failure(_writing(lambda: listing.extend(_files_under(staged_dir)), staged_dir.parent))
    if not failure:
        listings: list = [None] * world
        dist.all_gather_object(listings, listing)
        names = sorted(set().union(*listings))
        mine: dict = {}

        def hash_mine():
            mine.update({name: {"size": (staged_dir / name).stat().st_size,
                                "sha256": _sha256(staged_dir / name, sync=True)} for name in names[rank::world]})

        failure = first_failure(_writing(hash_mine, staged_dir.parent))
    if failure:
        raise _save_failed(staged_dir.parent, staged_dir.name.removesuffix(PARTIAL), failure)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return {name: record for part in gathered for name, record in sorted(part.items())}


def _with_file_records(extra_files: dict[str, str], records: dict) -> dict[str, str]:
    """meta.json gains ``files``: {relative path: {size, sha256}} of everything the ranks wrote."""
    meta = json.loads(extra_files.get("meta.json", "{}"))
    meta["files"] = records
    return {**extra_files, "meta.json": json.dumps(meta, indent=1)}


def save_checkpoint(engine, checkpoint_dir: Path, step: int, client_state: dict, keep_last: int,
                    extra_files: Optional[dict[str, str]] = None, protect=None) -> str:
    """Collective: every rank must call it. Returns the tag written. ``protect``: a function of the
    complete checkpoints' steps (ascending) giving those pruning must keep beyond ``keep_last`` (an
    open rollback row's targets, RollbackPolicy.protected_steps).

    A write that fails on any rank (disk full, permission) fails the save on every rank with the
    same one-line CheckpointError naming the directory and its free space; the staging directory
    is removed and ``latest`` stays where it was."""
    checkpoint_dir = Path(checkpoint_dir)
    tag = tag_for_step(step)
    staged = tag + PARTIAL
    rank = dist.get_rank()

    def prepare():
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # what crashed saves left (this step's half-written save among them) goes before this one writes:
        # the disk then needs room for keep_last checkpoints and one being written, not also the leftovers
        for path in list(checkpoint_dir.iterdir()):
            if _crash_leftover(path):
                _remove_leftover_or_warn(path)
        (checkpoint_dir / staged).mkdir()  # fatal if this step's own leftover could not go

    failure = first_failure(_writing(prepare, checkpoint_dir) if rank == 0 else None)
    if failure:
        raise _save_failed(checkpoint_dir, tag, failure)
    positions = _layouts()  # collective: which rank's RNG state a resume at another layout continues

    def write_shards():
        try:
            engine.save_checkpoint(str(checkpoint_dir), tag=staged, client_state=client_state, save_latest=False)
        except (OSError, RuntimeError) as exc:
            if not isinstance(exc, dist.DistError):
                # DeepSpeed's writes follow all its collectives but its closing barrier: meet the
                # peers there, then agree on the failure
                dist.barrier()
            raise
        rng_dir = checkpoint_dir / staged / "rng"
        rng_dir.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), rng_dir / f"rank_{rank:05d}.pt")
        if rank == 0 and positions is not None:
            atomic_write_text(rng_dir / RNG_POSITIONS, json.dumps([list(p) for p in positions]))

    failure = first_failure(_writing(write_shards, checkpoint_dir))
    if failure:
        raise _save_failed(checkpoint_dir, tag, failure)
    records = _hash_share(checkpoint_dir / staged)

    def publish():
        for name, text in _with_file_records(extra_files or {}, records).items():
            atomic_write_text(checkpoint_dir / staged / name, text)
        atomic_write_text(checkpoint_dir / staged / COMPLETE, f"{step}\n")
        for directory in {p.parent for p in (checkpoint_dir / staged).rglob("*")}:
            fsync_dir(directory)
        _write_placeholder_latest(checkpoint_dir)
        _publish(checkpoint_dir, tag)
        atomic_write_text(checkpoint_dir / LATEST, tag)
        fsync_dir(checkpoint_dir)

    failure = first_failure(_writing(publish, checkpoint_dir) if rank == 0 else None)
    if failure:
        raise _save_failed(checkpoint_dir, tag, failure)
    if rank == 0:
        _prune_after_save(checkpoint_dir, keep_last, tag, protect)
    return tag


def _prune_after_save(checkpoint_dir: Path, keep_last: int, tag: str, protect=None) -> None:
    """_prune once ``latest`` names ``tag``: the save is complete, so a pruning error (a busy or
    stale directory on shared storage) is a warning, not a failed save; the next save prunes again."""
    try:
        _prune(checkpoint_dir, keep_last, tag, protect)
    except OSError as exc:
        log.warning("%s: %s is saved, but pruning older checkpoints failed (%s); the next save tries again",
                    checkpoint_dir, tag, exc)


def _check_file(path: Path, record: dict) -> Optional[str]:
    """What is wrong with one checkpoint file, or None. A read error (EIO, permission) is this
    rank's problem like a bad checksum: returned, so that it reaches the peers (first_failure)."""
    try:  # is_file() too: it raises on EACCES / EIO / ESTALE (only a missing file reads as False)
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size < record["size"]:
            return f"{path}: truncated ({size} of {record['size']} bytes)"
        if size != record["size"]:
            return f"{path}: wrong size ({size} bytes, {record['size']} saved)"
        if _sha256(path) != record["sha256"]:
            return f"{path}: checksum mismatch, sha256 differs from the saved one"
    except OSError as exc:
        return f"{path}: unreadable ({_first_line(exc)})"
    return None


def _bad_file_records(meta_file: Path, records) -> Optional[str]:
    """What is wrong with meta.json's ``files`` (None: absent, an older checkpoint), or None: it must
    map relative paths inside the tag to {size: int >= 0, sha256: str}; a hand-edited or damaged
    entry is named in one line instead of a KeyError or TypeError from the check."""
    if records is None:
        return None
    if not isinstance(records, dict):
        return f"{meta_file}: files: expected an object of {{path: {{size, sha256}}}}, got {type(records).__name__}"
    for name, record in records.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            return f"{meta_file}: files: {name!r} is not a path inside the checkpoint"
        if not isinstance(record, dict):
            return f"{meta_file}: files[{name!r}]: expected {{size, sha256}}, got {type(record).__name__}"
        size, sha = record.get("size"), record.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"{meta_file}: files[{name!r}].size: expected a byte count, got {_short(record, 'size')}"
        if not isinstance(sha, str):
            return f"{meta_file}: files[{name!r}].sha256: expected a hex string, got {_short(record, 'sha256')}"
    return None


def _short(record: dict, key: str) -> str:
    """``record[key]`` for an error line: its type and at most 40 characters of its repr."""
    if key not in record:
        return "nothing"
    text = repr(record[key])
    return f"{type(record[key]).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


_RNG_FILE = re.compile(r"^rng/rank_(\d+)\.pt$")
RNG_POSITIONS = "positions.json"  # in rng/: the (dp rank, mp rank) of every saving rank
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def _position() -> Optional[tuple[int, int]]:
    """(data-parallel rank, model-parallel rank) of this rank, as DeepSpeed names its files; None
    without megatron's model-parallel groups."""
    from megatron.core import parallel_state as mps

    if not mps.model_parallel_is_initialized():
        return None
    return (mps.get_data_parallel_rank(), mps.get_tensor_model_parallel_rank()
            + mps.get_pipeline_model_parallel_rank() * mps.get_tensor_model_parallel_world_size())


def _layouts() -> Optional[list[tuple[int, int]]]:
    """Collective: _position() of every rank (None without megatron's model-parallel groups)."""
    mine = _position()
    if mine is None:
        return None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [tuple(item) for item in gathered]


def positions_from_sizes(tp: int, pp: int, dp: int) -> list[list[int]]:
    """(dp rank, mp rank) of every global rank in megatron's (and DeepSpeed's pipeline topology's)
    default order, tensor fastest, then data, then pipeline: rank = t + T d + T D p, mp = t + T p.
    For checkpoints saved before rng/positions.json recorded them."""
    out = []
    for rank in range(tp * pp * dp):
        t, d, p = rank % tp, rank // tp % dp, rank // (tp * dp)
        out.append([d, t + p * tp])
    return out


def rng_source_rank(positions: Optional[list], position: Optional[tuple[int, int]], rank: int) -> Optional[int]:
    """The saved rank whose RNG state this rank continues: the one at the same model-parallel
    position and data-parallel rank (modulo the saved data-parallel size: replicas hold equal RNG
    states). ``positions``: the saved (dp rank, mp rank) of every rank (rng/positions.json), None
    for a checkpoint without it (then the same global rank). None when no saved rank matches."""
    if positions is None or position is None:
        return rank
    saved = [tuple(p) for p in positions]
    saved_dp = 1 + max(dp for dp, _ in saved)
    want = (position[0] % saved_dp, position[1])
    return saved.index(want) if want in saved else None


def reader_ranks(names: list[str], world: int, layouts: Optional[list[tuple[int, int]]]) -> dict[str, int]:
    """The rank that reads each file on load (its RNG state, its ZeRO shard, dp-rank 0 of its model
    shard); files of no known owner (pipeline layer files, ...) go round-robin over the ranks."""
    owners = {}
    for index, name in enumerate(names):
        owner = None
        if match := _RNG_FILE.match(name):
            owner = int(match.group(1))
        elif layouts and (match := _OPTIM_FILE.match(name)):
            key = (int(match.group(1)), int(match.group(2)))
            owner = layouts.index(key) if key in layouts else None
        elif layouts and (match := _MODEL_FILE.match(name)):
            key = (0, int(match.group(1)))
            owner = layouts.index(key) if key in layouts else None
        owners[name] = owner if owner is not None and owner < world else index % world
    return owners


def verify_files(checkpoint_dir: Path, tag: str) -> None:
    """Collective, before anything is loaded: each rank checks the files of the tag it will read
    (size, then sha256, against meta.json's ``files``); if any rank finds a problem, every rank
    raises the same one-line CheckpointError naming the file, its rank and what is wrong."""
    tag_dir = Path(checkpoint_dir) / tag
    try:  # every rank reads meta.json itself: a problem one of them finds stops all of them
        records = read_meta(checkpoint_dir, tag).get("files")
        problem = _bad_file_records(tag_dir / "meta.json", records)
    except CheckpointError as exc:
        records, problem = None, str(exc)
    failure = first_failure(problem)
    if failure:
        raise CheckpointError(failure[1], rank=failure[0])
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts = _layouts()
    problem = None
    if records is None:
        if rank == 0:
            log.warning("%s: meta.json records no file checksums (older checkpoint): files not verified", tag_dir)
    else:
        owners = reader_ranks(sorted(records), world, layouts)
        for name in sorted(records):
            if owners[name] == rank and (problem := _check_file(tag_dir / name, records[name])):
                break
    failure = first_failure(problem)
    if failure:
        raise CheckpointError(f"{failure[1]} (rank {failure[0]}'s file, checked before anything was loaded)",
                              rank=failure[0])


def load_checkpoint(engine, checkpoint_dir: Path, tag: Optional[str] = None) -> Optional[dict]:
    """Collective. Load ``tag`` (default: latest) into the engine after :func:`verify_files`;
    returns the client state, or None if no checkpoint exists."""
    checkpoint_dir = Path(checkpoint_dir)
    tag = tag or agreed_latest_tag(checkpoint_dir)
    if tag is None:
        return None
    if not tag.endswith(UNIVERSAL):  # a universal copy's source is verified before conversion
        verify_files(checkpoint_dir, tag)
    try:
        path, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
    except Exception as exc:  # torch, pickle and DeepSpeed's own (ZeRORuntimeException) errors
        if isinstance(exc, dist.DistError):  # a peer is gone: not this checkpoint's problem
            raise
        raise CheckpointError(f"{checkpoint_dir / tag}: unreadable on rank {dist.get_rank()} "
                              f"({_first_line(exc)})") from exc
    if path is None:
        raise CheckpointError(f"{checkpoint_dir / tag}: DeepSpeed could not load this checkpoint")
    source_tag = tag.removesuffix(UNIVERSAL)  # a universal copy's RNG: its source's
    _load_rng(checkpoint_dir / source_tag / "rng", read_meta(checkpoint_dir, source_tag))
    return client_state


def _load_rng(rng_dir: Path, meta: dict) -> None:
    """This rank's RNG states from the saved rank at its position (rng_source_rank): after a change
    of data-parallel size the global ranks of the pipeline stages move, and each stage must go on
    with its own stage's streams (two stages with one stream draw equal dropout masks). Positions
    come from rng/positions.json, or for an older checkpoint from the layout meta.json records."""
    positions_file = rng_dir / RNG_POSITIONS
    try:
        positions = json.loads(positions_file.read_text(encoding="utf-8")) if positions_file.is_file() else None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{positions_file}: unreadable ({_first_line(exc)})") from exc
    sizes = [meta.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")]
    if positions is None and all(isinstance(x, int) and x > 0 for x in sizes):
        positions = positions_from_sizes(*sizes)
    source = rng_source_rank(positions, _position(), dist.get_rank())
    rng_file = rng_dir / f"rank_{source if source is not None else dist.get_rank():05d}.pt"
    if source is None or not rng_file.is_file():
        log.warning("%s: no RNG state for this rank's position (layout changed?); continuing with fresh RNG",
                    rng_file)
        return
    try:
        _set_rng_state(torch.load(rng_file, weights_only=True))  # tensors only: no pickled code runs
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{rng_file}: unreadable ({_first_line(exc)})") from exc


def _first_line(exc: BaseException) -> str:
    """The exception's type and first line, and its second when the first only announces it
    (torch's "Error(s) in loading state_dict for X:" then "size mismatch for ...")."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    head = text[0] if text else ""
    if head.endswith(":") and len(text) > 1:
        head = f"{head} {text[1]}"
    return f"{type(exc).__name__}: {head}"


def read_meta(checkpoint_dir: Path, tag: str) -> dict:
    """meta.json of a tag (step, layout, data state), which every save writes: resuming without
    it would have to guess the data-parallel size the optimizer state was sharded for."""
    path = Path(checkpoint_dir) / tag / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every save writes it; checkpoint from another tool?)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    # ValueError: also an integer past Python's digit limit; RecursionError: nesting past the stack
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable ({_first_line(exc)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def recorded_tokenizer_sha256(meta: dict) -> Optional[str]:
    """meta.json's ``tokenizer_sha256``: the identity of the tokenizer the weights were trained with
    (checkpoints record it), or None (older checkpoints, runs without a tokenizer). The one reading
    of it that resumes (resume_check) and the tools (exports, evaluations, reshard) compare against."""
    sha = meta.get("tokenizer_sha256")
    return sha if isinstance(sha, str) and sha else None


def _universal_input_view(tag_dir: Path, view: Path) -> None:
    """DeepSpeed's ds_to_universal fails on the ``None`` entries megatron puts in a module state
    dict (``*._extra_state``). Give it a view of the tag: links to every file, except model-state
    files rewritten without those entries. The checkpoint itself is never modified."""
    view.mkdir(parents=True)
    for item in tag_dir.iterdir():
        if item.name.endswith("model_states.pt"):
            state = torch.load(item, map_location="cpu", weights_only=False)
            if isinstance(state.get("module"), dict):
                state["module"] = {k: v for k, v in state["module"].items() if v is not None}
            torch.save(state, view / item.name)
        else:
            (view / item.name).symlink_to(item.resolve())


def ensure_universal(checkpoint_dir: Path, tag: str, progress: Optional[Callable[[str], None]] = None) -> str:
    """Collective. A DeepSpeed *universal* copy of ``tag`` (optimizer state independent of the
    data-parallel size), made once by rank 0 next to it as ``<tag>-universal``; returns its tag.

    The conversion can take longer than the process group's timeout, so the other ranks wait for
    its outcome on the (shared) checkpoint directory, not in a collective: the copy's marker, or a
    failure note of this attempt. Then every rank raises rank 0's error, or none does.

    ``progress(what)`` is called, on every rank, each time the conversion's output has grown or
    shrunk since the last heartbeat (from a helper thread on rank 0): a stall watchdog can tell a
    long conversion that advances from one that hangs."""
    checkpoint_dir = Path(checkpoint_dir)
    verify_files(checkpoint_dir, tag)
    universal = f"{tag}{UNIVERSAL}"
    # the copy records which save of the tag it was made from: a tag saved again (same step, after
    # a rollback) gets a new copy
    marker = f"universal {_sha256(checkpoint_dir / tag / 'meta.json')}\n"
    done = checkpoint_dir / universal / COMPLETE
    attempt = _rank0_nonce()  # names this attempt's failure note
    failed = checkpoint_dir / f".{universal}.failed"
    alive = checkpoint_dir / f".{universal}.alive"
    problem = None
    if dist.get_rank() == 0:
        if _read_text(done) != marker:
            work = _universal_work_dir(checkpoint_dir, universal)
            shutil.rmtree(work, ignore_errors=True)  # a killed attempt's leftovers: removing them is no progress
            with _heartbeat(alive, attempt, work / universal, _described(progress, tag)) as converted:
                try:
                    _convert_to_universal(checkpoint_dir, tag, universal, marker, converted)
                except Exception as exc:  # any failure must reach the waiting ranks, or they wait forever
                    problem = str(exc) if isinstance(exc, CheckpointError) else (
                        f"{checkpoint_dir / tag}: conversion to a universal checkpoint failed: "
                        f"{_first_line(exc)}")
                    atomic_write_text(failed, f"{attempt}\n{problem}")
    else:
        problem = _wait_for_universal(done, marker, failed, attempt, alive, _described(progress, tag))
    failure = first_failure(problem)
    if failure is not None:
        raise CheckpointError(failure[1])
    if dist.get_rank() == 0:
        failed.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)
    return universal


UNIVERSAL_HEARTBEAT_S = 5.0  # rank 0 rewrites its heartbeat file this often while it converts
UNIVERSAL_STALE_S = 300.0  # a waiting rank gives up when the heartbeat has not changed for this long


def _universal_work_dir(checkpoint_dir: Path, universal: str) -> Path:
    """Where rank 0 builds ``universal`` before publishing it (its output is ``<work>/<universal>``)."""
    return checkpoint_dir / f".{universal}.tmp"


def tree_size(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path`` now ((0, 0) when it does not exist): how much a conversion has
    written so far. Files that vanish while it is counted are left out."""
    files = size = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                continue
            files += 1
    return files, size


def _described(progress: Optional[Callable[[str], None]], tag: str) -> Callable[[str], None]:
    """``progress`` with the conversion named ("the universal conversion of <tag>: ..."); a no-op when
    None. A report that raises is logged once and none is made after it: a callback's failure must not
    stop rank 0's heartbeat (the waiting ranks would take rank 0 for dead) nor take a waiting rank out
    of the conversion's protocol (rank 0 would wait for it in the closing collective)."""
    if progress is None:
        return lambda written: None
    failed = []

    def report(written: str) -> None:
        if failed:
            return
        try:
            progress(f"the universal conversion of {tag}: {written}")
        except Exception as exc:  # noqa: BLE001  (any callback error; see the docstring)
            failed.append(exc)
            log.warning("a progress report of the universal conversion of %s failed, no more are made: %s",
                        tag, _first_line(exc))

    return report


@contextlib.contextmanager
def _heartbeat(path: Path, attempt: str, output: Path, progress: Callable[[str], None]):
    """While the block runs, a thread rewrites ``path`` every UNIVERSAL_HEARTBEAT_S with this attempt's
    nonce, a counter and how much is under ``output`` (the conversion's output): the counter is the
    waiting ranks' sign that rank 0 is still converting (a rank 0 killed mid-conversion, e.g. out of
    host memory, writes no failure note; without it, ranks on other nodes, which wait on files rather
    than in a collective, would wait forever), the size the sign that the conversion advances, which
    is passed to ``progress`` whenever it changed (a hung converter keeps the counter going but not
    the size). Yields an Event the block sets once the converter has returned: the size is then
    reported once more as converted and no longer followed (publishing moves the output away).
    ``progress`` runs after the beat is written and must not raise (_described guards it)."""
    stop, converted = threading.Event(), threading.Event()

    def beat():
        count, last = 0, _written((0, 0))
        while True:
            if not converted.is_set():
                now = _written(tree_size(output))
            elif not last.startswith("converted"):
                now = _converted(last)
            else:
                now = last
            try:
                atomic_write_text(path, f"{attempt}\n{count}\n{now}")
            except OSError:
                pass  # a missed beat: the next one may land; the waiters allow UNIVERSAL_STALE_S
            if now != last:
                progress(now)
            last = now
            count += 1
            if stop.wait(UNIVERSAL_HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name="universal-heartbeat", daemon=True)
    thread.start()
    try:
        yield converted
    finally:
        stop.set()
        thread.join()


UNIVERSAL_CONVERTER = "deepspeed.checkpoint.ds_to_universal"
# python -c: ignore the signals named in argv[1] (an ignored signal stays ignored in the module's own
# worker processes), then run module argv[2] as __main__ with the remaining arguments
_SHIELDED_MAIN = """import runpy, signal, sys
from ascender_dist.training.preemption import die_with_parent
die_with_parent(int(sys.argv[1]), signal.SIGKILL)
for name in filter(None, sys.argv[2].split(",")):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
module = sys.argv[3]
sys.argv = [module] + sys.argv[4:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_shielded(module: str, args: list[str]):
    """``python -m module args`` (output captured) with the signals this rank watches to save and
    stop (preemption.watch_signals) ignored: a scheduler's warning or the launcher's SIGTERM goes to
    every process of the job, and must reach the rank, which stops after its next step, not kill a
    conversion the resume is waiting for. A signal in the child's first milliseconds, before it
    ignores them, can still end it. The child dies with this process (SIGKILL on its death)."""
    import subprocess
    import sys

    from ascender_dist.training.preemption import watched_signal_names

    # the child dies with this rank: an orphan would write on into the next job's work directory
    return subprocess.run([sys.executable, "-c", _SHIELDED_MAIN, str(os.getpid()), ",".join(watched_signal_names()),
                           module, *args], capture_output=True, text=True)


def _failure_line(result) -> str:
    """Why a child process failed, in one line: the signal that killed it, else its last output line."""
    if result.returncode < 0:
        import signal

        return f"killed by {signal.Signals(-result.returncode).name}"
    tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
    return tail[0] if tail else f"exit status {result.returncode}"


def _convert_to_universal(checkpoint_dir: Path, tag: str, universal: str, marker: str,
                          converted: Optional[threading.Event] = None) -> None:
    """Rank 0: ds_to_universal into a hidden work directory, then publish it as ``universal``
    (the previous copy renamed aside, not deleted first: a crash between the renames loses no copy
    that a later attempt could not make again, and never touches the source tag). ``converted`` is
    set once the converter has returned successfully (the heartbeat's cue, _heartbeat). The caller
    has removed a killed attempt's work directory (before the heartbeat starts)."""
    work = _universal_work_dir(checkpoint_dir, universal)
    try:
        _universal_input_view(checkpoint_dir / tag, work / tag)
        result = run_shielded(UNIVERSAL_CONVERTER, [
            "--input_folder", str(work / tag), "--output_folder", str(work / universal), "--inject_missing_state",
            "--num_extract_workers", "1", "--num_merge_workers", "1"])
        if result.returncode:
            raise CheckpointError(f"{checkpoint_dir / tag}: conversion to a universal checkpoint failed: "
                                  f"{_failure_line(result)}")
        if converted is not None:
            converted.set()
        sync_tree(work / universal)  # a later resume trusts the copy by its marker alone
        atomic_write_text(work / universal / COMPLETE, marker)
        aside = checkpoint_dir / f".{universal}.old"
        publish_directory(work / universal, checkpoint_dir / universal, aside)
        fsync_dir(checkpoint_dir)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # also after a failed conversion: it can be optimizer-sized
    log.info("converted %s to a universal checkpoint for a new data-parallel size", checkpoint_dir / tag)


UNIVERSAL_POLL_S = 2.0


def _written(size: tuple[int, int]) -> str:
    return f"{size[0]} files, {size[1]} bytes written"


def _converted(written: str) -> str:
    """The heartbeat's last size line once the converter returned (syncing and publishing follow)."""
    return f"converted ({written}); syncing and publishing the copy"


def _wait_for_universal(done: Path, marker: str, failed: Path, attempt: str, alive: Path,
                        progress: Callable[[str], None]) -> Optional[str]:
    """Ranks > 0: poll until rank 0's copy carries ``marker`` (None), this attempt's failure note
    appears (its message) or rank 0's heartbeat file (``alive``) has not changed for
    UNIVERSAL_STALE_S (rank 0 died). Passes each new output size in the heartbeat to ``progress``.
    Logs every few minutes."""
    import time

    start = last_note = last_change = time.monotonic()
    last_beat, last_written = None, None
    while True:
        if _read_text(done) == marker:
            return None
        note = _read_text(failed) or ""
        if note.startswith(attempt + "\n"):
            return note.split("\n", 1)[1]
        beat = _read_text(alive)
        if beat != last_beat and (beat or "").startswith(attempt + "\n"):
            last_beat, last_change = beat, time.monotonic()
            written = beat.split("\n")[2] if beat.count("\n") >= 2 else None
            if written != last_written:
                if last_written is not None and written is not None:
                    progress(written)
                last_written = written
        elif time.monotonic() - last_change > UNIVERSAL_STALE_S:
            return (f"{done.parent}: no sign of rank 0's universal checkpoint conversion for "
                    f"{UNIVERSAL_STALE_S:.0f} s (its heartbeat {alive.name} unchanged, the copy's marker not "
                    "visible here): rank 0 killed (e.g. out of memory), or storage not coherent across nodes")
        if time.monotonic() - last_note > 300:
            last_note = time.monotonic()
            log.info("waiting for rank 0's universal checkpoint conversion (%.0f min)", (last_note - start) / 60)
        time.sleep(UNIVERSAL_POLL_S)
