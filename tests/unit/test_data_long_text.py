"""A plain-text file is one document; one over formats.LONG_TEXT_BYTES is read and tokenized in
parts (formats.TextParts, Tokenizer.encode_parts): exactly the tokens, shards and counts of the
whole text, in the memory of one part instead of 10-15x the file."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from data_pipeline import formats
from data_pipeline.errors import DataError
from data_pipeline.formats import TextParts
from data_pipeline.parallel import _tokenize_part
from data_pipeline.shards import encoded_documents, write_shards
from data_pipeline.tokenizer import Tokenizer, train_tokenizer

from .data_fixtures import TEXT, text_file, tiny_tokenizer  # noqa: F401

LONG_LINE = "y = [" + ", ".join(str(i) for i in range(900)) + "]"  # ~4.5 KB without a newline


def _long_text(lines: int = 3000) -> str:
    body = [f"line {i}: " + "é" * (i % 7) + "x" * (i % 50) + "\n" for i in range(lines)]
    body.insert(lines // 2, LONG_LINE + "\n")
    return TEXT + "".join(body) + "the end, without a newline"


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def test_parts_end_after_a_newline_and_join_to_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "_READ_CHUNK", 64)
    text = _long_text()
    path = _write(tmp_path / "long.txt", text)
    parts = list(TextParts(path, path.stat().st_size, part_bytes=1000))
    assert "".join(parts) == text and len(parts) > 50
    assert all(part.endswith("\n") for part in parts[:-1])
    assert any(LONG_LINE in part for part in parts)  # a line longer than a part stays whole
    assert max(len(part.encode("utf-8")) for part in parts) <= len(LONG_LINE) + 1000 + 64
    assert list(TextParts(path, path.stat().st_size, part_bytes=1000)) == parts  # iterable again


def test_bad_utf8_in_a_later_part_names_the_file_and_its_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "_READ_CHUNK", 64)
    good = _long_text(200).encode("utf-8")
    path = tmp_path / "bad.txt"
    path.write_bytes(good + b"\xff\n" + good)
    with pytest.raises(DataError) as info:
        list(TextParts(path, path.stat().st_size, part_bytes=500))
    assert str(info.value) == f"{path}: not valid UTF-8 (byte {len(good)}: invalid start byte)"


def test_small_files_stay_one_str_and_long_ones_come_in_parts(tmp_path, monkeypatch):
    small = _write(tmp_path / "small.txt", "a\nb\n")
    assert formats.text_document(small) == "a\nb\n"
    monkeypatch.setattr(formats, "LONG_TEXT_BYTES", 3)
    doc = next(iter(formats.iter_documents([small])))
    assert isinstance(doc, TextParts) and "".join(doc) == "a\nb\n"


def _assert_parts_give_the_whole_texts_ids(tok: Tokenizer, rounds: int, label) -> None:
    """Random texts cut at random newlines: encode_parts gives encode(whole text)."""
    rng = random.Random(0)
    corpus = _long_text(400) + TEXT * 3
    for _ in range(rounds):
        start = rng.randrange(len(corpus) - 2000)
        text = corpus[start : start + rng.randrange(1, 2000)] + rng.choice(["", "\n", " \n  x", "\n\n", "é\n\t",
                                                                          "\n \n y", "\n#\n  #"])
        newlines = [i + 1 for i, c in enumerate(text) if c == "\n"]
        cuts = sorted(rng.sample(newlines, min(len(newlines), rng.randrange(6))))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)]) if i < j]
        assert [i for ids in tok.encode_parts(parts) for i in ids] == tok.encode(text), (parts, label)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_encode_parts_gives_the_tokens_of_the_whole_text(tmp_path, text_file, model_type):  # noqa: F811
    tok = Tokenizer.load(train_tokenizer([text_file], tmp_path / model_type, 400, model_type=model_type,
                                         progress=False))
    assert tok.parts_split_exactly
    _assert_parts_give_the_whole_texts_ids(tok, 150, model_type)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
@pytest.mark.parametrize("options", [{}, {"remove_extra_whitespaces": False}], ids=["nmt_nfkc", "nmt_nfkc-keep-spaces"])
def test_a_tokenizer_trained_elsewhere_gives_the_whole_texts_ids_too(tmp_path, model_type, options):
    """A `shard --tokenizer` model with sentencepiece's default normalisation (nmt_nfkc maps a newline
    to a space): pieces such as "▁#" spanned a cut and 147 of 300 random cuts changed the ids, while
    parts_split_exactly, which looked at the pieces only, said the cuts were safe."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    lines = (_long_text(400) + TEXT * 3).splitlines()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=200,
                                   model_type=model_type, minloglevel=3, **options)
    path = tmp_path / "elsewhere.model"
    path.write_bytes(model.getvalue())
    _assert_parts_give_the_whole_texts_ids(Tokenizer.load(path), 150, (model_type, options))


def test_a_tokenizer_with_a_piece_across_a_newline_encodes_the_parts_joined(tmp_path, text_file):  # noqa: F811
    tok = Tokenizer.load(train_tokenizer([text_file], tmp_path / "tok", 400, user_defined_symbols=["\ny"],
                                         progress=False))
    assert not tok.parts_split_exactly
    parts = ["x = 1\n", "y = 2\n"]
    lead = len(tok.encode("\n"))
    naive = tok.encode(parts[0]) + tok.encode("\n" + parts[1])[lead:]
    assert naive != tok.encode("".join(parts))  # the piece "\ny" spans the cut: splitting would change ids
    assert list(tok.encode_parts(parts)) == [tok.encode("".join(parts))]


def test_a_long_text_file_gives_the_shards_of_the_whole_text(tmp_path, tiny_tokenizer, monkeypatch):  # noqa: F811
    path = _write(tmp_path / "long.txt", _long_text())
    docs = [tmp_path / "before.txt", path, tmp_path / "after.txt"]
    docs[0].write_text("a short document\n")
    docs[2].write_text("another one")
    kw = dict(seq_length=16, samples_per_shard=50, val_fraction=0.1, progress=False)
    whole = write_shards(docs, tiny_tokenizer, tmp_path / "whole", **kw)
    whole_part = tmp_path / "whole.part"
    whole_counts = _tokenize_part([formats.Piece(str(p)) for p in docs], str(tiny_tokenizer.model_path), "uint16",
                                  "text", str(whole_part))
    monkeypatch.setattr(formats, "LONG_TEXT_BYTES", 10_000)
    monkeypatch.setattr(formats, "TEXT_PART_BYTES", 5_000)
    monkeypatch.setattr(formats, "_READ_CHUNK", 1024)
    assert isinstance(formats.text_document(path), TextParts)
    in_parts = write_shards(docs, tiny_tokenizer, tmp_path / "parts", **kw)
    assert in_parts.to_json() == whole.to_json()  # every shard's sha256, sample and token count
    parts_part = tmp_path / "parts.part"
    counts = _tokenize_part([formats.Piece(str(p)) for p in docs], str(tiny_tokenizer.model_path), "uint16",
                            "text", str(parts_part))
    assert counts == whole_counts and parts_part.read_bytes() == whole_part.read_bytes()
    # one part's ids at a time, never the file's
    pieces = list(encoded_documents([formats.text_document(path)], tiny_tokenizer))
    total = sum(len(ids) for ids, _, _ in pieces)
    assert total == len(tiny_tokenizer.encode(path.read_text())) and len(pieces) > 10
    assert max(len(ids) for ids, _, _ in pieces) < total / 5
    assert [end for _, end, _ in pieces] == [False] * (len(pieces) - 1) + [True]
    assert sum(n for _, _, n in pieces) == path.stat().st_size
