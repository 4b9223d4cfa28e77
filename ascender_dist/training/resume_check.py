"""What a resume checks before it loads anything: the model the config describes is the one the
checkpoint holds, and the data is the data it was trained on (a fingerprint, as OLMo-core's
loader keeps).

- model: every field of ``model`` in the checkpoint's ``config.yaml`` must equal the run's; the
  first that differs is named in one line with both values. Fields that do not change the weights'
  meaning are exempt (dropouts, the init std, ``preset``, whose values are resolved into fields, and
  the ASCender fast path's tiling: ``EXEMPT_MODEL_FIELDS``);
- tokenizer: the run's tokenizer (``data.tokenizer``) must be the one ``meta.json`` records
  (``tokenizer_sha256``), and the vocabulary sizes the ones it records (``vocab_size``,
  ``padded_vocab_size``: all a checkpoint written before the sha256 was recorded can be checked
  against). A tokenizer swap is refused even with ``data.allow_change_on_resume: true``: the
  embedding rows would mean other pieces;
- the data's tokenizer: the sha256 of the tokenizer the training data was made with (its
  manifests record it) must be the one ``meta.json`` records (``data_tokenizer_sha256``), also
  with ``data.allow_change_on_resume: true`` and in a run without ``data.tokenizer``, where the
  vocabulary size alone would pass data made with another tokenizer of the same size;
- data: the sha256 of each manifest's *content* (with its mixture weight) is recorded in
  ``meta.json``; resuming on other data is refused unless ``data.allow_change_on_resume: true``,
  in which case the change is logged and recorded in every later checkpoint (``data_changes``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

import yaml

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import to_dict
from ascender_dist.config.resolve import Derived
from ascender_dist.config.schema import RunConfig
from ascender_dist.training.checkpoint import UNIVERSAL, CheckpointError, read_meta, recorded_tokenizer_sha256
from data_pipeline.shards import MANIFEST_NAME

log = logging.getLogger(__name__)

# Fields whose change leaves the weights' meaning alone: dropouts, the init std (read by a fresh
# start only), ``preset`` (its values are resolved into fields), and the tiling of ASCender's CPU
# fast path (the same function in other tiles; a smaller max_tile_elems is how an out-of-memory
# job resumes).
EXEMPT_MODEL_FIELDS = {"preset", "hidden_dropout", "attention_dropout", "init_method_std", "ascender.chunk_size",
                       "ascender.max_tile_elems"}
# Values that mean the same model: vocab_size 0 acts like None (the tokenizer's size, padded).
_SAME_MEANING = {"vocab_size": lambda value: value or None}


def _flatten(tree: dict, prefix: str) -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def data_sources(cfg: RunConfig) -> list[tuple[str, float]]:
    d = cfg.data
    return [(m.manifest, m.weight) for m in d.mixture] if d.mixture else [(d.manifest, 1.0)]


def data_fingerprint(cfg: RunConfig) -> str:
    """sha256 over (content sha256, weight) of every manifest, in mixture order: moving or renaming
    the shards' directory keeps it, any change to what the manifests list changes it."""
    parts = []
    for manifest, weight in data_sources(cfg):
        if not manifest:  # no data configured (a conversion's throw-away trainer)
            parts.append(["", weight])
            continue
        path = Path(manifest)
        if path.is_dir():  # a manifest given by its directory, as the loader accepts it
            path = path / MANIFEST_NAME
        try:
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError("data.mixture" if cfg.data.mixture else "data.manifest",
                              f"{manifest}: unreadable ({exc.strerror or exc})") from None
        parts.append([content, weight])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def data_tokenizer_sha256(loader) -> Optional[str]:
    """The sha256 of the tokenizer the datasets of ``loader`` (a StreamingLoader) were made with:
    their manifests' (for plain shard URLs, the first shard read's; the loader refuses a mixture of
    two tokenizers), or None when no source records one."""
    made_with = {ds.checks.tokenizer_sha256 for ds in loader.datasets} - {None}
    return made_with.pop() if len(made_with) == 1 else None


