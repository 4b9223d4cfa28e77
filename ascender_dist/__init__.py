"""ascender-dist: distributed pretraining of ASCender and Connection-Transformer language models."""

__version__ = "0.1.0"
