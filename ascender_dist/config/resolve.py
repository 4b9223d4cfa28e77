"""Load a run config from YAML, apply preset and overrides, validate, and compute derived values once."""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ascender_dist.config.architectures import ARCHITECTURE_CHECKS, check_neighbour_count
from ascender_dist.config.checks import STATIC_CHECKS, check_no_home_shorthand, check_world_size_layout
from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import (apply_override, deep_merge, from_dict, leaf_paths, override_key,
                                         read_yaml_file)
from ascender_dist.config.presets import preset_model_fields
from ascender_dist.config.schema import RunConfig


def _apply_preset(raw: dict) -> dict:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") is None:
        return raw
    architecture = model.get("architecture", "gpt")
    for name, value in (("preset", model["preset"]), ("architecture", architecture)):
        if not isinstance(value, str):
            raise ConfigError(f"model.{name}", f"expected str, got {type(value).__name__} {value!r}")
    base = preset_model_fields(model["preset"], architecture, layer_pattern=model.get("layer_pattern"))
    return {**raw, "model": deep_merge(base, model)}


def check_preset_takes_effect(raw: dict) -> None:
    """A preset chosen on top of a config (a ``--set model.preset=...``, a grid variant's) that sets no
    field the config does not give already would build the config's model under the preset's name:
    refused. A file may name a preset that its own fields cover for one architecture (configs/demo.yaml
    gets the other architectures' layer sizes from it)."""
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") is None:
        return
    _apply_preset(raw)  # a preset or architecture that is not a name: its own one-line error
    preset = preset_model_fields(model["preset"], model.get("architecture", "gpt"),
                                 layer_pattern=model.get("layer_pattern"))
    # the preset's few fields looked up in the config, not the config's fields listed: a config's YAML
    # aliases can expand to exponentially many paths (an alias bomb), the preset's cannot
    if not any(not _gives(model, name.split(".")) for name in leaf_paths(preset)):
        raise ConfigError("model.preset", f"{model['preset']!r} sets nothing here: the config gives every field it "
                                          f"sets ({', '.join(sorted(leaf_paths(preset)))})")


def _gives(tree: dict, path: list[str]) -> bool:
    """Whether the nested mapping ``tree`` holds a value at ``path`` (a list of keys)."""
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def config_from_dict(raw: dict) -> RunConfig:
    cfg = from_dict(RunConfig, _apply_preset(raw))
    validate(cfg)
    return cfg


def _blame(error_path: str, overrides: list[str]) -> Optional[str]:
    """The last ``--set`` override that set the field an error is about (or a section holding it)."""
    for text in reversed(overrides):
        key = override_key(text)
        if error_path == key or error_path.startswith((f"{key}.", f"{key}[")) or key.startswith(f"{error_path}."):
            return text
    return None


def config_with_overrides(raw: dict, overrides: Iterable[str], source: str, fixed: Optional[dict] = None) -> RunConfig:
    """``raw`` (read from ``source``) + ``dotted.key=value`` overrides (+ ``fixed`` values a command
    imposes, merged last) -> validated RunConfig.

    An error the file has without the overrides names ``source``; else one about a field an override set
    names the override (``--set optimizer.lr=0: optimizer.lr: ...``), and one that only the overrides
    together bring about names ``source`` with them all.
    """
    overrides = list(overrides)
    merged = raw
    for text in overrides:
        merged = apply_override(merged, text)
    if fixed:
        merged, raw = deep_merge(merged, fixed), deep_merge(raw, fixed)
    try:
        if any(override_key(text) in ("model", "model.preset") for text in overrides):  # model={preset: x} too
            check_preset_takes_effect(merged)
        return config_from_dict(merged)
    except ConfigError as exc:
        culprit = _blame(exc.path, overrides)
        if not overrides or _fails_alike(raw, exc):  # the file's own error, whatever the overrides set
            where = source
        elif culprit is not None:
            where = f"--set {culprit}"
        else:  # another field's override (a batch size, the architecture)
            where = f"{source} with " + " ".join(f"--set {text}" for text in overrides)
        raise ConfigError(f"{where}: {exc.path}" if exc.path else where, exc.message) from None


