"""Crash windows of ``training/checkpoint.py``, one at a time, with a stand-in for DeepSpeed's
engine (it writes one file per save, like a real shard): a crash at any moment leaves ``latest``
naming a complete, loadable checkpoint, also when a save replaces a complete checkpoint of the
same step (a second run into the same directory). The random-SIGKILL test through the real
launcher (tests/integration/test_fault_tolerance.py) covers DeepSpeed's own files."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.rollback import RollbackPolicy
from tests.helpers.fs_events import record_syncs_renames_and_deletes
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)


class Crash(Exception):
    pass


class FakeEngine:
    """save_checkpoint writes ``<dir>/<tag>/weights.txt``; load_checkpoint reads it back."""

    def __init__(self, value: str, crash_in_save: bool = False):
        self.value, self.crash_in_save, self.loaded = value, crash_in_save, None

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "weights.txt").write_text(self.value)
        if self.crash_in_save:
            raise Crash("killed while DeepSpeed writes")

    def load_checkpoint(self, load_dir, tag):
        self.loaded = (Path(load_dir) / tag / "weights.txt").read_text()
        return str(Path(load_dir) / tag), {"step": 1}


def _save(directory: Path, step: int, value: str, **engine_kwargs) -> str:
    return ckpt.save_checkpoint(FakeEngine(value, **engine_kwargs), directory, step, client_state={}, keep_last=3,
                                extra_files={"meta.json": '{"step": %d}' % step})


def _load(directory: Path) -> str:
    engine = FakeEngine("")
    ckpt.load_checkpoint(engine, directory)
    return engine.loaded


def test_crash_while_writing_keeps_the_complete_checkpoint_of_the_same_step(single_rank_group, tmp_path):
    _save(tmp_path, 1, "first run")
    with pytest.raises(Crash):
        _save(tmp_path, 1, "second run", crash_in_save=True)
    assert ckpt.latest_tag(tmp_path) == "step_00000001"
    assert _load(tmp_path) == "first run"
    _save(tmp_path, 1, "second run")  # the next save cleans the staging directory up and replaces it
    assert _load(tmp_path) == "second run"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000001"]


def save_killed_between_the_renames(monkeypatch, directory: Path, step: int, text: str) -> list[tuple[str, str]]:
    """Save ``step`` again over a complete ``step_N`` and die between its two directory renames
    (1: step_N -> step_N.replaced, 2: step_N.partial -> step_N); returns the renames (src, dst) begun."""
    real_replace, calls = os.replace, []

    def replace_then_die(src, dst):
        if Path(src).is_dir():  # (files are replaced too: atomic_write_text)
            calls.append((Path(src).name, Path(dst).name))
            if len(calls) == 2:
                raise Crash("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace_then_die)
    with pytest.raises(Crash):
        _save(directory, step, text)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    return calls


def test_crash_between_the_two_renames_reads_the_copy_moved_aside(single_rank_group, tmp_path, monkeypatch):
    _save(tmp_path, 1, "first run")
    calls = save_killed_between_the_renames(monkeypatch, tmp_path, 1, "second run")
    assert calls[0] == ("step_00000001", "step_00000001.replaced")
    assert not (tmp_path / "step_00000001").exists()
    assert ckpt.latest_tag(tmp_path) == "step_00000001.replaced"
    assert _load(tmp_path) == "first run"
    _save(tmp_path, 2, "resumed")  # pruning puts the moved-aside step back under its own name
    assert (tmp_path / "step_00000001" / "weights.txt").read_text() == "first run"
    assert not (tmp_path / "step_00000001.replaced").exists()
    assert _load(tmp_path) == "resumed"


def test_crash_after_publishing_before_latest_moves(single_rank_group, tmp_path, monkeypatch):
    _save(tmp_path, 1, "one")
    real_write = ckpt.atomic_write_text

    def write_but_not_latest(path, text):
        if Path(path).name == ckpt.LATEST:
            raise Crash("killed before latest moved")
        real_write(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", write_but_not_latest)
    with pytest.raises(Crash):
        _save(tmp_path, 2, "two")
    monkeypatch.setattr(ckpt, "atomic_write_text", real_write)
    assert ckpt.latest_tag(tmp_path) == "step_00000001"
    assert _load(tmp_path) == "one"
    assert (tmp_path / "step_00000002" / ckpt.COMPLETE).is_file()  # complete, just not named yet


def test_missing_latest_next_to_complete_checkpoints_is_refused(single_rank_group, tmp_path):
    _save(tmp_path, 1, "one")
    _save(tmp_path, 2, "two")
    (tmp_path / ckpt.LATEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"latest: missing, but the directory holds complete checkpoints "
                                                     r"\(newest step_00000002\)"):
        ckpt.latest_tag(tmp_path)
    assert ckpt.latest_tag(tmp_path / "fresh") is None  # no checkpoint at all: a fresh start


def test_an_unreadable_latest_is_one_line_naming_the_newest_complete_checkpoint(single_rank_group, tmp_path):
    _save(tmp_path, 1, "one")
    (tmp_path / ckpt.LATEST).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ckpt.CheckpointError, match=r"latest: unreadable \(UnicodeDecodeError.*\); newest complete "
                                                     r"checkpoint: step_00000001$"):
        ckpt.latest_tag(tmp_path)


@pytest.mark.parametrize("content, message", [
    (None, "meta.json: missing"),
    ('{"step": ', "meta.json: unreadable (JSONDecodeError"),
    ("[1, 2]", "meta.json: expected a JSON object, got list"),
    (b"\xff\xfe\x00", "meta.json: unreadable (UnicodeDecodeError"),
])
def test_bad_meta_json_is_one_line(tmp_path, content, message):
    tag = tmp_path / "step_00000001"
    tag.mkdir()
    if isinstance(content, bytes):
        (tag / "meta.json").write_bytes(content)
    elif content is not None:
        (tag / "meta.json").write_text(content)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_meta(tmp_path, "step_00000001")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unreadable_shard_names_the_tag_and_rank(single_rank_group, tmp_path):
    _save(tmp_path, 1, "one")

    class Truncated(FakeEngine):
        def load_checkpoint(self, load_dir, tag):
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory\n"
                               "  more detail")

    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(Truncated(""), tmp_path)
    assert str(info.value) == (f"{tmp_path / 'step_00000001'}: unreadable on rank 0 (RuntimeError: "
                               f"PytorchStreamReader failed reading zip archive: failed finding central directory)")


def test_checkpoint_dir_that_is_a_file_stops_the_run_at_start(tmp_path):
    ckpt.prepare_checkpoint_dir(tmp_path / "new" / "checkpoints")  # created, parents included
    assert (tmp_path / "new" / "checkpoints").is_dir()
    (tmp_path / "file").write_text("not a directory")
    for path, message in ((tmp_path / "file", "checkpoint directory is an existing file"),
                          (tmp_path / "file" / "below", "cannot create the checkpoint directory")):
        with pytest.raises(ckpt.CheckpointError) as info:
            ckpt.prepare_checkpoint_dir(path)
        assert str(info.value).startswith(f"{path}: {message}")


def test_save_records_every_file_size_and_sha256_in_meta(single_rank_group, tmp_path, monkeypatch):
    import hashlib
    import json

    monkeypatch.setattr(ckpt, "_layouts", lambda: [(0, 0)])  # megatron's groups: whether another test set them up
    _save(tmp_path, 1, "one")
    tag_dir = tmp_path / "step_00000001"
    files = json.loads((tag_dir / "meta.json").read_text())["files"]
    assert sorted(files) == ["rng/positions.json", "rng/rank_00000.pt", "weights.txt"]
    for name, record in files.items():
        data = (tag_dir / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ckpt.verify_files(tmp_path, "step_00000001")  # intact: no error


@pytest.mark.parametrize("damage, what", [
    (lambda f: f.write_bytes(f.read_bytes()[:-3]), r"truncated \(6 of 9 bytes\)"),
    (lambda f: f.write_bytes(b"X" + f.read_bytes()[1:]), r"checksum mismatch, sha256 differs from the saved one"),
    (lambda f: f.unlink(), r"missing"),
])
def test_a_damaged_file_is_named_before_anything_is_loaded(single_rank_group, tmp_path, damage, what):
    _save(tmp_path, 1, "123456789")
    damage(tmp_path / "step_00000001" / "weights.txt")
    engine = FakeEngine("")
    with pytest.raises(ckpt.CheckpointError, match=rf"^{tmp_path / 'step_00000001' / 'weights.txt'}: {what} "
                                                   r"\(rank 0's file, checked before anything was loaded\)$") as info:
        ckpt.load_checkpoint(engine, tmp_path)
    assert engine.loaded is None and info.value.rank == 0 and "\n" not in str(info.value)


class FullDisk(FakeEngine):
    """The writer fails part-way like torch.save on a full disk (a partial file is left behind)."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import errno

        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "weights.txt").write_text(self.value[:2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_save_is_one_line_removes_its_partial_directory_and_keeps_latest(single_rank_group, tmp_path):
    _save(tmp_path, 1, "one")
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(FullDisk("two"), tmp_path, 2, client_state={}, keep_last=3,
                             extra_files={"meta.json": "{}"})
    message = str(info.value)
    assert message.startswith(f"{tmp_path}: saving step_00000002 failed on rank 0: no space left on device "
                              f"(OSError: [Errno 28] No space left on device); ")
    assert " free there; removed step_00000002.partial, latest still names step_00000001" in message
    assert re.search(r"; \d+\.\d (GiB|MiB) free there", message) and "\n" not in message
    assert not (tmp_path / "step_00000002.partial").exists() and not (tmp_path / "step_00000002").exists()
    assert ckpt.latest_tag(tmp_path) == "step_00000001" and _load(tmp_path) == "one"


def test_each_file_is_checked_by_the_rank_that_reads_it():
    names = sorted(["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "rng/rank_00000.pt",
                    "rng/rank_00003.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
                    "zero_pp_rank_1_mp_rank_00_optim_states.pt", "layer_01-model_00-model_states.pt"])
    layouts = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (dp rank, mp rank) of ranks 0..3: tp 2 x dp 2
    owners = ckpt.reader_ranks(names, 4, layouts)
    assert owners["rng/rank_00003.pt"] == 3 and owners["rng/rank_00000.pt"] == 0
    assert owners["zero_pp_rank_1_mp_rank_00_optim_states.pt"] == 2
    assert owners["zero_pp_rank_0_mp_rank_01_optim_states.pt"] == 1
    assert owners["mp_rank_01_model_states.pt"] == 1 and owners["mp_rank_00_model_states.pt"] == 0
    assert owners["layer_01-model_00-model_states.pt"] == names.index("layer_01-model_00-model_states.pt") % 4


def test_a_crash_while_pruning_leaves_no_complete_looking_tag_with_files_missing(single_rank_group, tmp_path,
                                                                                 monkeypatch):
    for step in (1, 2, 3):
        _save(tmp_path, step, f"v{step}")
    real_rmtree = ckpt.shutil.rmtree

    def delete_one_file_then_die(path, ignore_errors=False):
        if Path(path).name.startswith("step_00000001"):  # pruned by the save of step 4 (keep_last=3)
            (Path(path) / "weights.txt").unlink()
            raise Crash("killed while deleting")
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ckpt.shutil, "rmtree", delete_one_file_then_die)
    with pytest.raises(Crash):
        _save(tmp_path, 4, "v4")
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    # the half-deleted tag is no longer a checkpoint a rollback could pick
    assert ckpt.complete_tags(tmp_path) == ["step_00000002", "step_00000003", "step_00000004"]
    assert ckpt.latest_tag(tmp_path) == "step_00000004"
    _save(tmp_path, 5, "v5")  # the next save removes the leftover
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000003", "step_00000004",
                                                                        "step_00000005"]


