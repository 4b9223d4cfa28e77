"""More bad input that must stop with one line naming the file/shard instead of losing, repeating
or mixing data without a word: tars cut off at a member boundary, empty compressed corpora, an
empty tokenizer model, a shard listed twice, shards of two tokenizers, a shard prefix holding a
directory."""

from __future__ import annotations

import errno
import functools
import gzip
import json
import os

import numpy as np
import pytest

from data_pipeline import loader as loader_mod
from data_pipeline.errors import DataError
from data_pipeline.formats import iter_documents
from data_pipeline.loader import ShardChecks, ShardSpec, read_shard
from data_pipeline.shards import load_manifest, write_shards

from tests.helpers.errors import one_line as one_line_of

from .data_fixtures import ThreadRanks, loader, make_dataset, tar_of, text_file, tiny_tokenizer  # noqa: F401

one_line = functools.partial(one_line_of, kind=DataError)
TRUNCATED = "truncated tar (no end-of-archive marker)"


@pytest.fixture(autouse=True)
def no_read_retry_waits(monkeypatch):
    """Lasting I/O errors go through every retry of data_pipeline.loader._retry_io: no waits."""
    monkeypatch.setattr(loader_mod, "_wait", lambda seconds: None)


def snapshot(directory) -> dict:
    """Every file under ``directory`` (relative path -> bytes)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- tars cut at a member boundary
def cut_shard(path, keep_samples: int) -> None:
    """Cut a 10-sample shard of the writer's layout right after sample ``keep_samples - 1``: a member
    boundary, where Python's tarfile sees a normal end (sample 0 + meta.json, then 2 blocks each)."""
    path.write_bytes(path.read_bytes()[:1024 + 1024 + (keep_samples - 1) * 1024])


@pytest.mark.parametrize("cut", ["member-boundary", "one-end-block", "inside-a-header", "garbage-header"])
def test_shard_without_its_end_of_archive_marker_is_refused(tmp_path, cut):
    make_dataset(tmp_path, [10, 10])
    shard = tmp_path / "syn-train-000001.tar"
    data = shard.read_bytes()
    end = 1024 + 1024 + 9 * 1024  # where the members stop
    shard.write_bytes({"member-boundary": data[:end - 3 * 1024], "one-end-block": data[:end + 512],
                       "inside-a-header": data[:end - 3 * 1024 + 100],
                       "garbage-header": data[:end - 3 * 1024] + b"\x07" * 512 + data[end - 2 * 1024:]}[cut])
    urls = [str(tmp_path / "syn-train-000000.tar"), str(shard)]
    with pytest.raises(DataError) as e:
        loader(urls)  # no manifest: the first scan counts the shards, and must not count 7 of 10
    one_line(e, str(shard), TRUNCATED)
    assert loader(urls, on_corrupt="skip").samples_per_epoch == 10  # a corrupt shard: skippable
    with pytest.raises(DataError) as e:
        read_shard(ShardSpec(str(shard), -1), ShardChecks(8))
    one_line(e, str(shard), TRUNCATED)


def test_whole_shards_in_other_layouts_still_read(tmp_path):
    """The general path (not the writer's layout) accepts a whole tar, record padding or not."""
    row = np.arange(9, dtype=np.uint16)
    from data_pipeline.shards import npy_bytes
    data = tar_of([(f"{i:06d}.tokens.npy", npy_bytes(row + i)) for i in range(3)] + [("000002.txt", b"x")])
    for name, payload in (("padded.tar", data), ("unpadded.tar", data[:3 * 1024 + 1024 + 1024])):
        (tmp_path / name).write_bytes(payload)
        arr = read_shard(ShardSpec(str(tmp_path / name), -1), ShardChecks(8))
        assert arr.tolist() == [(row + i).tolist() for i in range(3)]


CORPUS = [(f"{i}.txt", f"doc {i}".encode()) for i in range(5)]


