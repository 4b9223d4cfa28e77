"""Record the file-system calls a durability test orders: os.fsync, os.replace, shutil.rmtree."""

from __future__ import annotations

import os
import shutil


def record_syncs_renames_and_deletes(monkeypatch) -> list:
    """Record, in order, every os.fsync (as the path its descriptor names), os.replace and
    shutil.rmtree until the monkeypatch is undone: ("fsync", path), ("replace", src, dst),
    ("rmtree", path), every path resolved."""
    events: list = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", os.path.realpath(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return events
