"""Crash windows and bad input found in review of ``training/checkpoint.py`` and
``training/resume_check.py``: a crash in the first save (before ``latest`` was ever written), a
malformed ``files`` record in meta.json or a read error while checking the files, a resume with
another tokenizer, and the universal copy of a moved-aside (``.replaced``) tag."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import to_dict
from ascender_dist.config.resolve import config_from_dict, derive
from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.resume_check import check_resume, data_fingerprint
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)
from tests.unit.test_checkpoint import Crash, FakeEngine, _load, _save, save_killed_between_the_renames


# ----------------------------------------------------------------------------- a crash in the first save
def _crash_writing_latest(monkeypatch, placeholder_too: bool = False):
    """atomic_write_text raises Crash when it writes ``latest`` naming a tag (with ``placeholder_too``:
    any ``latest``, also the placeholder); returns a function that undoes it."""
    real_write = ckpt.atomic_write_text

    def write_but_not_latest(path, text):
        if Path(path).name == ckpt.LATEST and (placeholder_too or text.strip().startswith("step_")):
            raise Crash("killed before latest was written")
        real_write(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", write_but_not_latest)
    return lambda: monkeypatch.setattr(ckpt, "atomic_write_text", real_write)


def test_a_crash_in_the_first_save_after_publishing_resumes_from_that_tag(single_rank_group, tmp_path, monkeypatch):
    from ascender_dist.training.run import _refuse_fresh_start_over_checkpoints

    undo = _crash_writing_latest(monkeypatch)
    with pytest.raises(Crash):
        _save(tmp_path, 100, "first")
    undo()
    assert (tmp_path / "step_00000100" / ckpt.COMPLETE).is_file()
    assert ckpt.latest_tag(tmp_path) == ckpt.agreed_latest_tag(tmp_path) == "step_00000100"
    assert _load(tmp_path) == "first"  # resubmitting the same command (auto_resume) continues
    assert (tmp_path / ckpt.LATEST).read_text().strip() == ckpt.NO_CHECKPOINT_YET
    # auto_resume: false treats it as after any finished save: a checkpoint is there
    with pytest.raises(ConfigError, match=r"^checkpoint\.auto_resume: false, but .* holds checkpoints"):
        _refuse_fresh_start_over_checkpoints(config_from_dict({"checkpoint": {"auto_resume": False}}), tmp_path)
    _save(tmp_path, 200, "second")  # the next save names its tag: no placeholder left
    assert (tmp_path / ckpt.LATEST).read_text().strip() == "step_00000200"


def test_a_crash_in_the_first_save_before_publishing_is_a_fresh_start(single_rank_group, tmp_path, monkeypatch):
    from ascender_dist.training.run import _refuse_fresh_start_over_checkpoints

    real_publish = ckpt._publish

    def die(checkpoint_dir, tag):
        raise Crash("killed before the rename")

    monkeypatch.setattr(ckpt, "_publish", die)
    with pytest.raises(Crash):
        _save(tmp_path, 100, "first")
    monkeypatch.setattr(ckpt, "_publish", real_publish)
    assert ckpt.latest_tag(tmp_path) is None and ckpt.load_checkpoint(FakeEngine(""), tmp_path) is None
    assert (tmp_path / ckpt.LATEST).read_text().strip() == ckpt.NO_CHECKPOINT_YET  # the placeholder alone
    _refuse_fresh_start_over_checkpoints(config_from_dict({"checkpoint": {"auto_resume": False}}), tmp_path)
    _save(tmp_path, 100, "again")  # the staging directory is cleaned up, the placeholder replaced
    assert ckpt.latest_tag(tmp_path) == "step_00000100" and _load(tmp_path) == "again"
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.LATEST, "step_00000100"]


def test_a_crash_while_writing_the_placeholder_leaves_no_checkpoint(single_rank_group, tmp_path, monkeypatch):
    undo = _crash_writing_latest(monkeypatch, placeholder_too=True)
    with pytest.raises(Crash):
        _save(tmp_path, 100, "first")
    undo()
    assert ckpt.latest_tag(tmp_path) is None and ckpt.complete_tags(tmp_path) == []


def test_the_placeholder_reads_the_moved_aside_copy_when_the_resumed_step_is_saved_again(single_rank_group,
                                                                                           tmp_path, monkeypatch):
    """First save crashed after publishing; the resumed run saves the same step again (its final
    save) and is killed between the two renames: the moved-aside copy is the checkpoint."""
    undo = _crash_writing_latest(monkeypatch)
    with pytest.raises(Crash):
        _save(tmp_path, 100, "first")
    undo()
    calls = save_killed_between_the_renames(monkeypatch, tmp_path, 100, "again")
    assert calls[0][1] == "step_00000100.replaced" and not (tmp_path / "step_00000100").exists()
    assert ckpt.latest_tag(tmp_path) == "step_00000100.replaced" and _load(tmp_path) == "first"


def test_a_latest_deleted_by_hand_is_still_refused_and_not_turned_into_a_placeholder(single_rank_group, tmp_path,
                                                                                       monkeypatch):
    _save(tmp_path, 1, "one")
    (tmp_path / ckpt.LATEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"latest: missing, but the directory holds complete checkpoints"):
        ckpt.latest_tag(tmp_path)
    undo = _crash_writing_latest(monkeypatch)  # a save into it (not a first save) crashes before latest
    with pytest.raises(Crash):
        _save(tmp_path, 2, "two")
    undo()
    assert not (tmp_path / ckpt.LATEST).exists()
    with pytest.raises(ckpt.CheckpointError, match=r"latest: missing"):
        ckpt.latest_tag(tmp_path)


def test_a_failed_save_after_a_crashed_first_save_names_the_tag_a_resume_reads(single_rank_group, tmp_path,
                                                                                  monkeypatch):
    from tests.unit.test_checkpoint import FullDisk

    undo = _crash_writing_latest(monkeypatch)
    with pytest.raises(Crash):
        _save(tmp_path, 1, "one")
    undo()
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(FullDisk("two"), tmp_path, 2, client_state={}, keep_last=3,
                             extra_files={"meta.json": "{}"})
    assert str(info.value).endswith("removed step_00000002.partial, a resume reads step_00000001")


def test_conversion_tools_read_the_tag_of_a_crashed_first_save(single_rank_group, tmp_path, monkeypatch):
    from ascender_dist.tools.convert import ConversionError, resolve_tag

    undo = _crash_writing_latest(monkeypatch)
    with pytest.raises(Crash):
        _save(tmp_path / "run", 3, "three")
    undo()
    assert resolve_tag(tmp_path / "run", None) == tmp_path / "run" / "step_00000003"
    (tmp_path / "none").mkdir()  # the placeholder alone: no checkpoint to convert
    (tmp_path / "none" / ckpt.LATEST).write_text(ckpt.NO_CHECKPOINT_YET + "\n")
    with pytest.raises(ConversionError, match=r"no complete checkpoint \(no 'latest' file, or its first save"):
        resolve_tag(tmp_path / "none", None)


# ----------------------------------------------------------------------------- meta.json's files record
@pytest.mark.parametrize("mutate, message", [
    (lambda files: {k: {"sha256": v["sha256"]} for k, v in files.items()},
     r"files\['weights\.txt'\]\.size: expected a byte count, got nothing"),
    (lambda files: sorted(files), r"files: expected an object of \{path: \{size, sha256\}\}, got list"),
    (lambda files: {k: {**v, "size": str(v["size"])} for k, v in files.items()},
     r"files\['weights\.txt'\]\.size: expected a byte count, got str '3'"),
    (lambda files: {k: {"size": v["size"], "sha256": 7} for k, v in files.items()},
     r"files\['weights\.txt'\]\.sha256: expected a hex string, got int 7"),
    (lambda files: {k: [v["size"]] for k, v in files.items()},
     r"files\['weights\.txt'\]: expected \{size, sha256\}, got list"),
    (lambda files: {"../outside.txt": v for v in files.values()},
     r"files: '\.\./outside\.txt' is not a path inside the checkpoint"),
])
def test_a_malformed_files_record_is_one_line_naming_meta_json_and_the_entry(single_rank_group, tmp_path, monkeypatch,
                                                                             mutate, message):
    monkeypatch.setattr(ckpt, "_layouts", lambda: None)
    _save(tmp_path, 1, "one")
    meta_file = tmp_path / "step_00000001" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["files"] = mutate({k: v for k, v in meta["files"].items() if k == "weights.txt"})
    meta_file.write_text(json.dumps(meta))
    engine = FakeEngine("")
    with pytest.raises(ckpt.CheckpointError, match=rf"^{meta_file}: {message}$") as info:
        ckpt.load_checkpoint(engine, tmp_path)
    assert engine.loaded is None and info.value.rank == 0


def test_a_read_error_while_checking_a_file_is_that_ranks_agreed_failure(single_rank_group, tmp_path, monkeypatch):
    import errno

    monkeypatch.setattr(ckpt, "_layouts", lambda: None)  # no rng/positions.json: the rng file is checked first
    _save(tmp_path, 1, "one")
    failures = []
    real_first_failure = ckpt.first_failure

    def recording_first_failure(problem):
        failures.append(problem)
        return real_first_failure(problem)

    def eio(path, sync=False):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(ckpt, "first_failure", recording_first_failure)
    monkeypatch.setattr(ckpt, "_sha256", eio)
    shard = tmp_path / "step_00000001" / "rng" / "rank_00000.pt"
    with pytest.raises(ckpt.CheckpointError, match=rf"^{shard}: unreadable \(OSError: \[Errno 5\] Input/output "
                                                   r"error: .*\) \(rank 0's file, checked before anything was "
                                                   r"loaded\)$"):
        ckpt.load_checkpoint(FakeEngine(""), tmp_path)
    assert failures[-1].startswith(f"{shard}: unreadable")  # went through the collective, not raised alone



def test_a_permission_error_on_the_files_directory_is_that_ranks_agreed_failure(single_rank_group, tmp_path,
                                                                                monkeypatch):
    """Path.is_file() hides only a missing file: EACCES on a directory of the tag raises from it, and
    must be the rank's failure line too, not a traceback on one rank while its peers wait."""
    import errno

    monkeypatch.setattr(ckpt, "_layouts", lambda: None)
    _save(tmp_path, 1, "one")
    real_is_file = Path.is_file

    def denied(self):
        if self.parent.name == "rng":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", denied)
    shard = tmp_path / "step_00000001" / "rng" / "rank_00000.pt"
    with pytest.raises(ckpt.CheckpointError, match=rf"^{shard}: unreadable \(PermissionError: "):
        ckpt.load_checkpoint(FakeEngine(""), tmp_path)

