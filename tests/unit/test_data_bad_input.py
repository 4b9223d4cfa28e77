"""Every bad input stops with a one-line DataError naming the file/shard, or is skipped when asked."""

from __future__ import annotations

import errno
import functools
import json
import logging

import pytest

from data_pipeline.errors import DataError
from data_pipeline.loader import MixtureLoader
from data_pipeline.shards import load_manifest, write_shards
from data_pipeline.tokenizer import iter_documents, train_tokenizer

from tests.helpers.errors import one_line as one_line_of

from .data_fixtures import FAKE_SHA, loader, make_dataset, run_global, text_file, tiny_tokenizer  # noqa: F401


one_line_error = functools.partial(one_line_of, kind=DataError)


def drain(ld, n=30):
    it = iter(ld)
    for _ in range(n):
        next(it)


@pytest.fixture(autouse=True)
def no_read_retry_waits(monkeypatch):
    """Lasting I/O errors here go through every retry of data_pipeline.loader._retry_io: without
    the waits (forked loader workers inherit the setting)."""
    monkeypatch.setattr("data_pipeline.loader.IO_BACKOFF_S", 0.0)
    monkeypatch.setattr("data_pipeline.loader.IO_BACKOFF_MAX_S", 0.0)


@pytest.fixture
def ds(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8, 8, 8], val_counts=[4])
    return tmp_path / "ds"


def test_truncated_tar(ds):
    shard = ds / "syn-train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    with pytest.raises(DataError) as e:
        drain(loader(ds))
    one_line_error(e, "syn-train-000002.tar", "truncated")


def test_corrupt_tar_same_size(ds):
    shard = ds / "syn-train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600:900] = b"\xff" * 300
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        drain(loader(ds))
    one_line_error(e, "syn-train-000001.tar", "sha256 mismatch")


def test_garbage_tar_without_manifest(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8])
    (tmp_path / "ds" / "syn-train-000001.tar").write_bytes(b"this is not a tar file" * 40)
    with pytest.raises(DataError) as e:
        loader(str(tmp_path / "ds" / "syn-train-{000000..000001}.tar"))
    one_line_error(e, "syn-train-000001.tar", "corrupt tar")


def test_a_compressed_shard_is_refused_before_it_is_decompressed(tmp_path, monkeypatch):
    """A 200 KB gzip named *.tar inflating to a 200 MB member: webdataset's tar iterator decompressed
    it whole (in every rank and loader worker) before the shard was found bad."""
    import gzip
    import io
    import tarfile

    make_dataset(tmp_path / "ds", [8, 8])
    bomb = io.BytesIO()
    with tarfile.open(fileobj=bomb, mode="w") as tf:
        info = tarfile.TarInfo("000000.tokens.npy")
        info.size = 50 << 20
        tf.addfile(info, io.BytesIO(bytes(info.size)))
    (tmp_path / "ds" / "syn-train-000001.tar").write_bytes(gzip.compress(bomb.getvalue(), compresslevel=1))
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda *a, **k: pytest.fail("decompressed a member"))
    with pytest.raises(DataError) as e:
        loader(str(tmp_path / "ds" / "syn-train-{000000..000001}.tar"))
    one_line_error(e, "syn-train-000001.tar", "a gzip-compressed file, not a plain tar")


def test_corrupt_shard_skipped_with_warning_and_counter(ds, caplog):
    shard = ds / "syn-train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600:900] = b"\xff" * 300
    shard.write_bytes(bytes(data))
    make = functools.partial(loader, ds, on_corrupt="skip")
    with caplog.at_level(logging.WARNING, logger="data_pipeline.loader"):
        ids_dp1, _ = run_global(make, 1, 12)
    assert "syn-train-000001.tar" in caplog.text
    assert not set(ids_dp1) & set(range(8, 16))  # nothing from the bad shard
    ids_dp2, _ = run_global(make, 2, 12)
    assert ids_dp2 == ids_dp1  # still a pure function of the index, same batch count on every rank
    ld = loader(ds, on_corrupt="skip")
    drain(ld, 20)
    assert ld.skipped_shards == 1


