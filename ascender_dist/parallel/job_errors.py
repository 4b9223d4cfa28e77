"""One error, one line per job.

Under a multi-rank launcher every rank runs the same command, so a bad config or input fails on
every rank at once, and a failure seen by one rank makes its peers fail in their next collective.
Ranks therefore agree through the job's key-value store (:func:`parallel.setup.job_store`, which
exists before the config is read) on which rank reports:

- the first rank to claim the report prints ONE line, ``error: rank R: <message>``; ranks other
  than 0 wait a moment first, so an error every rank sees is reported by rank 0;
- a peer that fails afterwards, in a collective the reporting rank left, finds the claim and exits
  quietly with the same status instead of adding a traceback;
- the reporting rank wakes peers blocked in a gloo collective (by closing its process group) and
  waits a few seconds for them, keeping the store (which rank 0 hosts) alive while they look.

A collective that times out (``parallel.distributed_timeout_minutes``) is reported the same way,
naming the collective and the ranks that never reached the timeout themselves (they did not
arrive); each live rank first writes the Python stack it waited in to its log.

Lines are written with one ``os.write`` each, so the lines of different ranks never interleave.
Without a store (single process, or a process group someone else started) the line is printed as is.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional

CLAIM = "ascender_dist/error/claim"
DONE = "ascender_dist/error/done"
TIMED_OUT = "ascender_dist/error/timed_out/"
RANK0_HEAD_START_S = 1.0
PEER_WAIT_S = 5.0
STORE_OP_TIMEOUT = timedelta(seconds=10)  # a stopped store host must not hang the report


def write_line(text: str, stream=None) -> None:
    """``text`` and its newline in a single write (atomic on a pipe up to PIPE_BUF bytes)."""
    stream = stream or sys.stderr
    data = (" ".join(text.splitlines()) + "\n").encode("utf-8", "replace")
    try:
        stream.flush()
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (pytest capture): one write call
        stream.write(data.decode("utf-8"))
        stream.flush()
        return
    os.write(fd, data)


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def multi_rank_launch() -> bool:
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return all(os.environ.get(name) for name in needed) and _rank_and_world()[1] > 1


def connect() -> None:
    """Make the job store now (before the config is read) under a multi-rank launcher."""
    if multi_rank_launch():
        from ascender_dist.parallel.setup import job_store

        job_store()


def _store():
    if not multi_rank_launch():
        return None
    from ascender_dist.parallel.setup import existing_job_store

    store = existing_job_store()
    if store is not None:
        store.set_timeout(STORE_OP_TIMEOUT)
    return store


def _claim(store, rank: int) -> bool:
    """True if this rank reports; also True when the store cannot be reached (better twice than never)."""
    if store is None:
        return True
    try:
        if rank != 0:
            deadline = time.monotonic() + RANK0_HEAD_START_S
            while time.monotonic() < deadline and not store.check([CLAIM]):
                time.sleep(0.05)
        return store.add(CLAIM, 1) == 1
    except Exception:  # noqa: BLE001 (store host gone or stopped: a line twice beats no line)
        return True


def claimed_by_another_rank() -> bool:
    """Whether another rank already reported the error that ended this job."""
    store = _store()
    if store is None:
        return False
    try:
        return store.check([CLAIM])
    except Exception:  # noqa: BLE001
        return False


def _close_gloo_group() -> None:
    """Close a gloo process group, so peers blocked in a collective with this rank fail now. In a
    thread joined for at most a few seconds: closing waits for this rank's queued work, which a
    stopped peer may never complete (the launcher stops the peers anyway)."""
    import threading

    def close():
        try:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_backend() == "gloo":
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (best effort)
            pass

    thread = threading.Thread(target=close, daemon=True)
    thread.start()
    thread.join(PEER_WAIT_S)


def _release_peers(store, world: int, wake: bool = True) -> None:
    """Wake peers blocked in a collective with us (``wake``), so they fail now and find the claim,
    then wait until every rank has looked or a few seconds passed."""
    if store is None:
        return
    if wake:
        _close_gloo_group()
    deadline = time.monotonic() + PEER_WAIT_S
    try:
        store.add(DONE, 1)
        while time.monotonic() < deadline and store.add(DONE, 0) < world:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001
        pass


def report(message: str, about_rank: Optional[int] = None) -> None:
    """Report a user error: one ``error:`` line for the whole job, naming ``about_rank`` (the rank
    a collective check found the problem on) or else the reporting rank."""
    rank, world = _rank_and_world()
    store = _store()
    if _claim(store, rank):
        named = rank if about_rank is None else about_rank
        write_line(f"error: rank {named}: {message}" if world > 1 else f"error: {message}")
    _release_peers(store, world)


def report_unexpected(exc: BaseException) -> bool:
    """A failure that is not a user error: True if it is the consequence of an error another rank
    reported (this rank then stays quiet), else this rank's traceback is printed once for the job
    and False is returned (the caller exits non-zero)."""
    rank, world = _rank_and_world()
    store = _store()
    if store is not None and claimed_by_another_rank():
        _release_peers(store, world)
        return True
    if _claim(store, rank):
        text = "".join(traceback.format_exception(exc))
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), ((f"rank {rank}: " if world > 1 else "") + text).encode("utf-8", "replace"))
    _release_peers(store, world)
    return False


# ------------------------------------------------------------------ distributed timeouts
def is_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting (gloo: "Timed out waiting 60000ms for recv operation")."""
    try:
        import torch.distributed as dist

        backend_error = isinstance(exc, dist.DistError)
    except (ImportError, AttributeError):
        backend_error = False
    text = str(exc).lower()
    return (backend_error or isinstance(exc, RuntimeError)) and ("timed out" in text or "timeout" in text) and \
        any("torch/distributed" in frame.filename.replace(os.sep, "/")
            for frame in traceback.extract_tb(exc.__traceback__))


