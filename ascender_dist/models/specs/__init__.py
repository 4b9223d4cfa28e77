"""megatron-core wiring for each architecture (the model math itself lives in pure-torch modules)."""

from ascender_dist.models.specs import gpt  # noqa: F401