def test_missing_shard_error_and_skip(ds):
    (ds / "syn-train-000003.tar").unlink()
    with pytest.raises(DataError) as e:
        loader(ds)
    one_line_error(e, "syn-train-000003.tar", "missing shard")
    ld = loader(ds, on_corrupt="skip")
    # kept in the order (its slots filled from the next healthy shard), so its place does not move
    assert ld.skipped_shards == 1 and ld.samples_per_epoch == 32
    drain(ld, 20)


def test_missing_shard_behind_pipe_url(ds):
    with pytest.raises(DataError) as e:
        drain(loader("pipe:cat " + str(ds / "syn-train-{000000..000004}.tar")))
    one_line_error(e, "syn-train-000004.tar", "cannot read")


def _pread_fails_for(monkeypatch, name: str) -> None:
    """Every positioned read of shard ``name`` raises EIO (the loader's own ``_open_local`` and
    ``_pread`` wrapped: descriptors of that file fail, any other reads as usual)."""
    from data_pipeline import loader as loader_mod

    bad: set[int] = set()
    real_open, real_pread = loader_mod._open_local, loader_mod._pread

    def open_local(path):
        fd = real_open(path)
        (bad.add if path.name == name else bad.discard)(fd)
        return fd

    def pread(fd, offset, length):
        if fd in bad:
            raise OSError(errno.EIO, "Input/output error")
        return real_pread(fd, offset, length)

    monkeypatch.setattr(loader_mod, "_open_local", open_local)
    monkeypatch.setattr(loader_mod, "_pread", pread)


def test_io_error_in_a_partial_read_is_one_line(ds, monkeypatch):
    _pread_fails_for(monkeypatch, "syn-train-000001.tar")
    with pytest.raises(DataError) as e:
        run_global(functools.partial(loader, ds), 2, 12)  # dp 2: positioned reads of each rank's rows
    one_line_error(e, "syn-train-000001.tar", "cannot read shard (OSError: [Errno 5] Input/output error)")


def test_io_error_in_a_partial_read_is_skipped_in_skip_mode(ds, monkeypatch):
    _pread_fails_for(monkeypatch, "syn-train-000001.tar")
    loaders = []

    def make(**kw):
        loaders.append(loader(ds, on_corrupt="skip", **kw))
        return loaders[-1]

    ids, _ = run_global(make, 2, 12)  # dp 2, 96 samples: every shard read by both ranks
    assert len(ids) == 96 and not set(ids) & set(range(8, 16))  # nothing from the unreadable shard
    assert all(ld.skipped_shards >= 1 for ld in loaders)


def test_unreadable_shard_path_is_one_line_or_skipped(ds):
    """A stat() that fails otherwise than "not found" (here: a path through a regular file) is the
    same skippable corrupt-shard line, found at construction."""
    (ds / "afile").write_text("not a directory")
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][1]["name"] = "afile/syn-train-000001.tar"
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as e:
        loader(ds)
    one_line_error(e, "afile/syn-train-000001.tar", "cannot read shard (NotADirectoryError")
    ld = loader(ds, on_corrupt="skip")
    assert ld.skipped_shards == 1 and ld.samples_per_epoch == 32  # its slots are filled from the next shard


def test_tokenizer_hash_mismatch_manifest(ds):
    with pytest.raises(DataError) as e:
        loader(ds, tokenizer_sha256="a" * 64)
    one_line_error(e, "manifest.json", "tokenizer mismatch")


