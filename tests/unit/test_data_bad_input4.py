"""More bad input that must stop with one line naming the culprit, not lost or altered data: a
tokenizer model cut short or replaced behind its sidecar, tokens stored in another dtype than their
shard records, one shard's bytes listed twice under two names, a glob given as shard URLs, a part
file damaged between its job and the merge."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest

from data_pipeline.errors import DataError
from data_pipeline.loader import MixtureLoader, ShardChecks, ShardSpec, read_shard
from data_pipeline.parallel import PARTS_DIR, merge, run_job, shard_settings
from data_pipeline.shards import encode_shard
from data_pipeline.tokenizer import Tokenizer, train_tokenizer

from tests.helpers.errors import one_line as one_line_of

from .data_fixtures import FAKE_SHA, SEQ, loader, make_dataset, sample_tokens, text_file, tiny_tokenizer  # noqa: F401

one_line = functools.partial(one_line_of, kind=DataError)


# --------------------------------------------------------------------------- 1. a damaged tokenizer model
def test_a_tokenizer_model_cut_short_or_replaced_is_refused_by_its_sidecar(tmp_path, tiny_tokenizer, text_file):
    """sentencepiece loads a model cut short without complaint (its normalizer settings or pieces
    gone) and then tokenizes differently; the sidecar's sha256 and piece count catch it."""
    model = tiny_tokenizer.model_path
    data = model.read_bytes()
    assert Tokenizer.load(model).sha256 == tiny_tokenizer.sha256  # intact: loads
    model.write_bytes(data[:-16])  # the last 16 bytes: still a model sentencepiece accepts
    with pytest.raises(DataError) as e:
        Tokenizer.load(model)
    assert one_line(e, "differs from the", "tok.json", "damaged or was replaced").startswith(f"{model}: ")
    other = train_tokenizer([text_file], tmp_path / "other", 350, progress=False)
    shutil.copyfile(other, model)  # another tokenizer under this one's name
    with pytest.raises(DataError) as e:
        Tokenizer.load(model)
    one_line(e, "differs from the")
    side = model.with_suffix(".json")
    record = json.loads(side.read_text())
    side.write_text(json.dumps({**record, "sha256": Tokenizer.load(other).sha256}))
    with pytest.raises(DataError) as e:  # the right bytes, a piece count the sidecar did not record
        Tokenizer.load(model)
    one_line(e, "350 pieces", "recorded 400")
    side.write_bytes(b"{")  # a broken sidecar with the padding given: the model loads unverified
    assert Tokenizer.load(model, pad_vocab_to_multiple_of=64).padded_vocab_size == 384


# --------------------------------------------------------------------------- 2. tokens in another dtype
@pytest.mark.parametrize("via", ["read_shard", "loader"])
def test_tokens_stored_in_another_dtype_than_the_shard_records_are_refused(tmp_path, via):
    """uint16 ids written as uint8 have wrapped (300 reads as 44) and pass every range check."""
    shard = tmp_path / "syn-train-000000.tar"  # no manifest: the shard's own meta.json is its record
    meta = {"tokenizer_sha256": FAKE_SHA, "seq_length": SEQ, "dtype": "uint16", "vocab_size": 300}
    shard.write_bytes(encode_shard([sample_tokens(i) for i in range(4)], np.dtype(np.uint8), meta))
    with pytest.raises(DataError) as e:
        if via == "read_shard":
            read_shard(ShardSpec(str(shard), 4), ShardChecks(seq_length=SEQ))
        else:
            next(iter(loader(str(shard), global_batch_size=2)))
    assert one_line(e, "tokens stored as uint8, meta.json says uint16").startswith(f"{shard}: ")


# --------------------------------------------------------------------------- 3. a dataset and its copy
def test_a_dataset_and_its_copy_in_one_mixture_are_refused_equal_shards_of_one_dataset_are_not(tmp_path):
    """A mixture of a dataset and a copy of it in another folder drew it at the sum of the two weights;
    within one dataset equal bytes are legitimate (the writer gives a repetitive corpus equal shards)."""
    make_dataset(tmp_path / "a", [4, 4])
    shutil.copyfile(tmp_path / "a" / "syn-train-000000.tar", tmp_path / "a" / "syn-train-000002.tar")
    record = json.loads((tmp_path / "a" / "manifest.json").read_text())
    record["shards"].append({**record["shards"][0], "name": "syn-train-000002.tar"})
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(record))
    assert next(iter(loader(str(tmp_path / "a"))))["tokens"].shape == (2, SEQ + 1)  # loads and reads
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with pytest.raises(DataError) as e:
        MixtureLoader([(tmp_path / "a", 1.0), (tmp_path / "b", 1.0)], seq_length=SEQ, micro_batch_size=2,
                      global_batch_size=8, dp_rank=0, dp_size=1, seed=5)
    one_line(e, "b/syn-train-000000.tar has the same bytes", "a/syn-train-000000.tar of ", "mixture dataset 0")


# --------------------------------------------------------------------------- 4. a glob as shard URLs
def test_a_glob_given_as_shard_urls_says_globs_are_not_expanded(tmp_path):
    make_dataset(tmp_path, [4, 4])
    pattern = str(tmp_path / "syn-train-*.tar")
    with pytest.raises(DataError) as e:
        loader(pattern)
    assert one_line(e, "not globbed", "brace range", "manifest.json").startswith(f"{pattern}: ")
    loader(str(tmp_path / "syn-train-{000000..000001}.tar"))  # the brace form of the same list reads
    odd = tmp_path / "run[1]*"  # a folder whose name holds glob characters is no glob
    make_dataset(odd, [4, 4])
    loader(str(odd / "syn-train-{000000..000001}.tar"))
    loader(f"file:{odd / 'syn-train-000000.tar'}")


# --------------------------------------------------------------------------- 5. a part damaged before merge
def test_merge_refuses_a_part_with_a_token_past_the_vocabulary(tmp_path, tiny_tokenizer, text_file):
    """The job marks record the parts' sizes only: a part damaged after its job finished was written
    into shards, and the new manifest's sha256 vouched for them."""
    out = tmp_path / "jobs"
    settings = shard_settings(16, 7, None, 0.1, "shard")
    for job in (0, 1):
        run_job([text_file], tiny_tokenizer, out / PARTS_DIR, settings, job_index=job, job_count=2)
    part = max((out / PARTS_DIR).glob("*.bin"), key=lambda p: p.stat().st_size)
    raw = bytearray(part.read_bytes())
    raw[20:22] = b"\xff\xff"  # token 10 of a uint16 part: id 65535
    part.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        merge(out, workers=1)
    assert one_line(e, "token id 65535 >= vocab size 400 at token 10", "run its job again").startswith(f"{part}: ")
    assert not (out / "manifest.json").exists()
