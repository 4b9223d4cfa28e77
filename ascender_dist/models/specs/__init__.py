"""Registry entries of every layer kind and architecture. The megatron wiring modules they point
to (``specs/ascender.py``, ``specs/connection.py``) are imported only when a model is built."""

from ascender_dist.models.specs import ascender_arch, connection_arch, gpt  # noqa: F401
