"""Temporary directories of the shard writers: a run killed outright (no ``finally``) leaves one,
possibly holding a dataset's worth of shards; the next run on the same machine removes it, and
never one a live process or another machine may be writing."""

from __future__ import annotations

import os
import subprocess

from data_pipeline import _io
from data_pipeline.shards import write_shards

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401  (fixtures)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_directories_of_dead_processes_on_this_machine_are_removed(tmp_path):
    tag = _io._machine_tag()
    dead = tmp_path / f".shards-tmp-{tag}-{_dead_pid()}-abc"
    live = tmp_path / f".shards-tmp-{tag}-{os.getpid()}-abc"
    other_machine = tmp_path / f".shards-tmp-node-b_4026531836-{_dead_pid()}-abc"
    other_kind = tmp_path / f".parts-tmp-{tag}-{_dead_pid()}-abc"
    for d in (dead, live, other_machine, other_kind):
        d.mkdir()
        (d / "000000.tar").write_bytes(b"x" * 1000)
    new = _io.run_temp_dir(tmp_path, "shards")
    assert not dead.exists()
    assert live.exists() and other_machine.exists() and other_kind.exists()
    assert new.is_dir() and new.name.startswith(f".shards-tmp-{tag}-{os.getpid()}-")


def test_the_next_run_removes_what_a_killed_one_left(tmp_path, tiny_tokenizer, text_file):  # noqa: F811
    out = tmp_path / "data"
    out.mkdir()
    left = out / f".shards-tmp-{_io._machine_tag()}-{_dead_pid()}-q1w2"  # as a SIGKILLed writer leaves it
    left.mkdir()
    (left / "000000.tar").write_bytes(b"partial")
    manifest = write_shards([text_file], tiny_tokenizer, out, seq_length=32, samples_per_shard=8, progress=False)
    assert not left.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", *(s.name for s in manifest.shards)])
