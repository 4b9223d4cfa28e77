"""A tiny real dataset (stdlib-source corpus -> sentencepiece -> webdataset shards) for training tests."""

from __future__ import annotations

from pathlib import Path

SEQ_LENGTH = 32


def make_tiny_dataset(root: Path, corpus_bytes: int = 400_000, vocab_size: int = 512,
                      seq_length: int = SEQ_LENGTH) -> dict:
    """Build (once per root) and return {"manifest": path, "tokenizer": path}."""
    from data_pipeline.corpus import build_default_corpus
    from data_pipeline.shards import write_shards
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer

    root = Path(root)
    manifest = root / "shards" / "manifest.json"
    model = root / "tokenizer.model"
    if not manifest.exists():  # steps whose output exists were done (atomic writes; a tokenizer's .model last)
        root.mkdir(parents=True, exist_ok=True)
        corpus = root / "corpus.jsonl"
        if not corpus.exists():
            build_default_corpus(corpus, max_bytes=corpus_bytes)
        if not model.exists():
            train_tokenizer([corpus], root / "tokenizer", vocab_size=vocab_size)
        write_shards([corpus], Tokenizer.load(model), root / "shards", seq_length=seq_length,
                     samples_per_shard=128, val_fraction=0.1)
    return {"manifest": str(manifest), "tokenizer": str(model)}


def tiny_run_config(data: dict, output_dir: Path, **sections) -> dict:
    """A debug-sized run over the tiny dataset; ``sections`` deep-override it (e.g. train={...})."""
    from ascender_dist.config.loader import deep_merge

    base = {
        "name": "tiny",
        "output_dir": str(output_dir),
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
                  "seq_length": SEQ_LENGTH},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "train": {"micro_batch_size": 4, "global_batch_size": 16, "train_steps": 8, "seed": 1},
        "data": {"manifest": data["manifest"], "tokenizer": data["tokenizer"]},
        "checkpoint": {"save_interval": 0, "keep_last": 2},
        "logging": {"log_interval": 1},
    }
    return deep_merge(base, sections)