def test_what_crashed_saves_left_is_removed_before_the_next_save_writes(single_rank_group, tmp_path):
    """A disk sized for keep_last checkpoints and one being written: the staging and half-deleted
    directories of crashed saves (optimizer-sized) go before DeepSpeed writes, not only in the prune
    after it; complete checkpoints and a moved-aside copy that may be the only complete one stay."""
    _save(tmp_path, 1, "v1")
    os.replace(tmp_path / "step_00000001", tmp_path / "step_00000001.replaced")  # a crash mid-swap: the only copy
    leftovers = ["step_00000002.partial", "step_00000001-universal.deleting", "step_00000000.deleting"]
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "optimizer.pt").write_text("x" * 100)
    (tmp_path / ".step_00000001-universal.tmp").mkdir()
    # the small files a crash leaves: atomic writes' temporaries, a shared-storage probe (a review found
    # them never removed)
    for name in (".latest.tmp.4242", "..step_00000001-universal.alive.tmp.4243", ".shared-check-00ff"):
        (tmp_path / name).write_text("x")
    seen_at_write = []

    class Watching(FakeEngine):
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            seen_at_write.extend(sorted(p.name for p in Path(save_dir).iterdir()))
            super().save_checkpoint(save_dir, tag, client_state, save_latest)

    ckpt.save_checkpoint(Watching("v3"), tmp_path, 3, client_state={}, keep_last=3)
    assert seen_at_write == ["latest", "step_00000001.replaced", "step_00000003.partial"]
    assert _load(tmp_path) == "v3" and ckpt.complete_tags(tmp_path) == ["step_00000001", "step_00000003"]