@pytest.mark.parametrize("name,make,needle", [
    ("cut.tar", lambda t: t[:512 * 2 * 3], TRUNCATED),  # 3 of 5 members, cut at a member boundary
    ("cut-in-header.tar", lambda t: t[:512 * 2 * 3 + 100], TRUNCATED),
    ("one-end-block.tar", lambda t: t[:512 * 2 * 5 + 512], TRUNCATED),
    ("cut.tar.gz", lambda t: gzip.compress(t[:512 * 2 * 3]), TRUNCATED),  # whole gzip of a cut tar
    ("cut-gzip.tgz", lambda t: gzip.compress(t)[:-6], "truncated or corrupt tar"),  # gzip trailer lost
], ids=["boundary", "in-header", "one-end-block", "gz-of-cut-tar", "cut-gzip"])
def test_corpus_tar_without_its_end_is_refused(tmp_path, name, make, needle):
    path = tmp_path / name
    path.write_bytes(make(tar_of(CORPUS)))
    with pytest.raises(DataError) as e:
        list(iter_documents([path]))
    one_line(e, str(path), needle)


@pytest.mark.parametrize("name,make", [("whole.tar", bytes), ("whole.tar.gz", gzip.compress),
                                       ("no-record-padding.tar", lambda t: t[:512 * 2 * 5 + 1024])])
def test_whole_corpus_tars_read_every_document(tmp_path, name, make):
    path = tmp_path / name
    path.write_bytes(make(tar_of(CORPUS)))
    assert list(iter_documents([path])) == [f"doc {i}" for i in range(5)]


# --------------------------------------------------------------------------- empty compressed corpora
@pytest.mark.parametrize("name,unit", [("c.jsonl.gz", "gzip member"), ("d.jsonl.zst", "zstd frame")])
def test_empty_compressed_jsonl_is_refused(tmp_path, name, unit):
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(DataError) as e:
        list(iter_documents([path]))
    one_line(e, str(path), "truncated or corrupt compressed stream", f"empty file: no {unit}")


def test_compressed_empty_corpus_and_plain_empty_files_are_still_empty(tmp_path):
    """A compressed empty stream is a member with no data, not zero bytes; empty .jsonl/.txt keep
    their meaning (no documents / one empty document)."""
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "e.txt").write_bytes(b"")
    assert list(iter_documents([tmp_path / "e.jsonl.gz", tmp_path / "e.jsonl"])) == []
    assert list(iter_documents([tmp_path / "e.txt"])) == [""]


