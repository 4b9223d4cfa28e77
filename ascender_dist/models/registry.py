"""One registry of architectures: how each builds its megatron layer specs, checks its config,
and counts its parameters and FLOPs. Adding an architecture means adding one entry here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ascender_dist.config.errors import ConfigError


@dataclass
class ArchitectureEntry:
    name: str
    # (cfg, derived) -> megatron ModuleSpec or TransformerBlockSubmodules for the decoder block
    block_spec: Callable
    checks: list[Callable] = field(default_factory=list)
    # (cfg) -> extra parameters per transformer layer beyond the GPT layer (e.g. ASCender's U, P)
    extra_layer_params: Callable = lambda cfg: 0
    # (cfg) -> extra forward FLOPs per token per layer beyond the GPT layer
    extra_layer_flops: Callable = lambda cfg: 0


_REGISTRY: dict[str, ArchitectureEntry] = {}


def register(entry: ArchitectureEntry) -> None:
    _REGISTRY[entry.name] = entry


def _ensure_loaded() -> None:
    if not _REGISTRY:
        import ascender_dist.models.specs  # noqa: F401  (registers every architecture)


def get_architecture(name: str) -> ArchitectureEntry:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise ConfigError("model.architecture", f"unknown architecture {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def architecture_checks(name: str) -> list[Callable]:
    return get_architecture(name).checks
