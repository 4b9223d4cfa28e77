"""Corpus formats: parquet, .jsonl.gz, .jsonl.zst, datasets directories, globs and directories.

The reference is the plain Python list of documents each file was written from; every reader
must give back exactly that list, and a bad record or file must be one line naming file + row/line
with nothing left behind in the output directory.
"""

from __future__ import annotations

import gzip
import json
from functools import partial

import pytest

from data_pipeline.errors import DataError
from data_pipeline.formats import Piece, expand_inputs, iter_documents, iter_piece
from data_pipeline.shards import load_manifest, write_shards
from data_pipeline.tokenizer import train_tokenizer

from tests.helpers.errors import one_line as one_line_of

from .data_fixtures import TEXT, tar_of, tiny_tokenizer, text_file  # noqa: F401

# the [data] extra is part of [dev]: a missing package fails collection instead of skipping the module
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import zstandard as zstd  # noqa: E402

DOCS = [f"doc {i}: " + TEXT[: 40 + 23 * i] + "\u00e9\u65e5\n" for i in range(60)]


def jsonl_bytes(docs, field="text") -> bytes:
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_zst(path, data: bytes, frames: int = 1) -> None:
    """``frames`` concatenated zstd frames (as pzstd / multi-threaded writers produce)."""
    c = zstd.ZstdCompressor(level=3)
    step = -(-len(data) // frames)
    path.write_bytes(b"".join(c.compress(data[i:i + step]) for i in range(0, len(data), step)))


def write_parquet(path, docs, field="text", row_group_size=7) -> None:
    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size)