# --------------------------------------------------------------------------- empty tokenizer model
def test_empty_tokenizer_model_is_refused(tmp_path, capsys):
    from data_pipeline.cli import main
    from data_pipeline.tokenizer import Tokenizer
    model = tmp_path / "empty.model"
    model.write_bytes(b"")
    with pytest.raises(DataError) as e:
        Tokenizer.load(model)
    one_line(e, str(model), "not a sentencepiece model (empty file)")
    (tmp_path / "in.txt").write_text("some text\n")
    capsys.readouterr()
    assert main(["--quiet", "shard", "--input", str(tmp_path / "in.txt"), "--tokenizer", str(model),
                 "--out-dir", str(tmp_path / "out"), "--seq-length", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {model}: not a sentencepiece model (empty file)"
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- a shard listed twice
@pytest.fixture
def two_shards(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8])
    (tmp_path / "ds" / "link.tar").symlink_to(tmp_path / "ds" / "syn-train-000000.tar")
    return tmp_path / "ds"


@pytest.mark.parametrize("case", ["same-url", "overlapping-braces", "file-url", "dot-dot", "symlink", "pipe"])
def test_a_shard_listed_twice_in_one_dataset_is_refused_before_any_read(two_shards, monkeypatch, case):
    d = two_shards
    u0, u1 = str(d / "syn-train-000000.tar"), str(d / "syn-train-000001.tar")
    src, twice = {
        "same-url": ([u0, u1, u0], u0),
        "overlapping-braces": ([str(d / "syn-train-{000000..000001}.tar"), str(d / "syn-train-{000001..000001}.tar")],
                               u1),
        "file-url": ([u0, u1, "file:" + u0], "file:" + u0),
        "dot-dot": ([u0, u1, str(d / ".." / d.name / "syn-train-000000.tar")], str(d / ".." / d.name)),
        "symlink": ([u0, u1, str(d / "link.tar")], str(d / "link.tar")),
        "pipe": ([u0, "pipe:cat " + u1, "pipe:cat " + u1], "pipe:cat " + u1),
    }[case]
    real, reads = loader_mod._fetch_bytes, []
    monkeypatch.setattr(loader_mod, "_fetch_bytes", lambda url: reads.append(url) or real(url))
    with pytest.raises(DataError) as e:
        loader(src)
    one_line(e, twice, "shard listed twice")
    assert reads == []  # refused before the first scan read any shard


def test_a_shard_listed_twice_in_a_mixture_dataset_is_refused(two_shards):
    u0, u1 = str(two_shards / "syn-train-000000.tar"), str(two_shards / "syn-train-000001.tar")
    with pytest.raises(DataError) as e:
        loader([([u0, u0], 1.0), ([u1], 1.0)])
    one_line(e, u0, "shard listed twice")
    with pytest.raises(DataError) as e:  # across datasets: x.tar and ./x.tar are one shard too
        loader([([u0], 1.0), ([u1, os.path.relpath(u0)], 1.0)])
    one_line(e, "is also a shard of")


def test_a_manifest_naming_one_file_under_two_spellings_is_refused(two_shards):
    raw = json.loads((two_shards / "manifest.json").read_text())
    raw["shards"].append(dict(raw["shards"][0], name="./" + raw["shards"][0]["name"]))
    (two_shards / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DataError) as e:
        load_manifest(two_shards)
    one_line(e, "manifest.json", "shards[2].name: './syn-train-000000.tar' is already shards[0]")


# --------------------------------------------------------------------------- shards of two tokenizers
@pytest.fixture
def toks(tmp_path):
    """Datasets of tokenizer a (a, c) and of tokenizer b (b)."""
    make_dataset(tmp_path / "a", [8], tokenizer_sha256="a" * 64)
    make_dataset(tmp_path / "b", [8], tokenizer_sha256="b" * 64, first_id=100)
    make_dataset(tmp_path / "c", [8, 8], tokenizer_sha256="a" * 64, first_id=200)
    return tmp_path


@pytest.mark.parametrize("on_corrupt", ["error", "skip"])
def test_url_shards_of_two_tokenizers_are_refused_without_a_run_tokenizer(toks, on_corrupt):
    a0, b0 = str(toks / "a" / "syn-train-000000.tar"), str(toks / "b" / "syn-train-000000.tar")
    with pytest.raises(DataError) as e:
        loader([a0, b0], on_corrupt=on_corrupt)  # a wrong tokenizer is never skipped
    one_line(e, b0, "tokenizer mismatch: shard made with bbbbbbbbbbbb..., ", a0, "aaaaaaaaaaaa...")


@pytest.mark.parametrize("first", ["manifest", "url"])
def test_a_mixture_dataset_of_url_shards_of_another_tokenizer_is_refused(toks, first):
    b0 = str(toks / "b" / "syn-train-000000.tar")
    a = toks / "a" / "manifest.json" if first == "manifest" else str(toks / "a" / "syn-train-000000.tar")
    with pytest.raises(DataError) as e:
        loader([(a, 1.0), (b0, 1.0)])
    one_line(e, b0, "tokenizer mismatch inside the mixture", str(a))


def test_url_shards_of_one_tokenizer_cost_no_extra_read(toks, monkeypatch):
    real, reads = loader_mod._fetch_bytes, []
    monkeypatch.setattr(loader_mod, "_fetch_bytes", lambda url: reads.append(url) or real(url))
    c = str(toks / "c" / "syn-train-{000000..000001}.tar")
    ld = loader([(toks / "a", 1.0), (c, 1.0)])
    assert ld.samples_per_epoch == 24 and len(reads) == 2  # the counting scan's one read per URL shard
    assert ld.datasets[1].checks.tokenizer_sha256 == "a" * 64


def test_ranks_agree_on_a_tokenizer_mismatch_one_rank_alone_could_miss(toks, monkeypatch):
    """Rank 1 cannot read the first shard (tokenizer a) and takes the second's (b) as the reference:
    rank 0 meets the mismatch, and every rank stops with its line."""
    a0, b0 = str(toks / "a" / "syn-train-000000.tar"), str(toks / "b" / "syn-train-000000.tar")
    ranks, real = ThreadRanks(2), loader_mod._fetch_bytes

    def fetch(url):
        if url == a0 and ranks.rank() == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(url)

    monkeypatch.setattr(loader_mod, "_fetch_bytes", fetch)
    errors = ranks.run(lambda r: loader([a0, b0], on_corrupt="skip", all_gather=ranks.all_gather))
    assert all(isinstance(e, DataError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    one_line(errors[0], b0, "tokenizer mismatch", "(found by rank 0)")


# --------------------------------------------------------------------------- shard prefix
@pytest.fixture
def built(tmp_path, tiny_tokenizer, text_file):
    out = tmp_path / "ds"
    write_shards([text_file], tiny_tokenizer, out, 16, samples_per_shard=20, progress=False)
    return out


@pytest.mark.parametrize("prefix", ["sub/x", "", ".", "..", "/abs"])
def test_a_prefix_that_is_not_a_plain_file_name_is_refused_before_any_work(built, tiny_tokenizer, text_file,
                                                                           prefix):
    before = snapshot(built)
    with pytest.raises(DataError) as e:
        write_shards([text_file], tiny_tokenizer, built, 16, samples_per_shard=20, prefix=prefix, progress=False)
    one_line(e, "prefix must be a plain file name", repr(prefix))
    assert snapshot(built) == before  # the old dataset, manifest included, as it was


def test_the_cli_refuses_a_prefix_with_a_directory(built, tiny_tokenizer, text_file, capsys):
    from data_pipeline.cli import main
    before = snapshot(built)
    for extra in ([], ["--job-index", "0", "--job-count", "1"]):
        assert main(["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(tiny_tokenizer.model_path),
                     "--out-dir", str(built), "--seq-length", "16", "--prefix", "sub/x", *extra]) == 2
        assert "prefix must be a plain file name" in capsys.readouterr().err
    assert snapshot(built) == before
    load_manifest(built)


def test_merge_refuses_a_job_mark_with_a_directory_prefix(built, tiny_tokenizer, text_file):
    from concurrent.futures import ThreadPoolExecutor
    from data_pipeline.parallel import PARTS_DIR, merge, run_job, shard_settings
    parts = built / PARTS_DIR
    with ThreadPoolExecutor(1) as pool:  # the job's workers as a thread: no process started
        mark = run_job([text_file], tiny_tokenizer, parts, shard_settings(16, 20, None, 0.05, "shard"), pool=pool)
    record = json.loads(mark.read_text())
    record["settings"]["prefix"] = "sub/x"  # a mark written before prefixes were checked
    mark.write_text(json.dumps(record))
    before = {k: v for k, v in snapshot(built).items() if not k.startswith(PARTS_DIR)}
    with pytest.raises(DataError) as e:
        merge(built)
    one_line(e, "prefix must be a plain file name", "'sub/x'")
    assert {k: v for k, v in snapshot(built).items() if not k.startswith(PARTS_DIR)} == before


def test_a_shard_name_the_file_system_refuses_leaves_the_old_dataset(built, tiny_tokenizer, text_file):
    """A plain name can still fail (too long): the old manifest must not be gone by then."""
    before = snapshot(built)
    with pytest.raises(DataError) as e:
        write_shards([text_file], tiny_tokenizer, built, 16, samples_per_shard=20, prefix="p" * 300,
                     progress=False)
    one_line(e, "p" * 300, "nothing in the output directory was changed")
    assert snapshot(built) == before
    load_manifest(built)