def test_a_leftover_that_cannot_be_removed_is_a_warning_not_a_failed_save(single_rank_group, tmp_path,
                                                                            monkeypatch, caplog):
    """A stale handle on shared storage (or another user's file) kept every save failing: the prune
    after a save already only warned about the same error."""
    _save(tmp_path, 1, "v1")
    (tmp_path / ".step_00000001-universal.alive").write_text("x")  # a conversion's heartbeat left behind
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.endswith(".alive"):
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with caplog.at_level("WARNING"):
        _save(tmp_path, 2, "v2")
    assert _load(tmp_path) == "v2" and ckpt.complete_tags(tmp_path) == ["step_00000001", "step_00000002"]
    assert "could not remove what a crashed save left" in caplog.text and "Stale file handle" in caplog.text


def test_universal_copies_go_with_their_source_tag(single_rank_group, tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, f"v{step}")
    for step in (1, 3):
        copy = tmp_path / f"{ckpt.tag_for_step(step)}{ckpt.UNIVERSAL}"
        copy.mkdir()
        (copy / ckpt.COMPLETE).write_text("universal\n")
    _save(tmp_path, 4, "v4")  # keep_last=3: step 1 goes, and its universal copy with it
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step_00000002", "step_00000003", "step_00000003-universal", "step_00000004"]


