"""Still more bad input that must stop with one line naming the culprit, not a traceback or lost
data: an output folder that cannot be written, a full disk, a broken tokenizer sidecar, a dataset
folder named like a URL scheme, manifest numbers out of range, a stop during a re-shard's commit,
an empty corpus, a malformed loader state, a corpus size no document fits."""

from __future__ import annotations

import errno
import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import parallel, shards
from data_pipeline.cli import inspect_dataset, main
from data_pipeline.errors import DataError
from data_pipeline.shards import load_manifest, write_shards
from data_pipeline.tokenizer import Tokenizer, train_tokenizer

from tests.helpers.errors import one_line as one_line_of

from .data_fixtures import TEXT, loader, make_dataset, run_global, text_file, tiny_tokenizer  # noqa: F401

one_line = functools.partial(one_line_of, kind=DataError)
REPO = Path(__file__).resolve().parents[2]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def leftovers(directory: Path) -> list[str]:
    """Temporary files and folders a writer left in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if "-tmp-" in p.name or p.name.endswith(".tmp"))


def snapshot(directory: Path) -> dict:
    """Every file under ``directory`` (relative path -> bytes)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- 1. output folder not writable
@pytest.mark.parametrize("extra", [[], ["--workers", "2"], ["--job-index", "0", "--job-count", "1"]],
                         ids=["serial", "workers", "job"])
