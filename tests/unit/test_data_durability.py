"""What the data pipeline writes survives a power loss in the order it is committed: a file's bytes
are fsynced before the rename (or job mark) that makes it count, and the directory after the
rename. Without it a manifest, job mark or shard name could persist while the data it vouches for
did not (a merge accepts a part by its size alone: unsynced, it reads back as token 0).

``os.fsync`` and ``os.replace`` are recorded here by inode, which a rename keeps, so the test
follows a file from its temporary name to its final one."""

from __future__ import annotations

import os
from concurrent.futures import Executor, Future
from pathlib import Path

import pytest

from data_pipeline import _io
from data_pipeline.errors import DataError
from data_pipeline.parallel import PARTS_DIR, merge, run_job, shard_settings
from data_pipeline.shards import MANIFEST_NAME, write_shards

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401


class Events:
    """``("fsync", inode, path)`` and ``("replace", inode, src, dst)`` in the order they happened."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            self.log.append(("fsync", os.fstat(fd).st_ino, os.readlink(f"/proc/self/fd/{fd}")))
            return real_fsync(fd)

        def replace(src, dst, *a, **kw):
            self.log.append(("replace", os.stat(src).st_ino, str(src), str(dst)))
            return real_replace(src, dst, *a, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def renames_into(self, directory: Path, suffix: str) -> list[int]:
        """Positions of the renames that put a ``*suffix`` file into ``directory``."""
        return [i for i, e in enumerate(self.log) if e[0] == "replace" and Path(e[3]).parent == directory
                and e[3].endswith(suffix)]

    def synced_before(self, inode: int, pos: int) -> bool:
        return any(e[0] == "fsync" and e[1] == inode for e in self.log[:pos])

    def dir_synced_between(self, directory: Path, lo: int, hi: int) -> bool:
        ino = directory.stat().st_ino
        return any(e[0] == "fsync" and e[1] == ino for e in self.log[lo + 1:hi])


def assert_committed_in_order(ev: Events, directory: Path, suffix: str, commit: int) -> None:
    """Every ``*suffix`` file renamed into ``directory`` was fsynced before its rename, and
    ``directory`` after the last of them and before the rename at log position ``commit``."""
    moves = ev.renames_into(directory, suffix)
    assert moves, (directory, suffix, ev.log)
    for i in moves:
        assert ev.synced_before(ev.log[i][1], i), f"{ev.log[i][3]} renamed into place before its bytes were fsynced"
    assert ev.dir_synced_between(directory, moves[-1], commit), f"{directory} not fsynced before the commit"


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    ev = Events(monkeypatch)
    target = tmp_path / "sub" / "manifest.json"
    _io.atomic_write_bytes(target, b"{}\n")
    assert target.read_bytes() == b"{}\n"
    (move,) = ev.renames_into(target.parent, "manifest.json")
    assert ev.synced_before(ev.log[move][1], move)
    assert ev.dir_synced_between(target.parent, move, len(ev.log))


def test_a_failing_fsync_is_a_one_line_error_and_leaves_no_temporary(tmp_path, monkeypatch):
    def fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DataError) as e:
        _io.atomic_write_bytes(tmp_path / "x.json", b"{}")
    assert str(e.value) == f"{tmp_path / 'x.json'}: cannot write (Input/output error)"
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_be_synced_is_no_error(tmp_path, monkeypatch):
    """Some file systems refuse fsync on a directory (EINVAL): nothing to make durable there."""
    real = os.fsync

    def fsync(fd):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_dir():
            raise OSError(22, "Invalid argument")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _io.atomic_write_bytes(tmp_path / "x.json", b"{}")
    assert (tmp_path / "x.json").read_bytes() == b"{}"


def test_shards_are_fsynced_before_the_manifest_names_them(tmp_path, monkeypatch, tiny_tokenizer, text_file):
    ev = Events(monkeypatch)
    out = tmp_path / "ds"
    write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=20, val_fraction=0.2, progress=False)
    (manifest,) = ev.renames_into(out, MANIFEST_NAME)
    assert len(ev.renames_into(out, ".tar")) >= 3
    assert_committed_in_order(ev, out, ".tar", manifest)
    assert ev.synced_before(ev.log[manifest][1], manifest)
    assert ev.dir_synced_between(out, manifest, len(ev.log))


class InlinePool(Executor):
    """Runs each task in this process (so the recorders see the workers' writes)."""

    def submit(self, fn, *args, **kwargs):
        fut = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to the caller through the future, as a pool would
            fut.set_exception(e)
        return fut


def test_part_files_are_fsynced_before_the_job_mark_and_shards_before_the_manifest(tmp_path, monkeypatch,
                                                                                   tiny_tokenizer, text_file):
    ev = Events(monkeypatch)
    out = tmp_path / "ds"
    parts = out / PARTS_DIR
    mark = run_job([text_file], tiny_tokenizer, parts, shard_settings(16, 20, None, 0.2, "shard"), workers=3,
                   pool=InlinePool())
    (mark_move,) = ev.renames_into(parts, mark.name)
    assert len(ev.renames_into(parts, ".bin")) == 3
    assert_committed_in_order(ev, parts, ".bin", mark_move)  # a mark never vouches for unsynced tokens
    assert ev.synced_before(ev.log[mark_move][1], mark_move)
    ev.log.clear()
    merge(out, pool=InlinePool(), keep_parts=True)
    (manifest,) = ev.renames_into(out, MANIFEST_NAME)
    assert_committed_in_order(ev, out, ".tar", manifest)
