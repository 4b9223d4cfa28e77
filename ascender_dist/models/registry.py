"""One registry of layer kinds and architectures.

A *layer kind* (one letter) is a transformer layer variant: ``A`` megatron's own attention layer,
``S`` ASCender attention, ``C`` the Connection layer in place of attention. It knows how to build
its megatron ModuleSpec and what it adds to a GPT layer's parameter and FLOP count.
An *architecture* is a default ``model.layer_pattern`` over those letters plus its config checks.
Adding a layer type or architecture means adding one entry here (see ``models/specs/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ascender_dist.config.errors import ConfigError


@dataclass
class LayerKind:
    letter: str
    description: str
    spec: Callable  # (cfg, layer_number) -> megatron ModuleSpec; imports megatron lazily
    extra_params: Callable = lambda cfg: 0  # parameters beyond a GPT layer of the same width
    extra_flops: Callable = lambda cfg: 0.0  # forward FLOPs per token beyond a GPT layer


@dataclass
class ArchitectureEntry:
    name: str
    default_pattern: str
    required_letter: str  # the pattern must use this architecture's own layer at least once
    checks: list[Callable] = field(default_factory=list)  # (cfg) -> None, raise ConfigError


_LAYER_KINDS: dict[str, LayerKind] = {}
_ARCHITECTURES: dict[str, ArchitectureEntry] = {}


def register_layer_kind(kind: LayerKind) -> None:
    _LAYER_KINDS[kind.letter] = kind


def register(entry: ArchitectureEntry) -> None:
    _ARCHITECTURES[entry.name] = entry


def _ensure_loaded() -> None:
    if not _ARCHITECTURES:
        import ascender_dist.models.specs  # noqa: F401  (registers everything)


def get_architecture(name: str) -> ArchitectureEntry:
    _ensure_loaded()
    if name not in _ARCHITECTURES:
        raise ConfigError("model.architecture", f"unknown architecture {name!r}; known: {', '.join(_ARCHITECTURES)}")
    return _ARCHITECTURES[name]


def get_layer_kind(letter: str) -> LayerKind:
    _ensure_loaded()
    return _LAYER_KINDS[letter]


def layer_kinds() -> dict[str, LayerKind]:
    _ensure_loaded()
    return dict(_LAYER_KINDS)


def expand_layer_pattern(cfg) -> str:
    """The pattern repeated to one letter per layer: 'AC' with 4 layers -> 'ACAC'."""
    pattern = cfg.model.layer_pattern or get_architecture(cfg.model.architecture).default_pattern
    return (pattern * (cfg.model.num_layers // len(pattern) + 1))[: cfg.model.num_layers]


def check_layer_pattern(cfg) -> None:
    m = cfg.model
    arch = get_architecture(m.architecture)
    pattern = m.layer_pattern or arch.default_pattern
    kinds = layer_kinds()
    unknown = sorted(set(pattern) - set(kinds))
    if not pattern or unknown:
        legend = ", ".join(f"{k.letter}={k.description}" for k in kinds.values())
        raise ConfigError("model.layer_pattern", f"letters must be from {legend} (got {pattern!r})")
    if m.num_layers % len(pattern):
        raise ConfigError("model.layer_pattern",
                          f"length {len(pattern)} of {pattern!r} must divide model.num_layers={m.num_layers}")
    if arch.required_letter not in pattern:
        raise ConfigError("model.layer_pattern",
                          f"architecture {m.architecture!r} needs at least one {arch.required_letter!r} layer "
                          f"(got {pattern!r})")


def architecture_checks(name: str) -> list[Callable]:
    """Pattern check, then every architecture's checks: each validates its own hyperparameters
    whenever the pattern uses its layer kind (so a connection model with ASCender layers checks both)."""
    get_architecture(name)
    return [check_layer_pattern, *(check for entry in _ARCHITECTURES.values() for check in entry.checks)]