def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, tiny_tokenizer, text_file, monkeypatch,
                                                             capsys, extra):
    """A folder the user may not write (simulated: root may write anywhere) gave a PermissionError
    traceback from _io.run_temp_dir (.shards-tmp, .parts-tmp) or parallel.run_job (.parts)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *a, **kw):
        if Path(path).parent == ro:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    status = main(["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(tiny_tokenizer.model_path),
                   "--out-dir", str(ro), "--seq-length", "16", *extra])
    assert (status, capsys.readouterr().err) == (2, f"error: {ro}: cannot write (Permission denied)\n")
    assert list(ro.iterdir()) == []


# --------------------------------------------------------------------------- 2. disk full
def test_a_full_disk_while_writing_shards_is_one_line(tmp_path, tiny_tokenizer, text_file, monkeypatch):
    out = tmp_path / "ds"
    write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=4, progress=False)
    before = snapshot(out)

    def full(path, data):
        Path(path).write_bytes(data[:100])  # what a full disk leaves: part of the file
        raise ENOSPC

    monkeypatch.setattr(shards, "write_durably", full)
    with pytest.raises(DataError) as e:
        write_shards([text_file], tiny_tokenizer, out, 8, samples_per_shard=4, progress=False)
    assert str(e.value) == f"{out}: cannot write (No space left on device)"
    assert leftovers(out) == [] and snapshot(out) == before


def test_a_full_disk_in_a_parallel_run_is_one_line(tmp_path, tiny_tokenizer, text_file, monkeypatch):
    """Part streams (run_job) and shards (merge): the OSError came up through the pool."""
    out = tmp_path / "ds"
    settings = parallel.shard_settings(16, 4, None, 0.05, "shard")
    real_open = open

    def open_full(path, mode="r", *a, **kw):
        if "w" in mode and str(path).endswith(".bin"):
            raise ENOSPC
        return real_open(path, mode, *a, **kw)

    with ThreadPoolExecutor(1) as pool:  # in this process, so that the patches reach the workers' code
        monkeypatch.setattr(parallel, "open", open_full, raising=False)
        with pytest.raises(DataError) as e:
            parallel.run_job([text_file], tiny_tokenizer, out / parallel.PARTS_DIR, settings, pool=pool)
        assert str(e.value) == f"{out / parallel.PARTS_DIR}: cannot write (No space left on device)"
        monkeypatch.undo()
        parallel.run_job([text_file], tiny_tokenizer, out / parallel.PARTS_DIR, settings, pool=pool)
    monkeypatch.setattr(parallel, "write_durably", lambda path, data: (_ for _ in ()).throw(ENOSPC))
    with pytest.raises(DataError) as e:
        parallel.merge(out, workers=1)
    assert str(e.value) == f"{out}: cannot write (No space left on device)"
    assert leftovers(out) == [] and not (out / "manifest.json").exists()
    assert leftovers(out / parallel.PARTS_DIR) == []


# --------------------------------------------------------------------------- 3. a broken tokenizer sidecar
@pytest.mark.parametrize("content", [b"{", b'{"pad_vocab_to_multiple_of": 25', b'{"a": "\xff\xfe"}', None],
                         ids=["corrupt", "truncated", "not-utf8", "a-directory"])
def test_a_broken_tokenizer_sidecar_is_not_read_as_no_sidecar(tiny_tokenizer, content):
    """A sidecar that was there but unreadable was taken for none: padding 128, not its own."""
    model, side = tiny_tokenizer.model_path, tiny_tokenizer.model_path.with_suffix(".json")
    side.unlink()
    assert Tokenizer.load(model).padded_vocab_size == 512  # none at all: the default multiple, 128
    if content is None:
        side.mkdir()
    else:
        side.write_bytes(content)
    with pytest.raises(DataError) as e:
        Tokenizer.load(model)
    assert one_line(e, "unreadable tokenizer sidecar").startswith(f"{side}: ")
    assert Tokenizer.load(model, pad_vocab_to_multiple_of=64).padded_vocab_size == 448  # the sidecar not read


# --------------------------------------------------------------------------- 4. a folder named like a scheme
@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_relative_dataset_folder_with_a_colon_reads_like_any_other(tmp_path, monkeypatch, dp_size):
    """``run-12:30/shard.tar`` was opened as a URL of scheme "run-12" (and not as a local file)."""
    monkeypatch.chdir(tmp_path)
    make_dataset(Path("run-12:30"), [10, 7, 12], val_counts=[5])
    make_dataset(Path("plain"), [10, 7, 12], val_counts=[5])
    m = load_manifest("run-12:30")
    assert all(loader_spec.local_path is not None for loader_spec in loader("run-12:30").datasets[0].specs)
    assert m.shard_url(m.shards[0]) == "./run-12:30/syn-train-000000.tar"
    assert load_manifest("plain").shard_url(m.shards[0]) == "plain/syn-train-000000.tar"  # unchanged
    for split in ("train", "val"):
        odd, plain = (inspect_dataset(Path(d), split=split, progress=False) for d in ("run-12:30", "plain"))
        assert {**odd, "manifest": ""} == {**plain, "manifest": ""}
    make = {d: functools.partial(loader, d, partial_reads=True) for d in ("run-12:30", "plain")}
    assert run_global(make["run-12:30"], dp_size, 6) == run_global(make["plain"], dp_size, 6)
    Path("run-12:30/syn-train-000001.tar").unlink()  # the existence check before any read
    with pytest.raises(DataError) as e:
        loader("run-12:30")
    one_line(e, "run-12:30/syn-train-000001.tar", "missing shard")


# --------------------------------------------------------------------------- 5. manifest numbers
@pytest.mark.parametrize("change,field", [
    ({"shards.0.num_samples": -5}, "shards[0].num_samples"),
    ({"shards.0.num_samples": 10**30}, "shards[0].num_samples"),
    ({"shards.*.num_samples": 2**47}, "total num_samples"),
    ({"shards.1.num_tokens": -1}, "shards[1].num_tokens"),
    ({"shards.1.bytes": -1}, "shards[1].bytes"),
    ({"padded_vocab_size": -1}, "padded_vocab_size"),
    ({"padded_vocab_size": 10**11}, "padded_vocab_size"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"vocab_size": 301}, "vocab_size 301 > padded_vocab_size 300"),
    ({"seq_length": 0}, "seq_length"),
    ({"num_documents": -1}, "num_documents"),
    ({"dropped_tokens": -1}, "dropped_tokens"),
], ids=["negative-samples", "huge-samples", "samples-overflow-int64", "negative-tokens", "negative-bytes",
        "negative-padded-vocab", "huge-padded-vocab", "negative-vocab", "vocab-over-padded", "zero-seq-length",
        "negative-documents", "negative-dropped"])
def test_manifest_numbers_out_of_range_are_refused_by_name(tmp_path, change, field):
    make_dataset(tmp_path, [10, 7, 12])
    path = tmp_path / "manifest.json"
    raw = json.loads(path.read_text())
    for key, value in change.items():
        if key.startswith("shards."):
            _, which, name = key.split(".")
            for i in (range(len(raw["shards"])) if which == "*" else [int(which)]):
                raw["shards"][i][name] = value
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError) as e:
        load_manifest(path)
    assert one_line(e, field).startswith(f"{path}: ")


def test_manifest_numbers_in_range_still_load(tmp_path):
    """An empty shard (0 samples) and unknown sizes (null) are the format's own: still accepted."""
    make_dataset(tmp_path, [10, 0, 12])
    raw = json.loads((tmp_path / "manifest.json").read_text())
    raw["shards"][0]["bytes"] = raw["shards"][0]["sha256"] = None
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    assert [s.num_samples for s in load_manifest(tmp_path).shards] == [10, 0, 12]