def test_the_next_save_removes_what_an_interrupted_universal_conversion_left(single_rank_group, tmp_path):
    _save(tmp_path, 1, "v1")
    for name in (".step_00000001-universal.tmp", ".step_00000001-universal.old"):
        (tmp_path / name / "sub").mkdir(parents=True)
    (tmp_path / ".step_00000001-universal.failed").write_text("abc\nconversion failed")
    (tmp_path / ".step_00000001-universal.alive").write_text("abc\n7")  # heartbeat of a killed rank 0
    _save(tmp_path, 2, "v2")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".step")) == []


def test_a_universal_copy_is_made_again_when_its_source_was_saved_again(single_rank_group, tmp_path, monkeypatch):
    import subprocess

    conversions = []

    def fake_ds_to_universal(cmd, **kwargs):
        out = Path(cmd[cmd.index("--output_folder") + 1])
        out.mkdir(parents=True)
        (out / "weights.txt").write_text(f"converted {len(conversions)}")
        conversions.append(out.name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_ds_to_universal)
    _save(tmp_path, 1, "first")
    assert ckpt.ensure_universal(tmp_path, "step_00000001") == "step_00000001-universal"
    assert ckpt.ensure_universal(tmp_path, "step_00000001") == "step_00000001-universal"
    assert len(conversions) == 1  # the copy of the same save is reused
    _save(tmp_path, 1, "saved again")  # e.g. the same step after a rollback: a new meta.json
    ckpt.ensure_universal(tmp_path, "step_00000001")
    assert len(conversions) == 2
    assert (tmp_path / "step_00000001-universal" / "weights.txt").read_text() == "converted 1"


def test_any_error_from_the_engine_load_is_one_line(single_rank_group, tmp_path):
    class ZeRORuntimeException(Exception):  # DeepSpeed's, which derives from Exception only
        pass

    class RefusingEngine(FakeEngine):
        def load_checkpoint(self, load_dir, tag):
            raise ZeRORuntimeException("The checkpoint being loaded used a DP world size of 1 but\nthe current ...")

    _save(tmp_path, 1, "v1")
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000001: unreadable on rank 0 \(ZeRORuntimeException: "
                                                   r"The checkpoint being loaded used a DP world size of 1 but\)$"):
        ckpt.load_checkpoint(RefusingEngine(""), tmp_path)