def _check_data_tokenizer(cfg: RunConfig, meta: dict, tag_dir: Path, data_sha256: Optional[str]) -> None:
    recorded = meta.get("data_tokenizer_sha256")
    if not isinstance(recorded, str) or not data_sha256 or data_sha256 == recorded:
        return
    field = "data.mixture" if cfg.data.mixture else "data.manifest"
    sources = ", ".join(m for m, _ in data_sources(cfg))
    raise ConfigError(field, f"{sources} was made with tokenizer sha256 {data_sha256[:12]}..., checkpoint {tag_dir} "
                             f"was trained on data made with {recorded[:12]}... ({tag_dir / 'meta.json'} "
                             "data_tokenizer_sha256): its token ids mean other pieces; data of another tokenizer "
                             "needs a new run (another checkpoint.dir)")


def _saved_model(tag_dir: Path) -> dict:
    """The model section of the config a checkpoint was saved with (every save writes config.yaml:
    without it the resume could not tell a model of other shapes until loading failed)."""
    path = tag_dir / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every save writes it): the model this checkpoint was trained "
                              "with cannot be checked")
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise CheckpointError(f"{path}: holds no model section (empty or not a run config): the model this "
                              "checkpoint was trained with cannot be checked")
    return saved["model"]


def _meaning(key: str, value, model: dict):
    """``value`` of the model field ``key`` (dotted, ``model.`` first) in the form compared on resume;
    ``model``: the flattened model section it belongs to. ASCender's k counts up to seq_length - 1
    (every other key): a run saved with a larger k resumes with k = seq_length - 1, which new configs
    must use (config.architectures.check_neighbour_count)."""
    if key == "model.ascender.k" and isinstance(value, int) and isinstance(model.get("model.seq_length"), int):
        return min(value, model["model.seq_length"] - 1)
    same = _SAME_MEANING.get(key.removeprefix("model."))
    return same(value) if same else value


def check_model(cfg: RunConfig, tag_dir: Path) -> None:
    saved = _saved_model(tag_dir)
    ours, theirs = _flatten(to_dict(cfg)["model"], "model."), _flatten(saved, "model.")
    differ = [key for key in ours if key in theirs and key.removeprefix("model.") not in EXEMPT_MODEL_FIELDS
              and _meaning(key, ours[key], ours) != _meaning(key, theirs[key], theirs)]
    if differ:
        more = f" (also differ: {', '.join(differ[1:])})" if len(differ) > 1 else ""
        raise ConfigError(differ[0], f"checkpoint {tag_dir} has {theirs[differ[0]]!r}, the config has "
                          f"{ours[differ[0]]!r}{more}; resume with the checkpoint's model, or start a new "
                          f"checkpoint.dir")


def _data_changes(meta: dict, tag_dir: Path) -> list:
    """meta.json's record of the data changes made on earlier resumes (a list of dicts), carried
    into the next checkpoints; anything else is a damaged meta.json, named in one line (a string
    would be carried on split into characters)."""
    changes = meta.get("data_changes", [])
    if not isinstance(changes, list) or not all(isinstance(change, dict) for change in changes):
        raise CheckpointError(f"{tag_dir / 'meta.json'}: data_changes: expected a list of records, got "
                              f"{str(changes)[:80]!r}")
    return list(changes)