# ----------------------------------------------------------------------------- resuming with another tokenizer
def _run_cfg(root: Path, tokenizer: Path, manifest: str = "manifest.json", **data):
    return config_from_dict({"data": {"manifest": str(root / manifest), "tokenizer": str(tokenizer), **data},
                             "model": {"hidden_size": 64, "vocab_size": 32000}})


def _tag_trained_with(root: Path, cfg, **meta) -> None:
    tag = root / "step_00000005"
    tag.mkdir(parents=True, exist_ok=True)
    (tag / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (tag / "meta.json").write_text(json.dumps({"step": 5, "data_fingerprint": data_fingerprint(cfg), **meta}))


@pytest.fixture
def tokenizers(tmp_path):
    (tmp_path / "manifest.json").write_text('{"shards": []}')
    (tmp_path / "manifest2.json").write_text('{"shards": [1]}')
    for name in ("A", "B"):
        (tmp_path / f"{name}.model").write_bytes(f"tokenizer {name}".encode())
    return tmp_path / "A.model", tmp_path / "B.model"


def test_another_tokenizer_is_refused_even_when_the_data_may_change(tmp_path, tokenizers):
    tok_a, tok_b = tokenizers
    old = _run_cfg(tmp_path, tok_a)
    _tag_trained_with(tmp_path, old, tokenizer_sha256=hashlib.sha256(tok_a.read_bytes()).hexdigest(), vocab_size=32000)
    assert check_resume(old, tmp_path, "step_00000005", log_it=False)["data_changes"] == []  # the same: resumes
    swapped = _run_cfg(tmp_path, tok_b, "manifest2.json", allow_change_on_resume=True)
    with pytest.raises(ConfigError, match=rf"^data\.tokenizer: {tok_b} \(sha256 \w{{12}}\.\.\.\) is not the tokenizer "
                                          r"checkpoint .*step_00000005 was trained with \(.*meta\.json "
                                          r"tokenizer_sha256 \w{12}\.\.\.\): resume with that tokenizer") as info:
        check_resume(swapped, tmp_path, "step_00000005-universal", log_it=False)
    assert "\n" not in str(info.value)
    no_tokenizer = config_from_dict({**to_dict(old), "data": {"manifest": str(tmp_path / "manifest.json")}})
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: not set, but checkpoint .* was trained with a tokenizer"):
        check_resume(no_tokenizer, tmp_path, "step_00000005", log_it=False)


def test_the_check_compares_the_tokenizer_the_run_loaded_not_the_file_now(tmp_path, tokenizers):
    """The trainer passes its loaded tokenizer's sha256: a file replaced after loading cannot pass for
    the run's tokenizer, and the file is not read again."""
    tok_a, tok_b = tokenizers
    sha_a, sha_b = (hashlib.sha256(t.read_bytes()).hexdigest() for t in (tok_a, tok_b))
    cfg = _run_cfg(tmp_path, tok_a)
    _tag_trained_with(tmp_path, cfg, tokenizer_sha256=sha_a, vocab_size=32000)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: .* is not the tokenizer checkpoint"):
        check_resume(cfg, tmp_path, "step_00000005", log_it=False, tokenizer_sha256=sha_b)  # the file is A's
    tok_a.unlink()  # the loaded one is A: no file read needed
    check_resume(cfg, tmp_path, "step_00000005", log_it=False, tokenizer_sha256=sha_a)


def test_an_older_checkpoint_without_the_tokenizer_sha256_is_checked_by_vocab_sizes(tmp_path, tokenizers):
    tok_a, _ = tokenizers
    cfg = config_from_dict({"data": {"manifest": str(tmp_path / "manifest.json"), "tokenizer": str(tok_a)},
                            "model": {"hidden_size": 64}})
    derived = derive(cfg, 1, 32000)  # the run's tokenizer has 32000 pieces: padded to 32000
    _tag_trained_with(tmp_path, cfg, vocab_size=32000, padded_vocab_size=32000)
    check_resume(cfg, tmp_path, "step_00000005", log_it=False, derived=derived)  # the same sizes: resumes
    _tag_trained_with(tmp_path, cfg, vocab_size=31990, padded_vocab_size=32000)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: gives vocab_size 32000, but checkpoint .*step_00000005 "
                                          r"was trained with 31990"):
        check_resume(cfg, tmp_path, "step_00000005", log_it=False, derived=derived)
    _tag_trained_with(tmp_path, cfg, padded_vocab_size=50304)  # no vocab_size recorded
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: gives padded_vocab_size 32000, but checkpoint "
                                          r".*step_00000005 was trained with 50304"):
        check_resume(cfg, tmp_path, "step_00000005", log_it=False, derived=derived)