def test_rng_source_rank_follows_the_position_not_the_global_rank():
    # saved at PP2 x DP2 (global rank = dp + 2 pp): positions (dp rank, mp rank)
    saved = [[0, 0], [1, 0], [0, 1], [1, 1]]
    # resumed at PP2 x DP1: global rank 1 is stage 1 now and must go on with a stage-1 stream
    assert ckpt.rng_source_rank(saved, (0, 1), rank=1) == 2
    assert ckpt.rng_source_rank(saved, (0, 0), rank=0) == 0
    # resumed at PP1 x DP2 from DP1: the new replica continues dp rank 0's (replicas hold equal states)
    assert ckpt.rng_source_rank([[0, 0]], (1, 0), rank=1) == 0
    assert ckpt.rng_source_rank(saved, (0, 5), rank=0) is None  # no saved rank at that position
    assert ckpt.rng_source_rank(None, (1, 0), rank=3) == 3  # a checkpoint without positions.json


def test_load_reads_the_rng_state_of_the_rank_at_the_same_position(single_rank_group, tmp_path, monkeypatch):
    import json

    import torch

    rng_dir = tmp_path / "rng"
    rng_dir.mkdir()
    states = {}
    for rank in range(4):
        torch.manual_seed(100 + rank)
        states[rank] = ckpt._rng_state()
        torch.save(states[rank], rng_dir / f"rank_{rank:05d}.pt")
    (rng_dir / ckpt.RNG_POSITIONS).write_text(json.dumps([[0, 0], [1, 0], [0, 1], [1, 1]]))
    monkeypatch.setattr(ckpt, "_position", lambda: (0, 1))  # this (global rank 0) process: stage 1
    torch.manual_seed(0)
    ckpt._load_rng(rng_dir, {})
    assert torch.equal(torch.get_rng_state(), states[2]["torch"])
    # a checkpoint saved before positions.json: the positions follow from the layout meta.json records
    (rng_dir / ckpt.RNG_POSITIONS).unlink()
    torch.manual_seed(0)
    ckpt._load_rng(rng_dir, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                             "data_parallel_size": 2})
    assert torch.equal(torch.get_rng_state(), states[2]["torch"])


def test_positions_from_sizes_follow_megatrons_rank_order():
    # tp fastest, then dp, then pp: rank = t + T d + T D p; mp rank = t + T p
    assert ckpt.positions_from_sizes(1, 2, 2) == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert ckpt.positions_from_sizes(2, 1, 2) == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert ckpt.positions_from_sizes(2, 2, 1) == [[0, 0], [0, 1], [0, 2], [0, 3]]


def test_a_save_records_every_ranks_position_for_the_rng_files(single_rank_group, tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(ckpt, "_layouts", lambda: [(0, 0)])
    tag = _save(tmp_path, 1, "weights")
    assert json.loads((tmp_path / tag / "rng" / ckpt.RNG_POSITIONS).read_text()) == [[0, 0]]
    assert "rng/positions.json" in ckpt.read_meta(tmp_path, tag)["files"]  # checked before a load like the rest


# ----------------------------------------------------------------------------- found in review: retention, pruning, conversion
def test_retention_after_a_rollback_counts_only_the_checkpoints_of_the_current_line(single_rank_group, tmp_path):
    """keep_last=2; a rollback to 200 saves 200 again, then 250 is saved: 300 (the abandoned run's,
    never a rollback target) must not take a place that 200, the next rollback's target, needs."""
    def save(step):
        return ckpt.save_checkpoint(FakeEngine(f"v{step}"), tmp_path, step, client_state={}, keep_last=2,
                                    extra_files={"meta.json": '{"step": %d}' % step})

    for step in (100, 200, 300, 200, 250):
        save(step)
    assert ckpt.complete_tags(tmp_path) == ["step_00000200", "step_00000250"]
    assert ckpt.latest_tag(tmp_path) == "step_00000250"


def test_a_half_deleted_moved_aside_copy_is_never_renamed_back(tmp_path, monkeypatch):
    """A crash inside the delete of step_1.replaced (its step_1 still there) left it with COMPLETE and
    little else; a later pass that prunes step_1 must delete it, not rename it back as step_1,
    whatever order the directory lists them in."""
    full = ["COMPLETE", "meta.json", "weights.txt"]
    for name, files in (("step_00000001", full), ("step_00000001.replaced", ["COMPLETE"]),
                        ("step_00000003", full), ("step_00000004", full)):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("x")
    (tmp_path / ckpt.LATEST).write_text("step_00000004")
    real_iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(real_iterdir(self), key=lambda p: p.name)))
    ckpt._prune(tmp_path, 1, "step_00000004")
    monkeypatch.undo()
    assert ckpt.complete_tags(tmp_path) == ["step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000004"]