def collective_name(exc: BaseException) -> str:
    """The torch.distributed function the rank was waiting in (innermost frame of distributed_c10d)."""
    names = [frame.name for frame in traceback.extract_tb(exc.__traceback__)
             if frame.filename.replace(os.sep, "/").endswith("torch/distributed/distributed_c10d.py")]
    public = [name for name in names if not name.startswith("_")]
    return (public or names or ["a collective"])[-1]


def _absent_ranks(store, world: int) -> Optional[list[int]]:
    if store is None:
        return None
    try:
        return [r for r in range(world) if not store.check([f"{TIMED_OUT}{r}"])]
    except Exception:  # noqa: BLE001
        return None


def _timeout_minutes(exc: BaseException) -> Optional[float]:
    match = re.search(r"(\d+)\s*ms", str(exc))
    return int(match.group(1)) / 60000 if match else None


def dump_every_thread(context: str = "") -> None:
    """``rank R: <context>every thread now (faulthandler):`` and every thread's Python stack, on stderr
    (this rank's log), for a rank that is about to end a hung job."""
    rank, _ = _rank_and_world()
    sys.stderr.write(f"rank {rank}: {context}every thread now (faulthandler):\n")
    sys.stderr.flush()
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError):  # stderr is not a real file
        pass


def report_timeout(exc: BaseException) -> None:
    """Dump the stack this rank waited in, then one line for the job naming the collective and the
    ranks that did not time out themselves (stopped, or busy elsewhere: they did not arrive)."""
    rank, world = _rank_and_world()
    store = _store()
    sys.stderr.write(f"rank {rank}: Python stack at the distributed timeout:\n")
    sys.stderr.write("".join(traceback.format_tb(exc.__traceback__)))
    dump_every_thread()
    absent = None
    if store is not None:
        try:
            store.set(f"{TIMED_OUT}{rank}", "1")
        except Exception:  # noqa: BLE001
            store = None
        time.sleep(PEER_WAIT_S)  # peers waiting in the same collective time out at about the same moment
        absent = _absent_ranks(store, world)
    minutes = _timeout_minutes(exc)
    after = f" after {minutes:g} min" if minutes else ""
    missing = (f"; rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} did not arrive"
               if absent else "")
    if _claim(store, rank):
        write_line(f"error: rank {rank}: {collective_name(exc)} timed out{after} "
                   f"(parallel.distributed_timeout_minutes){missing}")
    _release_peers(store, world, wake=False)  # live peers time out by themselves; a stopped one never wakes


def exit_now(status: int) -> None:
    """Flush and end the process without interpreter teardown, which would first wait for this
    rank's queued collectives with a missing rank (one process-group timeout each), keeping the
    job alive: the launcher stops the peers only once a rank has exited."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