# --------------------------------------------------------------------------- 6. a stop during the commit
_STOP_MID_COMMIT = """
import os, signal, sys
from pathlib import Path
from data_pipeline import cli
out, moves, real = Path(sys.argv[1]), [], os.replace
def replace(src, dst, *a, **kw):
    real(src, dst, *a, **kw)
    if Path(dst).parent == out and str(dst).endswith(".tar"):
        moves.append(dst)
        if len(moves) == 3:  # some new shards in place, the old manifest gone, the rest still to move
            os.kill(os.getpid(), signal.SIGTERM)
os.replace = replace
sys.exit(cli.main(sys.argv[2:]))
"""


def test_sigterm_during_a_reshards_commit_leaves_a_complete_dataset(tmp_path, tiny_tokenizer, text_file):
    """SIGTERM between the old manifest's removal and the new one's save left old and new shards and
    no manifest (and a line saying only that temporary files were removed)."""
    out = tmp_path / "ds"
    write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=2, val_fraction=0, progress=False)
    old = load_manifest(out)
    bigger = tmp_path / "more.txt"
    bigger.write_text(TEXT * 30 + "# another ending\n")
    proc = subprocess.run([sys.executable, "-c", _STOP_MID_COMMIT, str(out), "--quiet", "shard", "--input",
                           str(bigger), "--tokenizer", str(tiny_tokenizer.model_path), "--out-dir", str(out),
                           "--seq-length", "16", "--samples-per-shard", "3", "--val-fraction", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    new = load_manifest(out)  # the commit finished before the stop took effect
    assert new.to_json() != old.to_json()
    assert sorted(p.name for p in out.iterdir()) == sorted([s.name for s in new.shards] + ["manifest.json"])
    ld = loader(out, seq_length=16, micro_batch_size=1, global_batch_size=1)
    assert ld.samples_per_epoch == new.num_samples("train")
    it = iter(ld)  # dp 1: every shard read whole, its sha256 checked against the new manifest
    for _ in range(ld.samples_per_epoch):
        next(it)


# --------------------------------------------------------------------------- 7. an empty corpus
@pytest.mark.parametrize("files", [{"empty.txt": ""}, {"blank.jsonl": '{"text": ""}\n{"text": ""}\n'},
                                   {"a.txt": "\n\n", "b.jsonl": '{"text": ""}\n'}],
                         ids=["empty-txt", "empty-texts-jsonl", "two-files"])
def test_training_a_tokenizer_on_no_text_says_so(tmp_path, files):
    """It said: sentencepiece training failed: INTERNAL: src/trainer_interface.cc(467) [!sentences_.empty()]"""
    paths = []
    for name, text in files.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(text)
    with pytest.raises(DataError) as e:
        train_tokenizer(paths, tmp_path / "tok", 400, progress=False)
    message = one_line(e, "no text to train a tokenizer on")
    assert message.startswith(", ".join(map(str, paths)) + ": ")
    assert not list(tmp_path.glob("tok.*"))


# --------------------------------------------------------------------------- 8. a malformed loader state
@pytest.mark.parametrize("change,field", [
    ({"batch_start": "abc"}, "batch_start"), ({"batch_start": None}, "batch_start"),
    ({"batch_start": 24}, "batch_start"), ({"batch_start": 0}, "batch_start"),
    ({"shuffle_buffer": "x"}, "shuffle_buffer"), ({"shuffle_buffer": 0}, "shuffle_buffer"),
    ({"micro_batch_size": "a"}, "micro_batch_size"), ({"global_batch_size": 0}, "global_batch_size"),
    ({"dp_size": 1.5}, "dp_size"), ({"consumed_samples": -16}, "consumed_samples"),
    ({"consumed_samples": 10**30, "batch_start": 10**30}, "consumed_samples"),
    ({"consumed_samples": True}, "consumed_samples"), ({"seed": "3"}, "seed"), ({"seed": None}, "seed"),
    ({"samples_per_epoch": "many"}, "samples_per_epoch"), ({"epoch": -1}, "epoch"), ({"version": "1"}, "version"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_malformed_loader_state_is_refused_by_field(tmp_path, change, field):
    make_dataset(tmp_path, [16] * 4)
    ld = loader(tmp_path)
    it = iter(ld)
    for _ in range(6):  # 1.5 global batches: consumed 12, batch_start 8
        next(it)
    state = {**ld.state_dict(), **change}
    fresh = loader(tmp_path)
    with pytest.raises(DataError) as e:
        fresh.load_state_dict(state)
    assert one_line(e, field).startswith("loader state: ")
    fresh.load_state_dict(ld.state_dict())  # the state as written still loads, and continues the order
    assert np.array_equal(next(iter(fresh))["tokens"], next(it)["tokens"])


# --------------------------------------------------------------------------- build-corpus --max-bytes too small
def test_a_corpus_size_no_document_fits_says_so(tmp_path):
    """--max-bytes 10 said "no standard-library documents found", though there were some."""
    from data_pipeline.corpus import build_default_corpus
    root = tmp_path / "lib"
    root.mkdir()
    (root / "mod.py").write_text('"""A module."""\nx = 1\n')
    with pytest.raises(DataError) as e:
        build_default_corpus(tmp_path / "c.jsonl", 10, root=root, progress=False)
    one_line(e, "no document fits in max_bytes 10", "--max-bytes")


def test_signals_held_back_during_a_commit_are_all_delivered_and_never_hide_its_error():
    """SIGINT's handler raises: delivered first, it dropped a SIGTERM that came with it; and a failure
    of the commit itself was replaced by the KeyboardInterrupt of a Ctrl-C that arrived meanwhile."""
    import signal

    from data_pipeline._io import signals_deferred

    delivered = []

    def on_term(signum, frame):
        delivered.append("SIGTERM")

    def on_int(signum, frame):
        delivered.append("SIGINT")
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term), signal.signal(signal.SIGINT, on_int)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
                assert delivered == []  # held back
        assert delivered == ["SIGTERM", "SIGINT"]
        delivered.clear()
        with pytest.raises(DataError, match="the commit failed"):
            with signals_deferred():
                signal.raise_signal(signal.SIGINT)
                raise DataError("out", "the commit failed")
        assert delivered == []
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])


# ----------------------------------------------------------------------------- review findings (2026-12-02)
def test_a_url_pattern_webdataset_cannot_expand_is_one_line(tmp_path, monkeypatch):
    """Unbalanced braces and a ${X} without its WDS_X variable were webdataset's own exceptions (on one
    node only, the other ranks waited for the set-up's pooling)."""
    make_dataset(tmp_path / "d", [4, 4])
    monkeypatch.delenv("WDS_DATA", raising=False)
    for pattern, needle in ((f"{tmp_path}/d/syn-train-{{000000..000001.tar", "UnbalancedBracesError"),
                            ("pipe:cat ${DATA}/syn-train-{000000..000001}.tar", "AssertionError")):
        with pytest.raises(DataError) as info:
            loader(pattern)
        one_line_of(info, pattern, "cannot expand the URL pattern", needle)


@pytest.mark.parametrize("text,needle", [("1" * 5001, "digits"), ("[" * 100000 + "]" * 100000, "recursion")])
def test_json_a_reader_cannot_hold_is_one_line(tmp_path, text, needle):
    """Valid JSON with an integer past Python's digit limit, or nested past the stack, escaped the
    manifest, checkpoint meta.json and consolidated meta.json readers as ValueError / RecursionError."""
    from ascender_dist.tools.convert import ConversionError, read_json_file
    from ascender_dist.training.checkpoint import CheckpointError, read_meta

    big = text if needle == "recursion" else '{"seq_length": %s}' % text
    (tmp_path / "manifest.json").write_text(big)
    with pytest.raises(DataError) as info:
        load_manifest(tmp_path)
    one_line_of(info, "unreadable manifest", needle)
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "meta.json").write_text(big)
    with pytest.raises(CheckpointError) as info:
        read_meta(tmp_path, "step_1")
    one_line_of(info, "meta.json: unreadable", needle)
    with pytest.raises(ConversionError) as info:
        read_json_file(tmp_path / "step_1" / "meta.json")
    one_line_of(info, "JSON this reader cannot hold", needle)


def test_a_str_document_with_a_lone_surrogate_is_named(tmp_path, tiny_tokenizer):  # noqa: F811
    """The JSON readers refuse a lone surrogate; a str document passed to write_shards reached the
    tokenizer, whose TypeError named neither the document nor the character."""
    with pytest.raises(DataError) as info:
        write_shards(["ok text here", "bad \ud800 text"], tiny_tokenizer, tmp_path / "out", seq_length=16)
    one_line_of(info, "documents[1]: lone surrogate \\ud800 at character 4 is not valid Unicode")
    assert not (tmp_path / "out" / "manifest.json").exists()