def test_a_pruning_error_after_latest_moved_is_a_warning_not_a_failed_save(single_rank_group, tmp_path, monkeypatch,
                                                                             caplog):
    import errno
    import logging

    _save(tmp_path, 1, "v1")

    def busy(*args):
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(tmp_path / "step_00000001.deleting"))

    monkeypatch.setattr(ckpt, "_prune", busy)
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert _save(tmp_path, 2, "v2") == "step_00000002"
    assert ckpt.latest_tag(tmp_path) == "step_00000002" and _load(tmp_path) == "v2"
    assert any("step_00000002 is saved, but pruning older checkpoints failed" in r.getMessage() for r in caplog.records)


def test_a_conversion_child_ignores_the_signals_the_rank_watches(monkeypatch):
    """The launcher's SIGTERM and a scheduler's SIGUSR1 reach every process of the job: the rank
    records them (it saves and stops after its next step), the conversion it waits for goes on."""
    import signal

    from ascender_dist.training.preemption import unwatch_signals, watch_signals

    unshielded = ckpt.run_shielded("tests.helpers.signal_self", [])
    assert unshielded.returncode == -signal.SIGUSR1 and ckpt._failure_line(unshielded) == "killed by SIGUSR1"
    watch_signals(["SIGTERM", "SIGUSR1"])
    try:
        shielded = ckpt.run_shielded("tests.helpers.signal_self", [])
    finally:
        unwatch_signals()
    assert shielded.returncode == 0 and shielded.stdout.strip() == "survived", shielded


def test_a_universal_copy_is_synced_before_its_marker(single_rank_group, tmp_path, monkeypatch):
    """Later resumes trust a universal copy by its COMPLETE marker alone: its files reach stable
    storage first."""
    import subprocess

    def fake_ds_to_universal(cmd, **kwargs):
        out = Path(cmd[cmd.index("--output_folder") + 1])
        out.mkdir(parents=True)
        (out / "weights.txt").write_text("converted")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    synced = []
    monkeypatch.setattr(subprocess, "run", fake_ds_to_universal)
    monkeypatch.setattr(ckpt, "sync_tree", lambda d: synced.append((d.name, (d / ckpt.COMPLETE).exists(),
                                                                      (d / "weights.txt").exists())))
    _save(tmp_path, 1, "first")
    ckpt.ensure_universal(tmp_path, "step_00000001")
    assert synced == [("step_00000001-universal", False, True)]


class _Payload:
    """Pickles to a call of os.system: what a planted rank_*.pt would run when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_an_rng_file_is_read_as_tensors_only_never_unpickled_code(single_rank_group, tmp_path):
    """The RNG states are tensors: read with weights_only, a planted pickle in a (group-writable)
    checkpoint no longer runs its code on resume."""
    import torch

    _save(tmp_path, 1, "v1")
    assert _load(tmp_path) == "v1"  # the saved RNG state reads back as tensors
    rng_file = tmp_path / "step_00000001" / "rng" / "rank_00000.pt"
    torch.save({"torch": _Payload(tmp_path / "PWNED")}, rng_file)
    with pytest.raises(ckpt.CheckpointError, match="rank_00000.pt: unreadable"):
        ckpt._load_rng(rng_file.parent, {"step": 1})
    assert not (tmp_path / "PWNED").exists()


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    """latest / COMPLETE / meta.json go through '.<name>.tmp.<pid>': in a group-writable checkpoint
    directory another user's symlink at that name made the write land in its target (~/.bashrc)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run = tmp_path / "ck"
    run.mkdir()
    (run / f".latest.tmp.{os.getpid()}").symlink_to(victim)
    ckpt.atomic_write_text(run / "latest", "step_00000100")
    assert victim.read_text() == "mine"
    assert (run / "latest").read_text() == "step_00000100" and not (run / "latest").is_symlink()
    assert sorted(p.name for p in run.iterdir()) == ["latest"]


