"""Input and output problems of the text -> tokenizer -> shards tools: each is one line naming the
file (and line) at fault, the tokenizer and the shards see the same text, and a re-shard leaves no
old shard behind for a glob to read."""

from __future__ import annotations

import functools
import json

import pytest

from data_pipeline._io import atomic_write_bytes
from data_pipeline.cli import main
from data_pipeline.errors import DataError
from data_pipeline.formats import iter_documents
from data_pipeline.shards import Manifest, load_manifest, write_shards
from data_pipeline.tokenizer import iter_training_texts, train_tokenizer

from tests.helpers.errors import one_line

from .data_fixtures import TEXT, loader, run_global, tar_of, text_file, tiny_tokenizer  # noqa: F401

GOOD = "".join(json.dumps({"text": f"{i}: {TEXT}"}) + "\n" for i in range(30))


def cli_error(capsys, argv) -> str:
    """Run the CLI, assert it failed with exit status 2 and one ``error:`` line; return that line."""
    assert main(["--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- 1: reader errors in training
def test_reader_error_during_training_is_the_readers_own_line(tmp_path, capsys):
    """sentencepiece wraps an iterator's exception in a RuntimeError ending in a stack frame; the user
    must see the reader's line (file:line: problem), not ``formats.py(230): iter_jsonl_texts``."""
    bad = tmp_path / "miss.jsonl"
    bad.write_text(GOOD + json.dumps({"txt": "x"}) + "\n")
    with pytest.raises(DataError) as e:
        train_tokenizer([bad], tmp_path / "tok", 300, progress=False)
    assert str(e.value) == f'{bad}:31: expected an object with a string field "text"'
    err = cli_error(capsys, ["train-tokenizer", "--input", str(bad), "--out-prefix", str(tmp_path / "t"),
                             "--vocab-size", "300"])
    assert err == f'error: {bad}:31: expected an object with a string field "text"'
    assert not list(tmp_path.glob("t.*")) and not list(tmp_path.glob("tok.*"))


# --------------------------------------------------------------------------- 2: lone surrogates
def test_lone_surrogate_in_json_lines_is_a_bad_record(tmp_path):
    """``"\\ud800"`` is valid JSON but no Unicode text: refused where it is read, naming file and line
    (a surrogate pair, which is a real character, is fine)."""
    path = tmp_path / "sur.jsonl"
    path.write_text(GOOD + '{"text": "pair \\ud83d\\ude00 ok"}\n' + '{"text": "bad \\ud800 x"}\n')
    with pytest.raises(DataError) as e:
        list(iter_documents([path]))
    one_line(e, f"{path}:32: lone surrogate \\ud800 at character 4", "not valid Unicode")
    path.write_text(GOOD + '{"text": "pair \\ud83d\\ude00 ok"}\n')
    assert list(iter_documents([path]))[-1] == "pair \U0001F600 ok"


@pytest.mark.parametrize("member,payload,where", [
    ("a.json", b'{"text": "x \\udfff"}', "a.json"),
    ("b.jsonl", b'{"text": "fine"}\n{"text": "\\ud800"}\n', "b.jsonl:2"),
])
def test_lone_surrogate_in_a_tar_member(tmp_path, member, payload, where):
    tar = tmp_path / "docs.tar"
    tar.write_bytes(tar_of([("ok.txt", b"fine"), (member, payload)]))
    with pytest.raises(DataError) as e:
        list(iter_documents([tar]))
    one_line(e, f"{tar}:{where}: lone surrogate", "not valid Unicode")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_shard_refuses_a_lone_surrogate_in_one_line(tmp_path, tiny_tokenizer, capsys, workers):
    path = tmp_path / "sur.jsonl"
    path.write_text(GOOD + '{"text": "bad \\ud800 x"}\n')
    err = cli_error(capsys, ["shard", "--input", str(path), "--tokenizer", str(tiny_tokenizer.model_path),
                             "--out-dir", str(tmp_path / "ds"), "--seq-length", "16", "--workers", workers])
    assert err.startswith(f"error: {path}:31: lone surrogate") and err.endswith("is not valid Unicode"), err
    assert not (tmp_path / "ds" / "manifest.json").exists()


# --------------------------------------------------------------------------- 3: carriage returns
def test_text_files_keep_carriage_returns_like_every_other_format(tmp_path):
    """The shards must hold the text the tokenizer was trained on: a .txt is not newline-translated."""
    text = "line one\r\nline two\rthree\n"
    (tmp_path / "crlf.txt").write_bytes(text.encode())
    (tmp_path / "crlf.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "crlf.tar").write_bytes(tar_of([("a.txt", text.encode())]))
    for name in ("crlf.txt", "crlf.jsonl", "crlf.tar"):
        assert list(iter_documents([tmp_path / name])) == [text], name
    assert "".join(iter_training_texts([tmp_path / "crlf.txt"])) == text
    (tmp_path / "bad.txt").write_bytes(b"fine\r\ncaf\xe9\n")
    with pytest.raises(DataError) as e:
        list(iter_documents([tmp_path / "bad.txt"]))
    one_line(e, f"{tmp_path / 'bad.txt'}: not valid UTF-8 (byte 9")


# --------------------------------------------------------------------------- 4: unwritable outputs
def test_atomic_write_to_an_unwritable_path_is_one_line(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError) as e:
        atomic_write_bytes(tmp_path / "adir", b"data")
    assert str(e.value) == f"{tmp_path / 'adir'}: cannot write (Is a directory)"
    with pytest.raises(DataError) as e:
        atomic_write_bytes(tmp_path / "afile" / "sub" / "x.json", b"data")
    target = tmp_path / "afile" / "sub" / "x.json"
    assert str(e.value) == f"{target}: cannot write ({tmp_path / 'afile'} is not a directory)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]  # no temporary file left
    assert not any((tmp_path / "adir").iterdir())


def test_build_corpus_to_an_unwritable_path_is_one_line(tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    err = cli_error(capsys, ["build-corpus", "--out", str(tmp_path / "adir"), "--max-bytes", "2000"])
    assert err == f"error: {tmp_path / 'adir'}: cannot write (Is a directory)"
    err = cli_error(capsys, ["build-corpus", "--out", str(tmp_path / "afile" / "c.jsonl"), "--max-bytes", "2000"])
    assert err == f"error: {tmp_path / 'afile' / 'c.jsonl'}: cannot write ({tmp_path / 'afile'} is not a directory)"


def test_train_tokenizer_checks_its_output_paths_before_training(tmp_path, text_file, capsys, monkeypatch):
    import data_pipeline.tokenizer as tokenizer_mod

    def no_training(*args, **kwargs):
        raise AssertionError("training started although the output path is unwritable")

    monkeypatch.setattr(tokenizer_mod, "_training_lines", no_training)
    (tmp_path / "t.model").mkdir()
    (tmp_path / "afile").write_text("x")
    common = ["train-tokenizer", "--input", str(text_file), "--vocab-size", "300", "--out-prefix"]
    err = cli_error(capsys, [*common, str(tmp_path / "t")])
    assert err == f"error: {tmp_path / 't.model'}: cannot write (Is a directory)"
    err = cli_error(capsys, [*common, str(tmp_path / "afile" / "tok")])
    assert err == f"error: {tmp_path / 'afile' / 'tok.model'}: cannot write ({tmp_path / 'afile'} is not a directory)"


# --------------------------------------------------------------------------- 5: stale shards
def _shard_files(out_dir) -> set[str]:
    return {p.name for p in out_dir.glob("shard-*-*.tar")}


def test_resharding_removes_old_shards_the_new_manifest_does_not_list(tmp_path, tiny_tokenizer, text_file):
    out = tmp_path / "ds"
    old = write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=5, val_fraction=0.2, progress=False)
    keep = ["notes.txt", "other-train-000000.tar", "shard-train-000099.tar.bak", "shard-train-7.tar"]
    for name in keep:
        (out / name).write_text("not ours")
    new = write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=40, val_fraction=0.2,
                       progress=False)
    assert len(new.shards) < len(old.shards)
    assert _shard_files(out) - {"shard-train-7.tar"} == {s.name for s in new.shards}
    assert all((out / name).read_text() == "not ours" for name in keep)
    assert load_manifest(out).to_json() == new.to_json()


def test_parallel_resharding_removes_old_shards_too(tmp_path, tiny_tokenizer, text_file):
    from data_pipeline.parallel import write_shards_parallel

    out = tmp_path / "ds"
    old = write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=5, progress=False)
    new = write_shards_parallel([text_file], tiny_tokenizer, out, 16, workers=2, samples_per_shard=40)
    assert len(new.shards) < len(old.shards)
    assert _shard_files(out) == {s.name for s in new.shards}


@pytest.mark.parametrize("parallel", [False, True])
def test_a_crash_between_moving_shards_and_saving_the_manifest_leaves_no_manifest(tmp_path, tiny_tokenizer,
                                                                                   monkeypatch, parallel):
    """A re-shard into the same directory moves its shards over the old names, then saves the manifest.
    A crash in between must not leave the old manifest over new shards of the same names and sizes:
    a partial read (dp 2: no whole-shard sha256) would load them as the old dataset without a word."""
    from data_pipeline.parallel import write_shards_parallel

    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text(TEXT * 10, encoding="utf-8")
    two.write_text("Pack my box with five dozen liquor jugs, 12345.\n" * 40, encoding="utf-8")
    out = tmp_path / "ds"

    def write(inputs):
        if parallel:
            return write_shards_parallel(inputs, tiny_tokenizer, out, 16, workers=1, samples_per_shard=8,
                                         val_fraction=0.0)
        return write_shards(inputs, tiny_tokenizer, out, 16, samples_per_shard=8, val_fraction=0.0, progress=False)

    def crash(self, path):
        raise RuntimeError("simulated crash")

    old = write([one, two])
    with monkeypatch.context() as m:
        m.setattr(Manifest, "save", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            write([two, one])  # the same documents in another order: same shard names and sizes, other bytes
    assert all((out / s.name).stat().st_size == s.bytes for s in old.shards)
    assert {s.name for s in old.shards} == _shard_files(out)
    make = functools.partial(loader, out, seq_length=16)
    with pytest.raises(DataError) as e:
        run_global(make, 2, 2)
    one_line(e, str(out / "manifest.json"), "manifest not found", kind=DataError)
    new = write([two, one])  # building again is the way out
    assert new.shards != old.shards and [s.bytes for s in new.shards] == [s.bytes for s in old.shards]
    assert len(run_global(make, 2, 2)[0]) == 16


class _Killed(BaseException):
    """A kill at a rename: no ``except OSError`` (or Exception) handler of the writer runs."""


def _dataset_files(out_dir) -> dict:
    """The manifest and every shard it lists, by name, as bytes (a dataset a loader can take whole)."""
    manifest = load_manifest(out_dir)
    return {"manifest.json": (out_dir / "manifest.json").read_bytes(),
            **{s.name: (out_dir / s.name).read_bytes() for s in manifest.shards}}


@pytest.mark.parametrize("parallel", [False, True])
def test_a_kill_at_any_rename_of_a_reshard_leaves_one_whole_dataset(tmp_path, tiny_tokenizer, monkeypatch, parallel):
    """The old manifest was removed, then new shards moved over the old names one by one: a SIGKILL
    (or OOM) in between left neither dataset (a review killed it there at 2 of 14 delays). Now the
    old dataset moves aside whole first: after a kill at every rename of the commit in turn, the
    directory holds the old or the new dataset, or the loader's error says where the old one is
    and the next write puts it back."""
    import os
    import shutil

    from data_pipeline.parallel import write_shards_parallel
    from data_pipeline.replace import restore_cut_short

    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text(TEXT * 10, encoding="utf-8")
    two.write_text("Pack my box with five dozen liquor jugs, 12345.\n" * 40, encoding="utf-8")
    base = tmp_path / "base"

    def write(out, inputs):
        if parallel:
            return write_shards_parallel(inputs, tiny_tokenizer, out, 16, workers=1, samples_per_shard=16)
        return write_shards(inputs, tiny_tokenizer, out, 16, samples_per_shard=16, progress=False)

    write(base, [one, two])
    old = _dataset_files(base)
    write(tmp_path / "fresh", [two, one])
    new = _dataset_files(tmp_path / "fresh")
    assert old.keys() == new.keys() and old != new  # the same names, other bytes
    real_replace, outcomes = os.replace, set()
    for kill_at in range(1, 100):
        out = tmp_path / f"k{kill_at}"
        shutil.copytree(base, out)
        calls = 0

        def replace(src, dst, *args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == kill_at:
                raise _Killed()
            return real_replace(src, dst, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(os, "replace", replace)
            try:
                write(out, [two, one])
            except _Killed:
                pass
            else:  # no rename left to kill at: every point was tried
                assert _dataset_files(out) == new and not list(out.glob(".previous-dataset*"))
                break
        if (out / "manifest.json").exists():
            state = _dataset_files(out)
            assert state in (old, new), kill_at
            outcomes.add("old" if state == old else "new")
            continue
        with pytest.raises(DataError) as e:
            load_manifest(out)
        one_line(e, "manifest not found (a re-shard into this directory was cut short: the previous dataset is in",
                 kind=DataError)
        assert restore_cut_short(out)
        assert _dataset_files(out) == old, kill_at
        outcomes.add("restored")
    else:
        raise AssertionError("the write never completed")
    assert outcomes == {"old", "restored"}, outcomes  # kills before the old dataset moves aside, and after
    out = tmp_path / f"k{kill_at - 1}"  # restored: the next write replaces it as if nothing had happened
    write(out, [two, one])
    assert _dataset_files(out) == new and not list(out.glob(".previous-dataset*"))


def test_a_restore_moves_the_old_manifest_back_after_its_shards(tmp_path, monkeypatch):
    """Sorted, manifest.json came back before the shard-*.tar files: a restore cut short there left
    the old manifest over the cut-short build's shards of the same names (read as the old data by a
    partial read), and the next build deleted the old shards still aside."""
    import os

    from data_pipeline.replace import PREVIOUS, restore_cut_short

    aside = tmp_path / PREVIOUS
    aside.mkdir()
    for name in ("manifest.json", "a-train-000000.tar", "shard-train-000000.tar", "z-val-000000.tar"):
        (aside / name).write_text(name)
    (tmp_path / "shard-train-000000.tar").write_text("new, cut short")
    moved, real = [], os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: moved.append(os.path.basename(src)) or real(src, dst))
    assert restore_cut_short(tmp_path)
    assert moved[-1] == "manifest.json" and len(moved) == 4
    assert (tmp_path / "shard-train-000000.tar").read_text() == "shard-train-000000.tar" and not aside.exists()


# --------------------------------------------------------------------------- 6: truncated streams
def test_truncated_zst_names_the_last_whole_line_not_line_1(tmp_path):
    """A .zst cut off after many lines decoded is a stream error: it names the file and the last line
    read whole, never ``file:1:`` as if the first record were bad."""
    import zstandard as zstd

    lines = "".join(json.dumps({"text": f"{i}: {TEXT}"}) + "\n" for i in range(2000)).encode()
    path = tmp_path / "cut.jsonl.zst"
    data = zstd.ZstdCompressor(level=3).compress(lines)  # > 128 KiB: several blocks, decoded one by one
    path.write_bytes(data[: len(data) * 3 // 4])
    read = 0
    with pytest.raises(DataError) as e:
        for _ in iter_documents([path]):
            read += 1
    assert read > 100 and e.value.where == str(path)
    one_line(e, f"truncated or corrupt compressed stream after line {read} (")
    path.write_bytes(data[:50])
    with pytest.raises(DataError) as e:
        list(iter_documents([path]))
    assert e.value.where == str(path)
    one_line(e, "truncated or corrupt compressed stream before its first line (")