def test_tokenizer_hash_mismatch_in_shard(tmp_path, ds):
    make_dataset(tmp_path / "other", [8], tokenizer_sha256="b" * 64)
    (tmp_path / "other" / "syn-train-000000.tar").replace(ds / "syn-train-000002.tar")
    m = load_manifest(ds)
    m.shards[2].sha256, m.shards[2].bytes = load_manifest(tmp_path / "other").shards[0].sha256, None
    m.save(ds / "manifest.json")
    with pytest.raises(DataError) as e:
        drain(loader(ds, on_corrupt="skip"))  # a wrong tokenizer is never silently skipped
    one_line_error(e, "syn-train-000002.tar", "tokenizer mismatch")


def test_token_id_out_of_vocab(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8, 8], vocab_size=20)  # sample ids 0..23 are stored as tokens
    with pytest.raises(DataError) as e:
        drain(loader(tmp_path / "ds"))
    one_line_error(e, ".tar", "token id", ">= vocab size 20")


def test_dataset_vocab_larger_than_run_vocab(ds):
    with pytest.raises(DataError) as e:
        loader(ds, vocab_size=5)
    one_line_error(e, "manifest.json", "vocab size 300 > run's vocab size 5")


def test_empty_shard(tmp_path):
    make_dataset(tmp_path / "ds", [8, 0, 8])
    with pytest.raises(DataError) as e:
        loader(tmp_path / "ds")
    one_line_error(e, "syn-train-000001.tar", "empty shard")
    assert loader(tmp_path / "ds", on_corrupt="skip").samples_per_epoch == 16


def test_empty_shard_by_url(tmp_path):
    make_dataset(tmp_path / "ds", [8, 0])
    with pytest.raises(DataError) as e:
        loader(str(tmp_path / "ds" / "syn-train-{000000..000001}.tar"))
    one_line_error(e, "syn-train-000001.tar", "empty shard")


def test_seq_length_mismatch(ds):
    with pytest.raises(DataError) as e:
        loader(ds, seq_length=16)
    one_line_error(e, "manifest.json", "seq_length")


def test_manifest_missing_and_unreadable(tmp_path):
    with pytest.raises(DataError) as e:
        load_manifest(tmp_path / "nope.json")
    one_line_error(e, "nope.json", "not found")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        load_manifest(tmp_path / "bad.json")
    one_line_error(e, "bad.json", "unreadable")


def test_non_utf8_text_file(tmp_path, tiny_tokenizer):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    with pytest.raises(DataError) as e:
        list(iter_documents([bad]))
    one_line_error(e, "latin1.txt", "not valid UTF-8")
    with pytest.raises(DataError) as e:
        train_tokenizer([bad], tmp_path / "tok2", 300, progress=False)
    one_line_error(e, "latin1.txt", "UTF-8")
    with pytest.raises(DataError) as e:
        write_shards([bad], tiny_tokenizer, tmp_path / "out", 8, progress=False)
    one_line_error(e, "latin1.txt", "UTF-8")