def test_data_made_with_another_tokenizer_is_refused_in_a_run_without_data_tokenizer(tmp_path, tokenizers):
    """A run that names no tokenizer (model.vocab_size set) has only the vocabulary size to compare: the
    tokenizer its data was made with (the manifests') is recorded and compared, even when the data may
    change."""
    sha_a, sha_b = "a" * 64, "b" * 64
    cfg = config_from_dict({"data": {"manifest": str(tmp_path / "manifest.json"), "allow_change_on_resume": True},
                            "model": {"hidden_size": 64, "vocab_size": 32000}})
    _tag_trained_with(tmp_path, cfg, vocab_size=32000, data_tokenizer_sha256=sha_a)
    check_resume(cfg, tmp_path, "step_00000005", log_it=False, data_tokenizer=sha_a)  # the same: resumes
    with pytest.raises(ConfigError, match=rf"^data\.manifest: {tmp_path / 'manifest.json'} was made with tokenizer "
                                          r"sha256 bbbbbbbbbbbb\.\.\., checkpoint .*step_00000005 was trained on data "
                                          r"made with aaaaaaaaaaaa\.\.\. \(.*meta\.json data_tokenizer_sha256\)") as info:
        check_resume(cfg, tmp_path, "step_00000005", log_it=False, data_tokenizer=sha_b)
    assert "\n" not in str(info.value)
    _tag_trained_with(tmp_path, cfg, vocab_size=32000)  # an older checkpoint without the record: nothing to compare
    check_resume(cfg, tmp_path, "step_00000005", log_it=False, data_tokenizer=sha_b)