def _fails_alike(raw: dict, error: ConfigError) -> bool:
    """Whether ``raw`` alone (the file, without the overrides) fails with the same error."""
    try:
        config_from_dict(raw)
    except ConfigError as exc:
        return (exc.path, exc.message) == (error.path, error.message)
    return False


ABLATION_GRID_KEYS = ("variants", "axes", "standalone")  # with "base": an `ascender-dist ablate` grid


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
    """YAML file + ``dotted.key=value`` overrides -> validated RunConfig (ConfigError on any problem;
    an ablation grid, which holds many runs, is named as such and pointed to ``ablate``)."""
    raw = read_yaml_file(path)
    if isinstance(raw, dict) and "base" in raw and any(key in raw for key in ABLATION_GRID_KEYS):
        raise ConfigError(str(path), f"an ablation grid (base + variants/axes), not a run config: run it with "
                                     f"`ascender-dist ablate {path}`")
    overrides = list(overrides)
    cfg = config_with_overrides(raw, overrides, str(path))
    try:
        check_no_home_shorthand(cfg)
        check_neighbour_count(cfg)
    except ConfigError as exc:
        raise named_source(exc, path, overrides) from None
    return cfg


LAYOUT_SIZES = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size")


def named_source(exc: ConfigError, path: str | Path, overrides: Iterable[str]) -> ConfigError:
    """``exc`` (about a field of the config loaded from ``path`` with ``overrides``), naming the
    ``--set`` that set the field, else the file: for checks made after loading (the world size).
    An error about no config field (a command's own argument) is returned as it is."""
    if exc.path.split(".")[0] not in {f.name for f in dataclasses.fields(RunConfig)}:
        return exc
    overrides = list(overrides)
    if exc.path == "parallel":  # the TP x PP layout as a whole: only a --set of those sizes chose it
        overrides = [o for o in overrides if override_key(o) in LAYOUT_SIZES]
    culprit = _blame(exc.path, overrides)
    return ConfigError(f"--set {culprit}: {exc.path}" if culprit else f"{path}: {exc.path}", exc.message)


def validate(cfg: RunConfig, world_size: Optional[int] = None) -> None:
    for check in STATIC_CHECKS:
        check(cfg)
    for check in ARCHITECTURE_CHECKS:
        check(cfg)
    if world_size is not None:
        check_world_size_layout(cfg, world_size)


@dataclass(frozen=True)
class Derived:
    """Values that follow from the config and the launch; computed once, passed around read-only."""

    world_size: int
    data_parallel_size: int
    gradient_accumulation_steps: int
    padded_vocab_size: int
    output_dir: Path
    checkpoint_dir: Path
    tensorboard_dir: Path
    vocab_size: int  # the tokenizer's (or model.vocab_size); ids from here to padded_vocab_size are padding


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's rule: pad so the embedding splits evenly over TP ranks in aligned blocks."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def derive(cfg: RunConfig, world_size: int, tokenizer_vocab_size: Optional[int] = None) -> Derived:
    validate(cfg, world_size)
    p, m, t = cfg.parallel, cfg.model, cfg.train
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    vocab = m.vocab_size or tokenizer_vocab_size
    if vocab is None:
        raise ConfigError("model.vocab_size", "not set and no tokenizer given (set data.tokenizer)")
    if m.vocab_size and tokenizer_vocab_size and tokenizer_vocab_size > m.vocab_size:
        raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} "
                                              f"pieces ({cfg.data.tokenizer}): set it to {tokenizer_vocab_size} or more")
    output_dir = Path(cfg.output_dir or f"runs/{cfg.name}")
    return Derived(
        world_size=world_size,
        data_parallel_size=dp,
        gradient_accumulation_steps=t.global_batch_size // (t.micro_batch_size * dp),
        padded_vocab_size=pad_vocab_size(vocab, m.make_vocab_size_divisible_by, p.tensor_model_parallel_size),
        output_dir=output_dir,
        checkpoint_dir=Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else output_dir / "checkpoints",
        tensorboard_dir=output_dir / "tensorboard",
        vocab_size=vocab,
    )
