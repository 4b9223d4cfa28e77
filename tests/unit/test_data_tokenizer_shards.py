"""Corpus builder, tokenizer training/padding, packing and the manifest's checksums."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_pipeline._io import sha256_file
from data_pipeline.corpus import build_default_corpus
from data_pipeline.loader import ShardChecks, ShardSpec, read_shard
from data_pipeline.shards import load_manifest, pack_samples, val_shard_indices, write_shards
from data_pipeline.tokenizer import Tokenizer, padded_size, train_tokenizer

from .data_fixtures import TEXT, loader, text_file, tiny_tokenizer  # noqa: F401


def test_default_corpus_is_deterministic_and_bounded(tmp_path):
    a = build_default_corpus(tmp_path / "a.jsonl", max_bytes=120_000, progress=False)
    b = build_default_corpus(tmp_path / "b.jsonl", max_bytes=120_000, progress=False)
    assert a.read_bytes() == b.read_bytes()
    docs = [json.loads(line) for line in a.read_text().splitlines()]
    assert sum(len(d["text"].encode()) for d in docs) <= 120_000
    assert all(set(d) == {"text", "source"} for d in docs)
    assert docs[0]["source"].startswith("pydoc_data.topics:")


def test_corpus_has_docs_and_sources(tmp_path):
    p = build_default_corpus(tmp_path / "c.jsonl", max_bytes=1_500_000, progress=False)
    sources = {json.loads(line)["source"].split(":")[0] for line in p.read_text().splitlines()}
    assert {"pydoc_data.topics", "docstring", "stdlib"} <= sources


def test_tokenizer_files_sidecar_and_padding(tmp_path, text_file):
    model = train_tokenizer([text_file], tmp_path / "tok", 400, pad_vocab_to_multiple_of=128,
                            user_defined_symbols=["<|endoftext|>"], progress=False)
    side = json.loads((tmp_path / "tok.json").read_text())
    assert model == tmp_path / "tok.model" and (tmp_path / "tok.vocab").exists()
    assert side["sha256"] == sha256_file(model)
    assert side["vocab_size"] == 400 and side["padded_vocab_size"] == 512
    tok = Tokenizer.load(model)
    assert (tok.vocab_size, tok.padded_vocab_size, tok.sha256) == (400, 512, side["sha256"])
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert Tokenizer.load(model, pad_vocab_to_multiple_of=48).padded_vocab_size == 432
    assert Tokenizer.load(model, pad_vocab_to_multiple_of=1).padded_vocab_size == 400
    assert tok.sp.piece_to_id("<|endoftext|>") > 3


def test_padded_size():
    assert [padded_size(v, 128) for v in (1, 128, 129, 32000)] == [128, 128, 256, 32000]
    assert padded_size(50257, 8 * 128) == 51200 and padded_size(77, None) == 77


def test_roundtrip_is_exact_for_code_and_unicode(tiny_tokenizer):
    s = "def f(x):\n\tif x:  # caf\u00e9 \u65e5\u672c\n        return 42\n\n"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(s)) == s
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(s) + [510, 511]) == s  # padding ids are dropped


def test_tokenizer_is_deterministic(tmp_path, text_file):
    a = train_tokenizer([text_file], tmp_path / "a", 350, progress=False)
    b = train_tokenizer([text_file], tmp_path / "b", 350, progress=False)
    assert a.read_bytes() == b.read_bytes()


def test_pack_appends_eos_and_drops_tail():
    docs = [[10, 11, 12], [20], [30, 31, 32, 33, 34]]  # + EOS each: 4 + 2 + 6 = 12 tokens
    samples = list(pack_samples(docs, eos_id=3, sample_len=5))
    assert [s.tolist() for s in samples] == [[10, 11, 12, 3, 20], [3, 30, 31, 32, 33]]  # 2 tokens dropped


def test_val_shards_spread_and_separate():
    assert val_shard_indices(20, 0.05) == {10}
    assert val_shard_indices(1, 0.5) == set() and val_shard_indices(5, 0.0) == set()
    v = val_shard_indices(100, 0.1)
    assert len(v) == 10 and min(v) > 0 and max(v) < 99


def test_write_shards_manifest_checksums_and_content(tmp_path, tiny_tokenizer):
    docs = [TEXT * (1 + i % 3) for i in range(40)]
    m = write_shards(docs, tiny_tokenizer, tmp_path / "out", seq_length=32, samples_per_shard=10,
                     val_fraction=0.2, progress=False)
    disk = load_manifest(tmp_path / "out")
    assert disk.to_json() == m.to_json()
    assert m.tokenizer_sha256 == tiny_tokenizer.sha256 and m.padded_vocab_size == 512 and m.dtype == "uint16"
    for s in m.shards:
        assert sha256_file(tmp_path / "out" / s.name) == s.sha256
        assert s.name.startswith(f"shard-{s.split}-") and s.num_tokens == s.num_samples * 33
    assert {s.split for s in m.shards} == {"train", "val"}
    total = sum(len(tiny_tokenizer.encode(d)) + 1 for d in docs)
    assert sum(s.num_tokens for s in m.shards) + m.dropped_tokens == total and m.dropped_tokens < 33
    ld = loader(tmp_path / "out", seq_length=32, split="val", global_batch_size=2, micro_batch_size=1,
                tokenizer_sha256=tiny_tokenizer.sha256)
    assert len(list(ld)) == m.num_samples("val")


def test_shards_hold_exactly_the_packed_stream(tmp_path, tiny_tokenizer):
    docs = [TEXT[: 50 + 37 * i] for i in range(30)]
    m = write_shards(docs, tiny_tokenizer, tmp_path / "out", seq_length=20, samples_per_shard=9,
                     val_fraction=0.0, progress=False)
    checks = ShardChecks(20, tiny_tokenizer.sha256, tiny_tokenizer.vocab_size)
    rows = np.concatenate([read_shard(ShardSpec(m.shard_url(s), s.num_samples, s.sha256), checks)
                           for s in m.shards])
    stream = [t for d in docs for t in tiny_tokenizer.encode(d) + [tiny_tokenizer.eos_id]]
    assert rows.reshape(-1).tolist() == stream[: rows.size]
    assert len(stream) - rows.size == m.dropped_tokens < 21


def test_write_shards_is_byte_deterministic(tmp_path, tiny_tokenizer, text_file):
    a = write_shards([text_file], tiny_tokenizer, tmp_path / "a", 16, samples_per_shard=7, progress=False)
    b = write_shards([text_file], tiny_tokenizer, tmp_path / "b", 16, samples_per_shard=7, progress=False)
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]


def test_shard_max_bytes_bounds_shards(tmp_path, tiny_tokenizer, text_file):
    copies = [tmp_path / f"copy{i}.txt" for i in range(3)]  # one file three times is refused (read twice)
    for copy in copies:
        copy.write_bytes(text_file.read_bytes())
    m = write_shards(copies, tiny_tokenizer, tmp_path / "o", 16, shard_max_bytes=20_000, progress=False)
    assert len(m.shards) > 1 and max(s.bytes for s in m.shards) <= 20_000


def test_too_little_text_is_an_error(tmp_path, tiny_tokenizer):
    from data_pipeline.errors import DataError
    with pytest.raises(DataError, match="not one sample"):
        write_shards(["hi"], tiny_tokenizer, tmp_path / "o", 64, progress=False)


def test_int32_for_large_vocab():
    from data_pipeline.shards import token_dtype
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32


def _cut_by_reencoding(line: str, max_bytes: int) -> list:
    """The obviously right, quadratic reading: heads of max_bytes // 4 characters while the rest,
    re-encoded each time, is longer than max_bytes."""
    pieces = []
    while len(line.encode("utf-8")) > max_bytes:
        pieces.append(line[: max_bytes // 4])
        line = line[max_bytes // 4 :]
    return pieces + ([line] if line else [])


@pytest.mark.parametrize("line", ["", "short\n", "a" * 16384, "a" * 16385, "é" * 8192, "é" * 8193,
                                  "x" * 5000 + "€" * 7000 + "🙂" * 3000 + "\n", "🙂" * 40000])
def test_long_training_lines_are_cut_where_sentencepiece_keeps_every_piece(line):
    from data_pipeline import tokenizer as tokenizer_mod

    limit = tokenizer_mod._MAX_LINE_BYTES
    pieces = list(tokenizer_mod._cut_long_line(line))
    assert pieces == _cut_by_reencoding(line, limit)
    assert "".join(pieces) == line and all(0 < len(p.encode("utf-8")) <= limit for p in pieces)
