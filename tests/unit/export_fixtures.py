"""Shared fixtures for the export / evaluation tests (a module, not a conftest, as data_fixtures):
two sentencepiece tokenizers of one size trained on other text, and a real consolidated run of the
default tiny gpt whose vocabulary and meta.json come from the first one."""

from __future__ import annotations

from pathlib import Path

import pytest

from .data_fixtures import TEXT

VOCAB = 400
META = {"format": 1, "step": 3, "architecture": "gpt", "world_size": 1, "vocab_size": VOCAB,
        "padded_vocab_size": 512, "data": {"consumed_samples": 8, "seed": 1},
        "versions": {"megatron-core": "0.16.1", "deepspeed": "0.19.8"}}


@pytest.fixture
def two_tokenizers(tmp_path) -> tuple[Path, Path]:
    """(the run's tokenizer, another one): both BPE with VOCAB pieces, the second trained on other text
    (the lines of TEXT reversed character by character), so same size, other ids."""
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer

    (tmp_path / "ours.txt").write_text(TEXT * 20, encoding="utf-8")
    other = "\n".join(line[::-1] for line in TEXT.splitlines()) + "\n"
    (tmp_path / "other.txt").write_text(other * 20, encoding="utf-8")
    ours = train_tokenizer([tmp_path / "ours.txt"], tmp_path / "tok" / "ours", VOCAB, progress=False)
    theirs = train_tokenizer([tmp_path / "other.txt"], tmp_path / "tok" / "other", VOCAB, progress=False)
    a, b = Tokenizer.load(ours), Tokenizer.load(theirs)
    assert a.vocab_size == b.vocab_size == VOCAB and a.sha256 != b.sha256
    return ours, theirs


def write_run(out: Path, tokenizer: Path, data_tokenizer: str | None = None, record_sha: bool = True) -> Path:
    """A consolidated run of the default tiny gpt with ``tokenizer``'s vocabulary, written by
    write_consolidated: its config names ``data_tokenizer`` (default: ``tokenizer``), its meta.json
    records ``tokenizer``'s sha256 unless ``record_sha`` is False (a checkpoint of an older version)."""
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.convert import write_consolidated
    from ascender_dist.tools.hf_export import remote_code_config
    from data_pipeline.tokenizer import tokenizer_sha256

    cfg = config_from_dict({"name": "tiny", "data": {"tokenizer": str(data_tokenizer or tokenizer)}})
    meta = {**META, "tokenizer_sha256": tokenizer_sha256(tokenizer)} if record_sha else dict(META)
    model = AscenderDistForCausalLM(remote_code_config(cfg, meta, VOCAB, tied=True))
    state = {name.removeprefix("model."): t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    write_consolidated(out, state, cfg, meta)
    return out


@pytest.fixture
def run_with_tokenizer(tmp_path, two_tokenizers) -> Path:
    """A consolidated run trained (so its meta.json says) with the first of ``two_tokenizers``."""
    return write_run(tmp_path / "cons", two_tokenizers[0])
