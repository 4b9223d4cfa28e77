"""What write_shards reads and what a re-shard replaces: every input file once, str documents as
text only, and only the shards of the build's own prefix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from data_pipeline.errors import DataError
from data_pipeline.shards import load_manifest, write_shards

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401


def _write(inputs, tokenizer, out: Path, prefix: str = "shard"):
    return write_shards(inputs, tokenizer, out, 16, samples_per_shard=20, val_fraction=0.0, prefix=prefix,
                        progress=False)


@pytest.mark.parametrize("spelling", ["same", "dot", "folder"])
def test_one_file_given_twice_is_refused_as_in_one_call(tmp_path, tiny_tokenizer, text_file, spelling):
    """Each Path item was expanded on its own, so the file-read-twice check never saw two of them:
    the single-process writer sharded the file twice (every document duplicated) where --workers 2
    and train-tokenizer refused it (found by a review)."""
    second = {"same": text_file, "dot": Path(f"{text_file.parent}/./{text_file.name}"),
              "folder": text_file.parent}[spelling]
    with pytest.raises(DataError) as info:
        _write([text_file, second], tiny_tokenizer, tmp_path / "out")
    message = str(info.value)
    assert "its documents would be read twice" in message and "\n" not in message, message
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert _write([text_file], tiny_tokenizer, tmp_path / "out").num_documents == 1  # once is fine


def test_a_str_naming_a_file_is_refused_not_tokenized_as_text(tmp_path, tiny_tokenizer, text_file):
    """str items are document texts: a file name given as str was tokenized as the text of its name."""
    with pytest.raises(DataError) as info:
        _write([str(text_file)], tiny_tokenizer, tmp_path / "out")
    assert "pass pathlib.Path" in str(info.value)
    texts = ["a short text. " * 30, "another one, longer: " * 40]
    assert _write(texts, tiny_tokenizer, tmp_path / "texts").num_documents == 2


def test_a_reshard_with_another_prefix_leaves_the_first_prefixs_shards(tmp_path, tiny_tokenizer, text_file, caplog):
    """docs/data.md: shards written with another prefix are left alone. The old manifest's shards
    were all moved aside and deleted, whatever their prefix (found by a review)."""
    out = tmp_path / "out"
    first = _write([text_file], tiny_tokenizer, out, prefix="a")
    a_names = sorted(s.name for s in first.shards)
    a_bytes = {name: (out / name).read_bytes() for name in a_names}
    with caplog.at_level(logging.WARNING, logger="data_pipeline.replace"):
        second = _write([text_file], tiny_tokenizer, out, prefix="b")
    assert all(name.startswith("b-") for name in (s.name for s in second.shards))
    assert {name: (out / name).read_bytes() for name in a_names} == a_bytes
    assert [s.name for s in load_manifest(out / "manifest.json").shards] == [s.name for s in second.shards]
    assert any("another prefix" in r.getMessage() for r in caplog.records)
    third = _write([text_file], tiny_tokenizer, out, prefix="b")  # the same prefix: replaced as before
    assert [s.name for s in third.shards] == [s.name for s in second.shards]
    assert not (out / ".previous-dataset").exists()