# ----------------------------------------------------------------------------- found by a mutation audit
def test_files_of_a_rank_beyond_the_world_still_get_one_reader():
    """A resume at a smaller world (4 saving ranks, 2 now): rng/rank_00003.pt names a rank that does
    not exist; its check goes round-robin to a rank that does, or no rank would verify it."""
    names = [f"rng/rank_{rank:05d}.pt" for rank in range(4)]
    owners = ckpt.reader_ranks(names, 2, None)
    assert set(owners) == set(names) and all(owner in range(2) for owner in owners.values())
    assert owners["rng/rank_00000.pt"] == 0 and owners["rng/rank_00001.pt"] == 1
    assert owners["rng/rank_00003.pt"] == names.index("rng/rank_00003.pt") % 2


def test_prune_removes_an_incomplete_tag_older_than_latest_but_not_a_newer_one(tmp_path):
    """A tag directory without COMPLETE below ``latest`` is what a crashed save (an older version's,
    written in place) left: optimizer-sized and never loadable, it goes. One above ``latest`` is not
    this line's to judge (the abandoned run's after a rollback) and stays."""
    for name, complete in (("step_00000001", True), ("step_00000003", False), ("step_00000005", True),
                           ("step_00000007", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights.txt").write_text("x")
        if complete:
            (tmp_path / name / ckpt.COMPLETE).write_text("x")
    (tmp_path / ckpt.LATEST).write_text("step_00000005")
    ckpt._prune(tmp_path, 3, "step_00000005")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000001", "step_00000005",
                                                                        "step_00000007"]


def test_atomic_write_text_syncs_the_temporary_before_renaming_it(tmp_path, monkeypatch):
    """``latest`` / COMPLETE / meta.json: the rename must not reach the disk before the data, or a
    power loss leaves ``latest`` (or a COMPLETE marker) empty, naming no checkpoint."""
    events = record_syncs_renames_and_deletes(monkeypatch)
    target = tmp_path / "latest"
    ckpt.atomic_write_text(target, "step_00000100")
    monkeypatch.undo()
    replaces = [e for e in events if e[0] == "replace" and e[2] == str(target.resolve())]
    assert len(replaces) == 1
    temporary = replaces[0][1]
    assert ("fsync", temporary) in events[:events.index(replaces[0])]
    assert target.read_text() == "step_00000100"


def test_latest_naming_a_missing_or_empty_tag_says_so_and_names_the_newest_complete_one(tmp_path):
    """'latest' naming a tag that does not exist (or nothing) was reported as 'has no COMPLETE marker
    (corrupt checkpoint dir)' for a directory that is not there, and named no way out."""
    from ascender_dist.training.checkpoint import COMPLETE, LATEST, CheckpointError, latest_tag

    good = tmp_path / "step_00000004"
    good.mkdir()
    (good / COMPLETE).write_text("")
    for named, problem in (("step_00000099", "names 'step_00000099', which does not exist"),
                           ("", "is empty (names no checkpoint)")):
        (tmp_path / LATEST).write_text(named + "\n")
        with pytest.raises(CheckpointError) as info:
            latest_tag(tmp_path)
        assert str(info.value) == f"{tmp_path / LATEST}: {problem}; newest complete checkpoint: step_00000004"
    (tmp_path / "step_00000006").mkdir()  # there, but never completed
    (tmp_path / LATEST).write_text("step_00000006\n")
    with pytest.raises(CheckpointError) as info:
        latest_tag(tmp_path)
    assert str(info.value) == (f"{tmp_path / LATEST}: names 'step_00000006', which has no {COMPLETE} marker (corrupt "
                               "checkpoint dir); newest complete checkpoint: step_00000004")


def test_a_conversion_child_dies_with_its_rank(tmp_path):
    """The child ignores the launcher's SIGTERM by design; when the rank was SIGKILLed (out of
    memory) it ran on orphaned and wrote into the work directory the next job's conversion reuses
    (found by a review)."""
    import os
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    code = ("import sys; from ascender_dist.training import checkpoint as c; "
            "c.run_shielded('tests.helpers.sleep_and_report', [sys.argv[1]])")
    rank = subprocess.Popen([sys.executable, "-c", code, str(pid_file)], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
    finally:
        rank.kill()
        rank.wait()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state not in ("Z", "X")  # a zombie left for an init that does not reap is dead

    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(child):
        os.kill(child, 9)
    assert not alive(child), "the conversion child outlived its rank"


# ----------------------------------------------------------------------------- found in review (2026-12-02): rollback rows
def test_an_open_rollback_row_keeps_the_checkpoints_a_repeat_needs(single_rank_group, tmp_path):
    """keep_last=2, saves at 100 and 200, a rollback to 200 (bad steps up to 300), then saves at 250 and
    260 inside the row: pruning kept only 250 and 260, so a repeat rollback went to 250, newer than the
    previous target. The row's target (200) and the newest checkpoint older than it (100, where a repeat
    goes) now stay until a save past the trouble ends the row."""
    policy = RollbackPolicy(max_rollbacks=3)

    def save(step):
        policy.saved(step)
        return ckpt.save_checkpoint(FakeEngine(f"v{step}"), tmp_path, step, client_state={}, keep_last=2,
                                    extra_files={"meta.json": '{"step": %d}' % step},
                                    protect=policy.protected_steps)

    save(100)
    save(200)
    assert policy.next_target(300, [100, 200]) == 200
    for step in (200, 250, 260):  # the rollback's re-save, then two saves inside the row
        save(step)
    steps = [ckpt.step_of_tag(tag) for tag in ckpt.complete_tags(tmp_path)]
    assert steps == [100, 200, 250, 260]
    assert policy.next_target(280, [s for s in steps if s < 270]) == 100  # the repeat goes older
    for step in (100, 400):  # its re-save; then a save past the trouble ends the row
        save(step)
    assert [ckpt.step_of_tag(tag) for tag in ckpt.complete_tags(tmp_path)] == [100, 400]


def test_a_rollback_row_protects_its_target_and_the_next_older_step():
    policy = RollbackPolicy(max_rollbacks=3)
    assert policy.protected_steps([100, 200, 300]) == set()  # no row
    policy.next_target(350, [100, 200, 300])
    assert policy.protected_steps([100, 200, 300, 400]) == {300, 200}
    policy.next_target(380, [100, 200, 300])  # a repeat: 200
    assert policy.protected_steps([100, 200, 300]) == {200, 100}
    policy.next_target(390, [100, 200, 300])  # 100: nothing older
    assert policy.protected_steps([100, 200]) == {100}


def test_rollback_candidates_include_a_copy_a_same_step_save_left_aside(tmp_path):
    """A rollback's re-save of step 200 (latest step_200) killed between its two renames leaves
    step_200.replaced, from which the restarted job resumes; the rollback candidates skipped it, so a
    repeat found no checkpoint before the trouble (or went a whole interval further back)."""
    import types

    from ascender_dist.training.trainer import Trainer

    for name in ("step_00000100", "step_00000200.replaced", "step_00000300", "step_00000300.replaced"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ckpt.COMPLETE).write_text("x")
    fake = types.SimpleNamespace(derived=types.SimpleNamespace(checkpoint_dir=tmp_path))
    assert Trainer._held_checkpoints(fake) == {100: "step_00000100", 200: "step_00000200.replaced",
                                               300: "step_00000300"}  # a step's own tag first


def test_a_save_reaches_stable_storage_before_latest_names_it(single_rank_group, tmp_path, monkeypatch):
    """checkpoint.py's promise that ``latest`` never names data still in a page cache: every file of the
    staged tag (the engine's shards, the RNG files, meta.json, COMPLETE) and every directory of it is
    fsynced before the staged directory is renamed to its tag, and the checkpoint directory after
    ``latest`` moved (the SIGKILL tests cannot see a missing fsync; only a power loss would)."""
    _save(tmp_path, 1, "first")
    events = record_syncs_renames_and_deletes(monkeypatch)
    _save(tmp_path, 2, "second")
    monkeypatch.undo()
    staged = str((tmp_path / ("step_00000002" + ckpt.PARTIAL)).resolve())
    final = tmp_path / "step_00000002"
    publish = events.index(("replace", staged, str(final.resolve())))
    synced_before = set()
    for event in events[:publish]:  # a file fsynced under a temporary name and renamed into place counts
        if event[0] == "fsync":
            synced_before.add(event[1])
        elif event[0] == "replace" and event[1] in synced_before:
            synced_before.add(event[2])
    files = {staged + "/" + p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    directories = {staged} | {staged + "/" + p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_dir()}
    assert {staged + "/weights.txt", staged + "/meta.json", staged + "/" + ckpt.COMPLETE} <= files
    assert any("/rng/" in f for f in files), files
    assert files - synced_before == set() and directories - synced_before == set(), (files | directories) - synced_before
    latest = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str((tmp_path / ckpt.LATEST).resolve()))
    assert publish < latest and ("fsync", str(tmp_path.resolve())) in events[latest:], events[latest:]
