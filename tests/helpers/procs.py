"""What Linux's /proc says about a process: its children and its signal masks (tests of worker pools)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def spawned_children(pid: int) -> list[int]:
    """``pid``'s children started by multiprocessing's spawn (a pool's workers); one that exits while
    being read is left out."""
    spawned = []
    for c in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                spawned.append(c)
        except OSError:
            pass
    return spawned


def has_signal(pid: int, mask: str, signum: int) -> bool:
    """Whether ``signum`` is in process ``pid``'s ``mask`` ("SigIgn": ignored, "SigBlk": blocked)."""
    status = Path(f"/proc/{pid}/status").read_text()
    bits = int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{mask}:")), 16)
    return bool(bits >> (signum - 1) & 1)