def test_a_manifest_given_by_its_directory_has_the_fingerprint_of_its_file(tmp_path, tokenizers):
    by_file = _run_cfg(tmp_path, tokenizers[0])
    by_directory = config_from_dict({**to_dict(by_file), "data": {**to_dict(by_file)["data"], "manifest": str(tmp_path)}})
    assert data_fingerprint(by_directory) == data_fingerprint(by_file)


def test_the_data_tokenizer_is_the_one_the_loaders_datasets_were_made_with():
    from types import SimpleNamespace

    from ascender_dist.training.resume_check import data_tokenizer_sha256

    def loader(*shas):
        return SimpleNamespace(datasets=[SimpleNamespace(checks=SimpleNamespace(tokenizer_sha256=s)) for s in shas])

    assert data_tokenizer_sha256(loader("ab", "ab")) == "ab"
    assert data_tokenizer_sha256(loader(None, "ab")) == "ab"
    assert data_tokenizer_sha256(loader(None)) is None


def test_the_tools_read_the_recorded_tokenizer_through_the_training_helper():
    from ascender_dist.tools import convert

    assert convert.recorded_tokenizer_sha256 is ckpt.recorded_tokenizer_sha256
    assert ckpt.recorded_tokenizer_sha256({"tokenizer_sha256": "ab"}) == "ab"
    assert ckpt.recorded_tokenizer_sha256({"tokenizer_sha256": None}) is None