def check_tokenizer(cfg: RunConfig, meta: dict, tag_dir: Path, derived: Optional[Derived] = None,
                    loaded_sha256: Optional[str] = None) -> None:
    """Raise ConfigError naming ``data.tokenizer`` (or ``model.vocab_size``) if the run's tokenizer
    is not the one the checkpoint in ``tag_dir`` was trained with: its sha256 against meta.json's
    ``tokenizer_sha256`` when recorded, and (with the run's ``derived`` sizes) the vocab sizes
    meta.json records, the only check left for an older checkpoint without the sha256.
    ``loaded_sha256``: that of the tokenizer the run loaded (the trainer's; the file may have been
    replaced since), else the file is hashed."""
    meta_file = tag_dir / "meta.json"
    recorded = recorded_tokenizer_sha256(meta)
    if recorded and not cfg.data.tokenizer:
        raise ConfigError("data.tokenizer", f"not set, but checkpoint {tag_dir} was trained with a tokenizer "
                                            f"({meta_file} tokenizer_sha256 {recorded[:12]}...): set data.tokenizer "
                                            "to that tokenizer")
    if recorded:
        from data_pipeline.tokenizer import tokenizer_sha256

        try:
            found = loaded_sha256 or tokenizer_sha256(Path(cfg.data.tokenizer))
        except OSError as exc:
            raise ConfigError("data.tokenizer", f"{cfg.data.tokenizer}: unreadable ({exc.strerror or exc})") from None
        if found != recorded:
            raise ConfigError("data.tokenizer", f"{cfg.data.tokenizer} (sha256 {found[:12]}...) is not the tokenizer "
                                                f"checkpoint {tag_dir} was trained with ({meta_file} tokenizer_sha256 "
                                                f"{recorded[:12]}...): resume with that tokenizer; another tokenizer "
                                                "needs a new run (another checkpoint.dir)")
    if derived is None:
        return
    field = "model.vocab_size" if cfg.model.vocab_size else "data.tokenizer"
    for key, ours in (("vocab_size", derived.vocab_size), ("padded_vocab_size", derived.padded_vocab_size)):
        theirs = meta.get(key)
        if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs != ours:
            raise ConfigError(field, f"gives {key} {ours}, but checkpoint {tag_dir} was trained with {theirs} "
                                     f"({meta_file}): resume with the tokenizer and model.vocab_size it was trained "
                                     "with")


def check_resume(cfg: RunConfig, checkpoint_dir: Path, tag: str, log_it: bool,
                 derived: Optional[Derived] = None, tokenizer_sha256: Optional[str] = None,
                 data_tokenizer: Optional[str] = None) -> dict:
    """Raise ConfigError if ``tag`` (a universal copy: its source) holds another model, was trained
    with another tokenizer (``derived``: the run's sizes, checked against the recorded ones when
    given; ``tokenizer_sha256``: the loaded tokenizer's, see check_tokenizer), on data made with
    another tokenizer (``data_tokenizer``: data_tokenizer_sha256 of the run's loader) or on other
    data (unless allowed). Returns the data record for the run's next checkpoints: ``data_fingerprint``
    and the list of ``data_changes`` made on resumes."""
    source = tag.removesuffix(UNIVERSAL)
    tag_dir = Path(checkpoint_dir) / source
    check_model(cfg, tag_dir)
    meta = read_meta(checkpoint_dir, source)
    check_tokenizer(cfg, meta, tag_dir, derived, loaded_sha256=tokenizer_sha256)
    _check_data_tokenizer(cfg, meta, tag_dir, data_tokenizer)
    current, saved = data_fingerprint(cfg), meta.get("data_fingerprint")
    changes = _data_changes(meta, tag_dir)
    if saved is not None and saved != current:
        field = "data.mixture" if cfg.data.mixture else "data.manifest"
        sources = ", ".join(m for m, _ in data_sources(cfg))
        if not cfg.data.allow_change_on_resume:
            raise ConfigError(field, f"{sources} differs from the data checkpoint {tag_dir} was trained on "
                              f"(manifest content sha256 {current[:12]} vs {saved[:12]}); set "
                              f"data.allow_change_on_resume: true to resume on it anyway")
        changes.append({"step": meta.get("step"), "from": saved, "to": current, "manifests": sources})
        if log_it:
            log.warning("resuming %s on other data (%s; data.allow_change_on_resume: true); recorded in the "
                        "next checkpoints' meta.json as data_changes", tag_dir, sources)
    return {"data_fingerprint": current, "data_changes": changes}