def test_bad_jsonl_line(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text(json.dumps({"text": "ok"}) + "\n{broken\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        list(iter_documents([p]))
    one_line_error(e, "docs.jsonl:2", "invalid JSON")


@pytest.mark.parametrize("weight", [0, -1.0, float("nan")])
def test_mixture_weight_must_be_positive(ds, tmp_path, weight):
    make_dataset(tmp_path / "b", [8, 8], first_id=1000)
    with pytest.raises(DataError) as e:
        MixtureLoader([(ds, 1.0), (tmp_path / "b", weight)], seq_length=8, micro_batch_size=2,
                      global_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    one_line_error(e, str(tmp_path / "b"), "weight must be > 0")


def test_failed_shard_write_keeps_previous_dataset(tmp_path, tiny_tokenizer, text_file):
    out = tmp_path / "out"
    m1 = write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=20, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def docs():
        yield text_file.read_text()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):  # the injected failure, not another one
        write_shards(docs(), tiny_tokenizer, out, 16, samples_per_shard=20, progress=False)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after == before and load_manifest(out).to_json() == m1.to_json()


@pytest.mark.parametrize("sidecar,needle", [
    ("[]", "tokenizer sidecar must be a JSON object, got list"),
    ('{"pad_vocab_to_multiple_of": "128"}', "pad_vocab_to_multiple_of: must be an integer >= 1"),
    ('{"pad_vocab_to_multiple_of": true}', "pad_vocab_to_multiple_of: must be an integer >= 1"),
    ('{"pad_vocab_to_multiple_of": 0}', "pad_vocab_to_multiple_of: must be an integer >= 1"),
], ids=["list", "str", "bool", "zero"])
def test_malformed_tokenizer_sidecar(tiny_tokenizer, sidecar, needle):
    from data_pipeline.tokenizer import Tokenizer
    side = tiny_tokenizer.model_path.with_suffix(".json")
    side.write_text(sidecar)
    with pytest.raises(DataError) as e:
        Tokenizer.load(tiny_tokenizer.model_path)
    one_line_error(e, str(side), needle)
    assert Tokenizer.load(tiny_tokenizer.model_path, pad_vocab_to_multiple_of=64).padded_vocab_size == 448


@pytest.mark.parametrize("kw,needle", [
    (dict(input_sentence_size=-1), "input_sentence_size must be 0 (every line) or above 100 (got -1)"),
    (dict(input_sentence_size=1.5), "input_sentence_size must be 0 (every line) or above 100 (got 1.5)"),
    (dict(input_sentence_size=100), "input_sentence_size must be 0 (every line) or above 100 (got 100)"),  # was
    # sentencepiece's "INTERNAL: src/trainer_interface.cc(102) [...input_sentence_size() > 100]"
    (dict(pad_vocab_to_multiple_of=0), "pad_vocab_to_multiple_of: must be an integer >= 1"),
    (dict(vocab_size=100, model_type="word"), "vocab_size 100: below the 261 pieces a word model reserves (4 special "
                                              "ids, 1 user-defined symbol(s), 256 byte pieces): use more"),  # was
    # sentencepiece's "INTERNAL: src/word_model_trainer.cc(48) [(vocab_size) >= (0)]"
], ids=["negative-sentences", "fractional-sentences", "100-sentences", "zero-pad-multiple", "word-below-reserved"])
def test_bad_tokenizer_training_setting(tmp_path, text_file, kw, needle):
    kw = {"vocab_size": 300, **kw}
    with pytest.raises(DataError) as e:
        train_tokenizer([text_file], tmp_path / "tok", progress=False, **kw)
    one_line_error(e, needle if needle.startswith("vocab_size") else str(tmp_path / "tok"), needle)
    assert not list(tmp_path.glob("tok.*"))


def test_a_vocabulary_smaller_than_asked_is_logged(tmp_path, text_file, caplog):
    """sentencepiece stops where the corpus has no more pieces: 100000 asked gave a few hundred, silently."""
    with caplog.at_level("WARNING", logger="data_pipeline.tokenizer"):
        model = train_tokenizer([text_file], tmp_path / "tok", 100_000, progress=False)
    assert any(r.getMessage().startswith(f"{model}: vocab_size 100000 asked, the corpus gave ") for r in caplog.records)


def test_not_a_tokenizer_model(tmp_path):
    from data_pipeline.tokenizer import Tokenizer
    (tmp_path / "x.model").write_bytes(b"garbage")
    with pytest.raises(DataError) as e:
        Tokenizer.load(tmp_path / "x.model")
    one_line_error(e, "x.model", "not a sentencepiece model")


def _edit_manifest(ds, edit):
    path = ds / "manifest.json"
    raw = json.loads(path.read_text())
    raw = edit(raw)
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("edit,needles", [
    (lambda m: {**m, "version": "1"}, ["version: expected an integer", "'1'"]),
    (lambda m: {**m, "seq_length": "8"}, ["seq_length: expected an integer"]),
    (lambda m: {**m, "tokenizer_sha256": 5}, ["tokenizer_sha256: expected a string"]),
    (lambda m: {**m, "shards": [{**m["shards"][0], "num_samples": "8"}] + m["shards"][1:]},
     ["shards[0].num_samples: expected an integer"]),
    (lambda m: {**m, "shards": ["syn-train-000000.tar"]}, ["shards[0]: expected an object"]),
    (lambda m: {**m, "shards": 3}, ["shards: expected a list"]),
    (lambda m: [m], ["manifest must be a JSON object"]),
    (lambda m: {**m, "shards": m["shards"][:4] + [{**m["shards"][4], "split": "validation"}]},
     ['shards[4].split: must be "train" or "val" (got \'validation\')']),
    (lambda m: {**m, "shards": [{**m["shards"][0], "split": "Train"}] + m["shards"][1:]},
     ['shards[0].split: must be "train" or "val" (got \'Train\')']),
    (lambda m: {**m, "shards": m["shards"] + [m["shards"][1]]},
     ["shards[5].name: 'syn-train-000001.tar' is already shards[1]"]),
    (lambda m: {**m, "shards": m["shards"][:2] + [{**m["shards"][2], "foo": 1, "bar": 2}] + m["shards"][3:]},
     ["shards[2]: unknown field(s) 'bar', 'foo'"]),
    (lambda m: {**m, "shards": [{k: v for k, v in m["shards"][0].items() if k != "bytes"}] + m["shards"][1:]},
     ["shards[0]: missing field(s) 'bytes'"]),
    (lambda m: {**m, "version": 2, "shards": [{**m["shards"][0], "new_field": 1}] + m["shards"][1:]},
     ["manifest version 2 is newer than this code"]),
], ids=["version-str", "seq_length-str", "sha-int", "num_samples-str", "shard-str", "shards-int", "list",
        "split-validation", "split-Train", "duplicate-name", "unknown-field", "missing-field", "newer-version"])
def test_manifest_field_types(ds, edit, needles):
    path = _edit_manifest(ds, edit)
    with pytest.raises(DataError) as e:
        load_manifest(path)
    one_line_error(e, str(path), *needles)


@pytest.mark.parametrize("name", ["pipe:touch PWNED", "https://example.com/x.tar", "/etc/passwd", "../x.tar",
                                  "sub/../../x.tar", "-rf.tar", "a\nb.tar", ""])
def test_a_shard_name_that_is_not_a_relative_file_path_is_refused(ds, name, monkeypatch):
    """'pipe:cmd' in a manifest someone else wrote was read as a pipe: URL (cmd ran on every rank);
    '/abs' and '../x' read files outside the dataset."""
    monkeypatch.chdir(ds)
    path = _edit_manifest(ds, lambda m: {**m, "shards": [{**m["shards"][0], "name": name}] + m["shards"][1:]})
    with pytest.raises(DataError) as e:
        load_manifest(path)
    one_line_error(e, str(path), f"shards[0].name: {name!r}")
    assert not (ds / "PWNED").exists()


@pytest.mark.parametrize("name", ["a.tar; touch PWNED", "x.tar`touch PWNED`", "$(touch PWNED).tar", "x.tar|id",
                                  "a b.tar", "données.tar"])
def test_a_name_with_shell_syntax_never_reaches_a_url_templates_command(ds, name, monkeypatch):
    """Pasted into the documented 'pipe:aws s3 cp s3://bucket/{name} -', such a name ran its command;
    read locally (no template) it is only a file name."""
    monkeypatch.chdir(ds)
    path = _edit_manifest(ds, lambda m: {**m, "shards": [{**m["shards"][0], "name": name}] + m["shards"][1:]})
    manifest = load_manifest(path)
    assert manifest.shard_url(manifest.shards[0]) == str(ds / name)
    with pytest.raises(DataError) as e:
        manifest.shard_url(manifest.shards[0], "pipe:cat /b/{name}")
    one_line_error(e, f"shard {name!r}: a name passed to a url_template must hold only")
    assert not (ds / "PWNED").exists()


def test_shard_names_in_subdirectories_and_other_scripts_stay_readable(ds):
    """A dataset written with a prefix such as 'données' or 'my corpus' (accepted by the writer) loads."""
    (ds / "sub").mkdir()
    first = json.loads((ds / "manifest.json").read_text())["shards"][0]["name"]
    (ds / first).rename(ds / "sub" / f"données {first}")
    path = _edit_manifest(ds, lambda m: {**m, "shards": [{**m["shards"][0], "name": f"sub/données {first}"}]
                                         + m["shards"][1:]})
    manifest = load_manifest(path)
    assert manifest.shard_url(manifest.shards[0]) == str(ds / "sub" / f"données {first}")


def test_the_writer_refuses_a_prefix_its_manifest_could_not_name(tmp_path, tiny_tokenizer, text_file):
    with pytest.raises(DataError) as e:
        write_shards([text_file], tiny_tokenizer, tmp_path / "ds", 16, samples_per_shard=20, prefix="pipe:x",
                     progress=False)
    one_line_error(e, "prefix 'pipe:x': a shard name it makes is not a relative file path")


def _rewrite_shard_meta(ds, meta):
    """Replace train shard 0 by one whose meta.json record is ``meta`` (manifest checksum updated)."""
    import numpy as np

    from data_pipeline._io import sha256_bytes
    from data_pipeline.shards import encode_shard

    from .data_fixtures import SEQ, sample_tokens
    shard = ds / "syn-train-000000.tar"
    data = encode_shard([sample_tokens(k, SEQ) for k in range(8)], np.dtype(np.uint16), meta)
    shard.write_bytes(data)
    _edit_manifest(ds, lambda m: {**m, "shards": [{**m["shards"][0], "sha256": sha256_bytes(data),
                                                   "bytes": len(data)}] + m["shards"][1:]})
    return shard


@pytest.mark.parametrize("meta,needle", [
    ([1, 2], "meta.json must be a JSON object, got list"),
    ("hello", "meta.json must be a JSON object, got str"),
    ({"seq_length": "8"}, "meta.json seq_length: expected an integer"),
    ({"vocab_size": "4096"}, "meta.json vocab_size: expected an integer"),
], ids=["list", "str", "seq_length-str", "vocab-str"])
def test_shard_meta_json_types(ds, meta, needle):
    shard = _rewrite_shard_meta(ds, meta)
    with pytest.raises(DataError) as e:
        drain(loader(ds, shuffle_buffer=64))
    one_line_error(e, shard.name, needle)


@pytest.mark.parametrize("src", ["", []])
def test_unset_manifest_names_the_setting(src):
    with pytest.raises(DataError) as e:
        loader(src)
    msg = one_line_error(e, "data.manifest: not set", "data.mixture")  # not "manifest.json: not found"
    assert not msg.startswith("manifest.json")


@pytest.mark.parametrize("template", ["pipe:cat {nam}", "pipe:cat {name", "pipe:cat data.tar"])
def test_bad_url_template(ds, template):
    with pytest.raises(DataError) as e:
        loader(ds, url_template=template)
    one_line_error(e, "url_template")


def test_shard_out_dir_is_a_file(tmp_path, tiny_tokenizer, text_file):
    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(DataError) as e:
        write_shards([text_file], tiny_tokenizer, target, 16, progress=False)
    one_line_error(e, str(target), "existing file")
    assert target.read_text() == "x"


def test_corrupt_shard_through_worker_processes(ds):
    """Errors raised in a loader worker process arrive as the same one-line DataError / skip."""
    shard = ds / "syn-train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600:900] = b"\xff" * 300
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        drain(loader(ds, num_workers=2))
    one_line_error(e, "syn-train-000001.tar", "sha256 mismatch")
    ref, _ = run_global(functools.partial(loader, ds, on_corrupt="skip"), 1, 12)
    got, _ = run_global(functools.partial(loader, ds, on_corrupt="skip", num_workers=2), 2, 12)
    assert got == ref
