"""Data pipeline: default corpus, sentencepiece tokenizer, webdataset shards, deterministic loader.

Submodules are imported on demand (``data_pipeline.loader`` pulls in torch; the corpus and
tokenizer tools do not need it).
"""

from .errors import DataError

__all__ = ["DataError"]
