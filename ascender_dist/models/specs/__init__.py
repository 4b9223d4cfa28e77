"""Registry entries of every architecture. The megatron wiring modules they point to
(``specs/ascender.py``, ...) are imported only when a model is built."""

from ascender_dist.models.specs import ascender_arch, gpt  # noqa: F401
