"""Parallel sharding: worker processes and disjoint jobs + merge give the single-process dataset,
byte for byte; an unfinished or failed job leaves nothing that a loader could mistake for data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.cli import main
from data_pipeline.errors import DataError
from data_pipeline.formats import Piece, iter_documents, iter_piece
from data_pipeline.parallel import PARTS_DIR, merge, partition, run_job, shard_settings, write_shards_parallel
from data_pipeline.shards import load_manifest, write_shards

from .data_fixtures import TEXT, tiny_tokenizer, text_file  # noqa: F401

# the [data] extra is part of [dev]: a missing package fails collection instead of skipping the module
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import zstandard as zstd  # noqa: E402

DOCS = [f"{i}: " + TEXT[(7 * i) % 200: (7 * i) % 200 + 30 + 11 * (i % 13)] for i in range(120)]


@pytest.fixture
def inputs(tmp_path):
    """Documents spread over splittable (.jsonl, .parquet) and whole (.txt, .zst) inputs."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:50]))
    (d / "b.txt").write_text(DOCS[50])
    pq.write_table(pa.table({"text": DOCS[51:90]}), d / "c.parquet", row_group_size=4)
    (d / "d.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in DOCS[90:]).encode()))
    return [d / "a.jsonl", d / "b.txt", d / "c.parquet", d / "d.jsonl.zst"]


def test_partition_keeps_every_document_in_order(inputs):
    assert list(iter_documents(inputs)) == DOCS
    pieces = [Piece(str(p)) for p in inputs]
    for n in (1, 2, 3, 5, 8):
        parts = partition(pieces, n)
        assert len(parts) == n
        assert [t for part in parts for piece in part for t in iter_piece(piece)] == DOCS, n
        for part in parts:  # and again one level down, as a job's workers split it
            sub = partition(part, 3) if part else [[], [], []]
            assert [t for s in sub for p in s for t in iter_piece(p)] == [t for p in part for t in iter_piece(p)]


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_workers_and_jobs_give_the_single_process_dataset(tmp_path, inputs, tiny_tokenizer):
    kw = dict(samples_per_shard=7, val_fraction=0.1)
    ref = write_shards(inputs, tiny_tokenizer, tmp_path / "ref", 16, progress=False, **kw)
    assert len(ref.shards) > 5
    two = write_shards_parallel(inputs, tiny_tokenizer, tmp_path / "w2", 16, workers=2, **kw)
    assert two.to_json() == ref.to_json()
    assert shard_bytes(tmp_path / "w2") == shard_bytes(tmp_path / "ref")
    out = tmp_path / "jobs"
    settings = shard_settings(16, 7, None, 0.1, "shard")
    for job, workers in ((2, 1), (0, 2), (1, 1)):  # any order, any workers per job
        run_job(inputs, tiny_tokenizer, out / PARTS_DIR, settings, job_index=job, job_count=3, workers=workers)
    m = merge(out, workers=2)
    assert m.to_json() == ref.to_json() and shard_bytes(out) == shard_bytes(tmp_path / "ref")
    assert not (out / PARTS_DIR).exists()


def test_merge_refuses_missing_or_foreign_jobs(tmp_path, inputs, tiny_tokenizer):
    out = tmp_path / "jobs"
    settings = shard_settings(16, 7, None, 0.1, "shard")
    run_job(inputs, tiny_tokenizer, out / PARTS_DIR, settings, job_index=0, job_count=2)
    with pytest.raises(DataError) as e:
        merge(out)
    assert "jobs [1] of 2 have not finished" in str(e.value)
    run_job(inputs[:2], tiny_tokenizer, out / PARTS_DIR, settings, job_index=1, job_count=2)  # other inputs
    with pytest.raises(DataError) as e:
        merge(out)
    assert "plan differs" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == [PARTS_DIR]  # no shard, no manifest


def test_failed_job_leaves_no_part_and_no_mark(tmp_path, inputs, tiny_tokenizer):
    bad = tmp_path / "in" / "e.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "{oops\n")
    with pytest.raises(DataError) as e:
        run_job(inputs + [bad], tiny_tokenizer, tmp_path / "p", shard_settings(16, 7, None, 0.1, "shard"),
                job_index=1, job_count=2, workers=2)
    assert str(e.value).startswith(f"{bad}:2: invalid JSON")
    assert list((tmp_path / "p").iterdir()) == []
    with pytest.raises(DataError):
        write_shards_parallel(inputs + [bad], tiny_tokenizer, tmp_path / "o", 16, workers=2)
    assert list((tmp_path / "o").iterdir()) == []


def test_cli_jobs_then_merge(tmp_path, inputs, tiny_tokenizer, capsys):
    model = str(tiny_tokenizer.model_path)
    common = ["--quiet", "shard", "--input", *map(str, inputs), "--tokenizer", model, "--seq-length", "16",
              "--samples-per-shard", "7"]
    assert main(common + ["--out-dir", str(tmp_path / "ref")]) == 0
    for job in (1, 0):
        assert main(common + ["--out-dir", str(tmp_path / "ds"), "--job-index", str(job), "--job-count", "2"]) == 0
    assert main(["--quiet", "merge", str(tmp_path / "ds"), "--workers", "2"]) == 0
    assert load_manifest(tmp_path / "ds").to_json() == load_manifest(tmp_path / "ref").to_json()
    capsys.readouterr()
    assert main(common + ["--out-dir", str(tmp_path / "x"), "--job-index", "2", "--job-count", "2"]) == 2
    assert "--job-index must be in [0, --job-count)" in capsys.readouterr().err


@pytest.mark.parametrize("edit,needle", [
    (lambda m: [], "job mark: expected a JSON object, got list"),
    (lambda m: {}, "job_index: missing"),
    (lambda m: {**m, "job_count": "2"}, "job_count: expected int, got str '2'"),
    (lambda m: {**m, "tokenizer": {**m["tokenizer"], "padded_vocab_size": True}},
     "tokenizer.padded_vocab_size: expected int, got bool True"),
    (lambda m: {**m, "settings": {k: v for k, v in m["settings"].items() if k != "seq_length"}},
     "settings.seq_length: missing"),
    (lambda m: {**m, "parts": [5]}, "parts[0]: expected a JSON object, got int"),
    (lambda m: {**m, "parts": [{**m["parts"][0], "num_tokens": None}]},
     "parts[0].num_tokens: expected int, got NoneType"),
], ids=["list", "empty", "count-str", "tokenizer-bool", "no-seq_length", "part-int", "part-null"])
def test_malformed_job_mark_names_the_file(tmp_path, inputs, tiny_tokenizer, edit, needle):
    out = tmp_path / "jobs"
    mark = run_job(inputs[:2], tiny_tokenizer, out / PARTS_DIR, shard_settings(16, 7, None, 0.1, "shard"))
    mark.write_text(json.dumps(edit(json.loads(mark.read_text()))))
    with pytest.raises(DataError) as e:
        merge(out)
    msg = str(e.value)
    assert msg.startswith(f"{mark}: ") and needle in msg and "\n" not in msg, msg
    assert sorted(p.name for p in out.iterdir()) == [PARTS_DIR]


# --------------------------------------------------------------------------- merge: parts a shard reads
def test_a_shard_task_maps_only_the_parts_its_samples_lie_in(tmp_path, monkeypatch):
    """Each ``_write_shard`` task once memory-mapped every part file (jobs x workers of them, 240 ms
    per shard at 1024 parts) to read the one or two its samples lie in; it maps only those, and the
    shards are the same bytes."""
    import numpy as np

    from data_pipeline import parallel as par
    from data_pipeline.shards import encode_shard

    counts = [10, 0, 7, 25, 3, 0, 12, 30]  # empty parts (no file to map) and samples across part ends
    files = []
    for k, n in enumerate(counts):
        files.append(str(tmp_path / f"p{k}.bin"))
        np.arange(sum(counts[:k]), sum(counts[:k]) + n, dtype=np.uint16).tofile(files[-1])
    stream = np.arange(sum(counts), dtype=np.uint16)
    real, mapped = np.memmap, []
    monkeypatch.setattr(np, "memmap", lambda f, *a, **kw: mapped.append(Path(f).name) or real(f, *a, **kw))
    meta, sample_len = {"seq_length": 4, "vocab_size": 1000}, 5
    for first, count, needs in ((0, 2, ["p0"]), (2, 3, ["p2", "p3"]), (8, 2, ["p3", "p4", "p6"]), (16, 1, ["p7"])):
        mapped.clear()
        path, info = par._write_shard(files, counts, "uint16", meta, first, count, sample_len,
                                      str(tmp_path / f"s{first}.tar"))
        assert sorted(mapped) == [n + ".bin" for n in needs], (first, mapped)
        rows = stream[first * sample_len:(first + count) * sample_len].reshape(count, sample_len)
        assert Path(path).read_bytes() == encode_shard(list(rows), np.dtype("uint16"), meta)
        assert info["num_samples"] == count
