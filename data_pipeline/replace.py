"""Replacing a dataset in its own directory so that a crash at any moment leaves one whole dataset.

A re-shard into a directory that holds a dataset gives the new shards the old ones' names. Before
the first new shard moves in, the old manifest and the shards it lists are moved aside, by rename,
into ``.previous-dataset/`` (built as ``.previous-dataset.tmp/``, renamed when complete); after the
new manifest is saved it is deleted. A process killed in between (SIGKILL, OOM, power loss: the
signals a writer can hold back, it does) leaves the old dataset whole in one of those folders, and
the next write into the directory puts it back first (:func:`restore_cut_short`); the loader's
"manifest not found" says where it is (:func:`cut_short_hint`).

Every step is a rename within one file system, made durable (fsync of the directories) before the
next, so no step copies data and the old dataset is never in two half-states at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ._io import fsync_dir
from .errors import DataError

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"  # a directory holding it is a dataset (data_pipeline.shards re-exports it)

PREVIOUS = ".previous-dataset"  # the old dataset while the new one moves in
_BUILDING = PREVIOUS + ".tmp"  # the old dataset while it moves aside


def _listed(manifest: Path) -> list[str] | None:
    """The shard names a manifest lists (plain names in its own directory), or None when it cannot be
    read as one: then there is no dataset to keep, only a file to replace."""
    try:
        shards = json.loads(manifest.read_text(encoding="utf-8"))["shards"]
        names = [s["name"] for s in shards]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [n for n in names if isinstance(n, str) and n and Path(n).name == n]


def _move_back(aside: Path, out_dir: Path) -> None:
    """Every entry of ``aside`` (a folder in ``out_dir``) renamed into ``out_dir``, replacing what has
    its name there, the manifest last (after the shards' renames are synced: a restore cut short
    must not leave the old manifest over the cut-short build's shards of the same names), then
    ``aside`` removed; synced."""
    entries = sorted(aside.iterdir(), key=lambda entry: entry.name == MANIFEST_NAME)
    for entry in entries:
        if entry.name == MANIFEST_NAME:
            fsync_dir(out_dir)
        os.replace(entry, out_dir / entry.name)
    aside.rmdir()
    fsync_dir(out_dir)


def restore_cut_short(out_dir: Path) -> bool:
    """Undo what a write into ``out_dir`` that was killed midway left: the old dataset moved back
    when ``out_dir`` has no manifest (the new one never got one), else the leftover deleted (the new
    dataset was complete). Returns whether an old dataset was put back."""
    out_dir = Path(out_dir)
    restored = False
    try:
        for name in (_BUILDING, PREVIOUS):
            aside = out_dir / name
            if not aside.is_dir():
                continue
            if (out_dir / MANIFEST_NAME).exists():
                shutil.rmtree(aside)
                continue
            _move_back(aside, out_dir)
            restored = True
            log.warning("%s: put back the dataset a cut-short re-shard had moved aside into %s", out_dir, name)
    except OSError as e:
        raise DataError(str(out_dir), f"cannot put back the dataset a cut-short re-shard left in {PREVIOUS} "
                                      f"({e.strerror or e}); move its files back by hand") from None
    return restored


def set_aside_old(out_dir: Path, own=lambda name: True) -> None:
    """Move ``out_dir``'s manifest, then the shards it lists whose name ``own`` claims (the new
    build's naming: those are replaced; shards of another ``--prefix`` stay where they are), into
    ``.previous-dataset/`` (complete before it has that name). A manifest that cannot be read names
    no dataset: it is removed. After this ``out_dir`` holds no manifest, so no crash can leave the old
    manifest naming new shards."""
    out_dir = Path(out_dir)
    manifest = out_dir / MANIFEST_NAME
    try:
        if not manifest.exists():
            return
        names = _listed(manifest)
        if names is None:
            manifest.unlink()
            fsync_dir(out_dir)
            return
        building = out_dir / _BUILDING
        building.mkdir()
        os.replace(manifest, building / MANIFEST_NAME)  # first: out_dir never lists missing shards
        kept = [name for name in names if not own(name) and (out_dir / name).is_file()]
        if kept:
            log.warning("%s: left %d shard(s) of the old manifest written under another prefix (%s ...): the new "
                        "manifest does not list them", out_dir, len(kept), kept[0])
        for name in names:
            if own(name) and (out_dir / name).is_file():
                os.replace(out_dir / name, building / name)
        fsync_dir(building)
        fsync_dir(out_dir)
        os.replace(building, out_dir / PREVIOUS)
        fsync_dir(out_dir)
    except OSError as e:
        raise DataError(str(out_dir), f"cannot move the old dataset aside before replacing it ({e.strerror or e}); "
                                      "run the build again to put it back") from None


def drop_previous(out_dir: Path) -> None:
    """Delete the old dataset once the new manifest is saved."""
    shutil.rmtree(Path(out_dir) / PREVIOUS, ignore_errors=True)


def cut_short_hint(manifest_path: Path) -> str:
    """For a missing manifest: where a cut-short re-shard left the old dataset, or ""."""
    folder = Path(manifest_path).parent
    for name in (PREVIOUS, _BUILDING):
        if (folder / name / MANIFEST_NAME).is_file():
            return (f" (a re-shard into this directory was cut short: the previous dataset is in {folder / name}; "
                    "run the build again, or move its files back)")
    return ""