@pytest.fixture
def corpus_files(tmp_path):
    """The same DOCS in every format."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(jsonl_bytes(DOCS))
    with gzip.open(d / "b.jsonl.gz", "wb") as f:
        f.write(jsonl_bytes(DOCS))
    write_zst(d / "c.jsonl.zst", jsonl_bytes(DOCS), frames=3)
    write_parquet(d / "d.parquet", DOCS, field="content")
    return d


def test_every_format_reads_back_its_documents(corpus_files):
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        assert list(iter_documents([corpus_files / name])) == DOCS, name
    assert list(iter_documents([corpus_files / "d.parquet"], text_field="content")) == DOCS


def test_datasets_directory_and_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "hf"))
    assert list(iter_documents([tmp_path / "hf"], text_field="body")) == DOCS
    dd = datasets.DatasetDict({"train": ds.select(range(40)), "test": ds.select(range(40, 60))})
    dd.save_to_disk(str(tmp_path / "hfdict"))
    assert list(iter_documents([tmp_path / "hfdict"], text_field="body")) == DOCS
    with pytest.raises(DataError) as e:
        list(iter_documents([tmp_path / "hf"]))
    assert 'no column "text"' in str(e.value) and str(tmp_path / "hf") in str(e.value)


def test_globs_and_directories_expand_sorted(tmp_path, corpus_files):
    (corpus_files / "sub").mkdir()
    (corpus_files / "sub" / "e.txt").write_text("plain text document\n")
    (corpus_files / "notes.csv").write_text("ignored in a directory walk")
    (corpus_files / ".hidden.jsonl").write_text("{broken")
    files = expand_inputs([corpus_files])
    assert [p.relative_to(corpus_files).as_posix() for p in files] == [
        "a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "sub/e.txt"]
    assert expand_inputs([str(corpus_files / "*.jsonl*")]) == files[:3]
    with pytest.raises(DataError) as e:
        expand_inputs([str(tmp_path / "nothing-*.jsonl")])
    assert "no input files match" in str(e.value)


def test_shards_from_every_format_are_identical(tmp_path, corpus_files, tiny_tokenizer):
    ref = write_shards([corpus_files / "a.jsonl"], tiny_tokenizer, tmp_path / "ref", 16, samples_per_shard=20,
                       progress=False)
    for name, field in (("b.jsonl.gz", "text"), ("c.jsonl.zst", "text"), ("d.parquet", "content")):
        m = write_shards([corpus_files / name], tiny_tokenizer, tmp_path / name, 16, samples_per_shard=20,
                         progress=False, text_field=field)
        assert [s.sha256 for s in m.shards] == [s.sha256 for s in ref.shards], name


def test_jsonl_byte_ranges_partition_the_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(jsonl_bytes(DOCS))
    size = p.stat().st_size
    for cuts in ([0, size], [0, 1, 2, size], [0, 100, 101, 5000, size], list(range(0, size, 97)) + [size]):
        got = [t for lo, hi in zip(cuts, cuts[1:]) for t in iter_piece(Piece(str(p), lo, hi))]
        assert got == DOCS, cuts


def test_parquet_row_group_ranges(tmp_path):
    p = tmp_path / "d.parquet"
    write_parquet(p, DOCS, row_group_size=7)  # 9 row groups
    got = [t for lo, hi in ((0, 2), (2, 3), (3, -1)) for t in iter_piece(Piece(str(p), lo, hi))]
    assert got == DOCS


# ------------------------------------------------------------------ bad records and files
one_line = partial(one_line_of, kind=DataError)


def test_tar_members_are_read_like_files_of_their_type(tmp_path):
    """.md and .jsonl members are documents (as the same files outside a tar), not silently skipped."""
    tar = tmp_path / "mixed.tar"
    tar.write_bytes(tar_of([("a.txt", DOCS[0].encode()), ("b.md", DOCS[1].encode()),
                            ("c.jsonl", jsonl_bytes(DOCS[2:5])), ("d.json", json.dumps({"text": DOCS[5]}).encode()),
                            ("e.TEXT", DOCS[6].encode())]))
    assert list(iter_documents([tar])) == DOCS[:7]


@pytest.mark.parametrize("member,payload,needle", [
    ("x.png", b"\x89PNG", "unsupported tar member type (supported: .txt, .text, .md, .json, .jsonl, .ndjson)"),
    ("x.jsonl.gz", gzip.compress(jsonl_bytes(DOCS[:2])), "unsupported tar member type"),
    ("README", b"hello", "unsupported tar member type"),
    ("c.jsonl", jsonl_bytes(DOCS[:2]) + b"{oops\n", "invalid JSON"),
], ids=["png", "jsonl.gz", "no-suffix", "bad-jsonl-line"])
def test_bad_tar_member_names_archive_and_member(tmp_path, member, payload, needle):
    tar = tmp_path / "docs.tar"
    tar.write_bytes(tar_of([("a.txt", b"fine"), (member, payload)]))
    with pytest.raises(DataError) as e:
        list(iter_documents([tar]))
    one_line(e, f"{tar}:{member}", needle)
    if member == "c.jsonl":
        one_line(e, f"{tar}:c.jsonl:3")


HUGE_INT = b'{"text": "x", "n": ' + b"9" * 5000 + b"}\n"
DEEP = b'{"text": "x", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"


@pytest.mark.parametrize("record,needle", [(HUGE_INT, "an integer with too many digits"), (DEEP, "nested too deeply")],
                         ids=["huge-int", "deep"])
def test_well_formed_json_a_reader_cannot_hold_names_file_and_line(tmp_path, record, needle):
    """A ValueError (Python's integer digit limit) or RecursionError traceback naming no file, and
    train-tokenizer blamed it on sentencepiece."""
    p = tmp_path / "a.jsonl"
    p.write_bytes(jsonl_bytes(DOCS[:1]) + record)
    with pytest.raises(DataError) as e:
        list(iter_documents([p]))
    one_line(e, "a.jsonl:2", f"JSON this reader cannot hold ({needle})")
    tar = tmp_path / "docs.tar"
    tar.write_bytes(tar_of([("a.json", record.strip())]))
    with pytest.raises(DataError) as e:
        list(iter_documents([tar]))
    one_line(e, f"{tar}:a.json", f"JSON this reader cannot hold ({needle})")


def test_bad_line_in_compressed_jsonl_names_file_and_line(tmp_path):
    data = jsonl_bytes(DOCS[:5]) + b'{"text": 5}\n' + jsonl_bytes(DOCS[:3])
    with gzip.open(tmp_path / "x.jsonl.gz", "wb") as f:
        f.write(data)
    write_zst(tmp_path / "x.jsonl.zst", data)
    for name in ("x.jsonl.gz", "x.jsonl.zst"):
        with pytest.raises(DataError) as e:
            list(iter_documents([tmp_path / name]))
        one_line(e, f"{name}:6", 'string field "text"')


def test_bad_line_in_a_byte_range_names_the_files_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(jsonl_bytes(DOCS[:30]) + b"{broken\n" + jsonl_bytes(DOCS[:2]))
    lo = len(jsonl_bytes(DOCS[:20])) - 3  # mid-line: the range starts at line 21
    with pytest.raises(DataError) as e:
        list(iter_piece(Piece(str(p), lo, -1)))
    one_line(e, "a.jsonl:31", "invalid JSON")


@pytest.mark.parametrize("keep", [0.5, 0.97])
def test_truncated_zst_is_an_error_not_a_shorter_corpus(tmp_path, keep):
    p = tmp_path / "cut.jsonl.zst"
    write_zst(p, jsonl_bytes(DOCS * 20))
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(DataError) as e:
        list(iter_documents([p]))
    one_line(e, "cut.jsonl.zst:", "truncated or corrupt")


def test_truncated_gz_and_garbage_zst(tmp_path):
    with gzip.open(tmp_path / "cut.jsonl.gz", "wb") as f:
        f.write(jsonl_bytes(DOCS * 20))
    data = (tmp_path / "cut.jsonl.gz").read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd at all" * 50)
    for name in ("cut.jsonl.gz", "junk.jsonl.zst"):
        with pytest.raises(DataError) as e:
            list(iter_documents([tmp_path / name]))
        one_line(e, name, "truncated or corrupt")


def test_parquet_null_row_missing_column_and_garbage(tmp_path):
    docs = DOCS[:20]
    docs[13] = None
    write_parquet(tmp_path / "n.parquet", docs, row_group_size=5)
    with pytest.raises(DataError) as e:
        list(iter_documents([tmp_path / "n.parquet"]))
    one_line(e, "n.parquet:row 13", "must be a string")
    with pytest.raises(DataError) as e:
        list(iter_documents([tmp_path / "n.parquet"], text_field="body"))
    one_line(e, "n.parquet", 'no column "body"', "--text-field")
    (tmp_path / "g.parquet").write_bytes(b"PAR1" + b"\0" * 100)
    with pytest.raises(DataError) as e:
        list(iter_documents([tmp_path / "g.parquet"]))
    one_line(e, "g.parquet", "unreadable parquet")


def test_failed_format_leaves_no_shard_or_manifest(tmp_path, tiny_tokenizer):
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl_bytes(DOCS))
    cut = tmp_path / "cut.jsonl.zst"
    write_zst(cut, jsonl_bytes(DOCS * 20))
    cut.write_bytes(cut.read_bytes()[:-40])
    out = tmp_path / "fresh"
    with pytest.raises(DataError):
        write_shards([good, cut], tiny_tokenizer, out, 16, samples_per_shard=5, progress=False)
    assert list(out.iterdir()) == []  # no shard, no manifest, no temp dir
    old = tmp_path / "old"
    m = write_shards([good], tiny_tokenizer, old, 16, samples_per_shard=5, progress=False)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(DataError):
        write_shards([good, cut], tiny_tokenizer, old, 16, samples_per_shard=5, progress=False)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert load_manifest(old).to_json() == m.to_json()


def test_tokenizer_trains_from_parquet_and_zst(tmp_path, corpus_files):
    a = train_tokenizer([corpus_files / "a.jsonl"], tmp_path / "a", 400, progress=False)
    b = train_tokenizer([corpus_files / "c.jsonl.zst"], tmp_path / "b", 400, progress=False)
    c = train_tokenizer([corpus_files / "d.parquet"], tmp_path / "c", 400, progress=False, text_field="content")
    assert a.read_bytes() == b.read_bytes() == c.read_bytes()


def test_cli_text_field_and_one_line_error(tmp_path, corpus_files, capsys):
    from data_pipeline.cli import main
    assert main(["--quiet", "train-tokenizer", "--input", str(corpus_files / "d.parquet"), "--text-field", "content",
                 "--out-prefix", str(tmp_path / "tok"), "--vocab-size", "400"]) == 0
    assert main(["--quiet", "shard", "--input", str(corpus_files / "*.parquet"), "--text-field", "content",
                 "--tokenizer", str(tmp_path / "tok.model"), "--out-dir", str(tmp_path / "ds"),
                 "--seq-length", "16"]) == 0
    assert load_manifest(tmp_path / "ds").num_documents == len(DOCS)
    capsys.readouterr()
    assert main(["--quiet", "shard", "--input", str(corpus_files / "d.parquet"), "--tokenizer",
                 str(tmp_path / "tok.model"), "--out-dir", str(tmp_path / "ds2"), "--seq-length", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and 'no column "text"' in err and "\n" not in err
    assert not (tmp_path / "ds2" / "manifest.json").exists()


def test_tokenizer_reads_text_files_line_by_line(tmp_path):
    """A .txt is streamed to the trainer a line at a time (never whole), with the same result as the
    same text given as one JSON document."""
    from data_pipeline.tokenizer import iter_training_texts
    text = (TEXT * 30).replace("class", "cl\u00e4ss")
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": text}) + "\n")
    stream = iter_training_texts([tmp_path / "t.txt"])
    assert next(stream) == text.splitlines(keepends=True)[0]
    assert "".join(iter_training_texts([tmp_path / "t.txt"])) == text
    a = train_tokenizer([tmp_path / "t.txt"], tmp_path / "a", 400, progress=False)
    b = train_tokenizer([tmp_path / "t.jsonl"], tmp_path / "b", 400, progress=False)
    assert a.read_bytes() == b.read_bytes()
    (tmp_path / "bad.txt").write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    with pytest.raises(DataError) as e:
        list(iter_training_texts([tmp_path / "bad.txt"]))
    one_line(e, "bad.txt:3", "not valid UTF-8")


def test_one_file_reached_twice_is_refused_not_read_twice(tmp_path):
    """Named twice, by another spelling, or through a symlink in a directory: its documents were in
    the corpus two or three times (exit 0)."""
    from data_pipeline.formats import expand_inputs

    (tmp_path / "d" / "sub").mkdir(parents=True)
    a = tmp_path / "d" / "a.jsonl"
    a.write_bytes(jsonl_bytes(DOCS[:2]))
    (tmp_path / "d" / "b.txt").write_text("other")
    for inputs, needle in (([a, a], "input named twice"),
                           ([a, tmp_path / "d" / "sub" / ".." / "a.jsonl"], f"input the same file as {a}"),
                           ([tmp_path / "d", a], "input named twice")):  # the directory holds it
        with pytest.raises(DataError) as e:
            expand_inputs(inputs)
        one_line(e, needle, "its documents would be read twice")
    (tmp_path / "d" / "sub" / "link.jsonl").symlink_to(a)
    with pytest.raises(DataError) as e:
        expand_inputs([tmp_path / "d"])
    one_line(e, str(tmp_path / "d" / "sub" / "link.jsonl"), f"input the same file as {a}")
    (tmp_path / "d" / "sub" / "link.jsonl").unlink()
    assert expand_inputs([tmp_path / "d"]) == [a, tmp_path / "d" / "b.txt"]