# ----------------------------------------------------------------------------- universal copy of a .replaced tag
def test_a_universal_copy_of_a_moved_aside_tag_is_pruned(single_rank_group, tmp_path, monkeypatch):
    import subprocess

    def fake_ds_to_universal(cmd, **kwargs):
        out = Path(cmd[cmd.index("--output_folder") + 1])
        out.mkdir(parents=True)
        (out / "optimizer_state.bin").write_text("x" * 1000)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_ds_to_universal)
    _save(tmp_path, 1, "first run")
    save_killed_between_the_renames(monkeypatch, tmp_path, 1, "second run")
    tag = ckpt.latest_tag(tmp_path)
    assert tag == "step_00000001.replaced"
    assert ckpt.ensure_universal(tmp_path, tag) == "step_00000001.replaced-universal"  # another DP size
    (tmp_path / "step_00000001.replaced-universal.deleting").mkdir()  # a crash while it was deleted
    _save(tmp_path, 2, "resumed")
    # the source went back to its name, so a later resume converts step_00000001 itself: the copy goes
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000001", "step_00000002"]
    for step in (3, 4, 5):
        _save(tmp_path, step, f"v{step}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000003", "step_00000004",
                                                                        "step_00000005"]
    assert ckpt.latest_tag(tmp_path) == "step_00000005" and _load(tmp_path) == "v5"


def test_a_folder_whose_only_checkpoint_is_a_moved_aside_copy_is_not_taken_for_empty(single_rank_group, tmp_path,
                                                                                     monkeypatch):
    """A same-step re-save killed between its renames leaves step_N.replaced as the only good copy
    (latest_tag resumes from it). A fresh run (auto_resume: false) and a reshard looked only at
    complete step_N tags, let themselves in, and the new run's saves then moved latest away from it
    and deleted it (found by a review)."""
    from ascender_dist.tools.convert import ConversionError, check_reshard_out
    from ascender_dist.training.run import _refuse_fresh_start_over_checkpoints

    _save(tmp_path, 50, "old run")
    save_killed_between_the_renames(monkeypatch, tmp_path, 50, "old run again")
    assert ckpt.complete_tags(tmp_path) == [] and ckpt.latest_tag(tmp_path) == "step_00000050.replaced"
    assert ckpt.held_tags(tmp_path) == ["step_00000050.replaced"]
    with pytest.raises(ConfigError, match=r"holds checkpoints \(newest step_00000050.replaced\)"):
        _refuse_fresh_start_over_checkpoints(config_from_dict({"checkpoint": {"auto_resume": False}}), tmp_path)
    with pytest.raises(ConversionError, match=r"already holds training checkpoints \(newest step_00000050.replaced"):
        check_reshard_out(tmp_path, tmp_path.parent / "consolidated")
    assert _load(tmp_path) == "old run"  # still the run's checkpoint


def test_a_save_that_fails_writing_latest_does_not_claim_it_removed_the_published_tag(single_rank_group, tmp_path,
                                                                                      monkeypatch):
    """The error said "removed step_2.partial" while a complete step_2 stayed (found by a review)."""
    import errno

    _save(tmp_path, 1, "one")
    real = ckpt.atomic_write_text

    def disk_full_at_latest(path, text):
        if Path(path).name == ckpt.LATEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", disk_full_at_latest)
    with pytest.raises(ckpt.CheckpointError) as info:
        _save(tmp_path, 2, "two")
    assert (tmp_path / "step_00000002" / ckpt.COMPLETE).is_file()
    assert "step_00000002 is complete but latest was not moved to it, latest still names step_00000001" in str(
        info.value), info.value
    monkeypatch.undo()
    assert _load(tmp_path) == "one"
