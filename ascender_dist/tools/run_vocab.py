"""The vocabulary size a run will have, for the commands that describe a run before it exists
(``print-config``, ``plan``), with one line saying where the number comes from.

The order is the trainer's: ``model.vocab_size`` when the config states it (the scaling configs and
the demo do), else the tokenizer file's piece count; before that file exists, ``--vocab-size``, else
an assumed default, said as such. A tokenizer that the config names but that does not exist yet
(a fresh clone) gets one more line: the command that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ascender_dist.config.checks import SIZE_LIMIT
from ascender_dist.config.errors import ConfigError


@dataclass(frozen=True)
class RunVocab:
    size: int
    source: str  # where ``size`` comes from (a phrase, without the number)
    hint: Optional[str] = None  # one line: a missing file and the command that makes it, or a mismatch


def tokenizer_command(tokenizer: str, vocab_size: int) -> str:
    """The command that trains ``tokenizer`` (a ``.model`` path) with ``vocab_size`` pieces."""
    path = Path(tokenizer)
    prefix = path.with_suffix("") if path.suffix == ".model" else path
    return (f"data-pipeline train-tokenizer --input CORPUS.jsonl --out-prefix {prefix} --vocab-size {vocab_size} "
            "(CORPUS.jsonl: your corpus, or one from data-pipeline build-corpus; launch/demo.sh does both)")


def _tokenizer_size(tokenizer: str) -> int:
    from data_pipeline.tokenizer import Tokenizer

    return Tokenizer.load(Path(tokenizer)).vocab_size


# assumed when neither the config, its tokenizer nor --vocab-size says: GPT-2's 50257 padded to a
# multiple of 128; one value for every command, so print-config and plan count one model
DEFAULT_VOCAB_SIZE = 50304


def check_vocab_flag(explicit: Optional[int]) -> None:
    """``--vocab-size`` within the bound model.vocab_size has (config.checks.SIZE_LIMIT)."""
    if explicit is not None and not 1 <= explicit < SIZE_LIMIT:
        raise ConfigError("--vocab-size", f"must be in [1, 2**31) (got {explicit})")


def run_vocab(cfg, explicit: Optional[int], default: int = DEFAULT_VOCAB_SIZE) -> RunVocab:
    """The vocab size of the run ``cfg`` describes; ``explicit`` is ``--vocab-size``, ``default`` the
    assumption when nothing else says."""
    check_vocab_flag(explicit)
    tokenizer = cfg.data.tokenizer or None
    exists = bool(tokenizer) and Path(tokenizer).is_file()
    if tokenizer and not exists and Path(tokenizer).exists():  # a folder, not a file "to make"
        raise ConfigError("data.tokenizer", f"{tokenizer} is not a file (a sentencepiece .model is)")
    stated = cfg.model.vocab_size or None
    if stated:
        hint = None
        if exists and _tokenizer_size(tokenizer) > stated:
            hint = (f"tokenizer {tokenizer} has {_tokenizer_size(tokenizer)} pieces, more than model.vocab_size "
                    f"{stated}: training will refuse it")
        elif tokenizer and not exists:
            hint = f"{tokenizer} does not exist yet; make it with: {tokenizer_command(tokenizer, stated)}"
        ignored = f"; --vocab-size {explicit} ignored" if explicit is not None and explicit != stated else ""
        return RunVocab(stated, f"model.vocab_size, the size the run will have{ignored}", hint)
    if exists:
        size = _tokenizer_size(tokenizer)
        return RunVocab(size, f"the piece count of {tokenizer}, the size the run will have")
    missing = (f"{tokenizer} does not exist yet; make it with: {tokenizer_command(tokenizer, explicit or default)}"
               if tokenizer else None)
    if explicit is not None:
        return RunVocab(explicit, "--vocab-size; the run will take its tokenizer's", missing)
    reason = f"{tokenizer} not found" if tokenizer else "no model.vocab_size and no data.tokenizer"
    return RunVocab(default, f"ASSUMED: {reason}; set model.vocab_size or --vocab-size", missing)
