"""Checkpoint conversion: training checkpoint (any TP/PP/DP/ZeRO layout) <-> consolidated weights.

A *consolidated* directory is layout-free:
    model.safetensors   fp32 tensors under canonical names (megatron GPTModel at TP=1), vocab
                        padding stripped (rows >= the tokenizer's vocab size removed)
    config.yaml         the run's config (parallel layout reset to 1 x 1)
    meta.json           architecture, vocab sizes, source step/layout, data-loader state, versions,
                        size and sha256 of model.safetensors (checked whenever it is read)

``consolidate`` and ``reshard`` are collective: they run under the deepspeed launcher with the
layout's world size (the CLI re-launches itself that way), load through the same engine as
training, so every layout (PP, ZeRO-3 partitions, TP shards) is read by tested code paths.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ascender_dist.config.errors import ConfigError, UserError
from ascender_dist.config.loader import dump_yaml, read_yaml_file, to_dict
from ascender_dist.config.resolve import config_from_dict, config_with_overrides, named_source
from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.checkpoint import recorded_tokenizer_sha256
from ascender_dist.training.publish import publish_directory
from ascender_dist.training.weights import strip_vocab_padding
from data_pipeline._io import sha256_file

log = logging.getLogger("ascender_dist")

SUPPORTED_VERSIONS = {"megatron-core": ("0.16.1",), "deepspeed": ("0.19.8",)}


class ConversionError(UserError, ValueError):
    """A checkpoint cannot be converted; ``str(e)`` is one line naming the file and the mismatch."""

    def __init__(self, where, problem: str):
        super().__init__(f"{where}: {problem}")


# ----------------------------------------------------------------------------- metadata files
def read_json_file(path: Path) -> dict:
    """A JSON metadata file (meta.json, config.json) as a dict; problems are one-line ConversionErrors."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(path, "missing") from None
    except UnicodeDecodeError as exc:
        raise ConversionError(path, f"not UTF-8 text (byte {exc.start}): corrupt file") from None
    except json.JSONDecodeError as exc:
        raise ConversionError(path, f"invalid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}): "
                                    "truncated or corrupt") from None
    except (ValueError, RecursionError) as exc:  # an integer past Python's digit limit; nesting past the stack
        raise ConversionError(path, f"JSON this reader cannot hold ({' '.join(str(exc).split())[:100]}): "
                                    "corrupt?") from None
    except OSError as exc:
        raise ConversionError(path, f"cannot read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise ConversionError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def read_config_file(path: Path) -> dict:
    """A run's config.yaml as a raw mapping, read by the strict config loader (YAML 1.2 floats such as
    ``1e-4``, no duplicate keys); problems are one-line ConversionErrors naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(path, "missing")
    try:
        return read_yaml_file(path)
    except ConfigError as exc:
        raise ConversionError(path, str(exc).removeprefix(f"{path}: ")) from None


def require_fields(meta: dict, meta_file: Path, fields: dict) -> None:
    """Each ``name: type`` of ``fields`` is present in ``meta`` with that type (bools are not ints)."""
    for name, kind in fields.items():
        if name not in meta:
            raise ConversionError(meta_file, f"no {name!r} field (truncated or written by another tool)")
        value = meta[name]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ConversionError(meta_file, f"{name}: expected {getattr(kind, '__name__', kind)}, "
                                             f"got {type(value).__name__} {value!r}")


# ----------------------------------------------------------------------------- reading checkpoints
def _available_tags(checkpoint_dir: Path, shown: int = 8) -> str:
    """``available: step_2, step_4`` (the newest ``shown`` complete tags), or that there are none."""
    tags = ckpt.complete_tags(checkpoint_dir)
    if not tags:
        return "the directory holds no complete checkpoint"
    listed = ", ".join(tags[-shown:])
    return f"available: {listed}" if len(tags) <= shown else f"available: ..., {listed} ({len(tags)} in all)"


def resolve_tag(checkpoint_dir: Path, tag: Optional[str]) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ConversionError(checkpoint_dir, "checkpoint directory not found")
    if tag is None:
        try:
            tag = ckpt.latest_tag(checkpoint_dir)
        except ckpt.CheckpointError as exc:
            raise ConversionError(checkpoint_dir / ckpt.LATEST, str(exc).split(": ", 1)[-1]) from None
        if tag is None:
            raise ConversionError(checkpoint_dir, f"no complete checkpoint (no '{ckpt.LATEST}' file, or its first "
                                                  "save did not finish): not a training checkpoint directory?")
    tag_dir = checkpoint_dir / tag
    unpadded = re.fullmatch(r"step_(\d{1,18})", tag)
    if not tag_dir.is_dir() and unpadded:  # step_10 names step_00000010: the docs write tags as step_N
        padded = checkpoint_dir / ckpt.tag_for_step(int(unpadded.group(1)))
        tag_dir = padded if padded.is_dir() else tag_dir
    if not tag_dir.is_dir():
        raise ConversionError(tag_dir, f"no such checkpoint tag ({_available_tags(checkpoint_dir)})")
    if not (tag_dir / ckpt.COMPLETE).is_file():
        raise ConversionError(tag_dir, f"incomplete checkpoint (no {ckpt.COMPLETE} marker: the save did not finish)")
    return tag_dir


def read_meta(tag_dir: Path, expect_architecture: Optional[str] = None) -> dict:
    meta_file = Path(tag_dir) / "meta.json"
    if not meta_file.is_file():
        raise ConversionError(meta_file, "missing (checkpoint written by an older ascender-dist or another tool)")
    meta = read_json_file(meta_file)
    if meta.get("format") != ckpt.FORMAT_VERSION:
        raise ConversionError(meta_file, f"checkpoint format {meta.get('format')!r}, this converter reads "
                                         f"{ckpt.FORMAT_VERSION}")
    require_fields(meta, meta_file, {"versions": dict, "architecture": str, "world_size": int, "vocab_size": int})
    if meta["world_size"] < 1:
        raise ConversionError(meta_file, f"world_size: must be >= 1 (got {meta['world_size']})")
    for package, known in SUPPORTED_VERSIONS.items():
        found = meta["versions"].get(package)
        if found not in known:
            raise ConversionError(meta_file, f"written with {package} {found}, the converter knows {', '.join(known)}")
    if expect_architecture and meta["architecture"] != expect_architecture:
        raise ConversionError(meta_file, f"architecture is {meta['architecture']!r}, expected {expect_architecture!r}")
    return meta


def one_device_layout(raw: dict) -> dict:
    """A raw run config laid out on one device, as a consolidated directory records it: tensor and
    pipeline sizes 1, hence no sequence parallelism (which needs tensor parallelism)."""
    raw["parallel"] = {**raw.get("parallel", {}), "tensor_model_parallel_size": 1,
                       "pipeline_model_parallel_size": 1, "sequence_parallel": False}
    return raw


def read_config(directory: Path, one_device: bool = False):
    """The run config of a checkpoint tag or (``one_device``) of a consolidated directory: those
    written before one_device_layout turned sequence parallelism off are read as if it had."""
    config_file = Path(directory) / "config.yaml"
    raw = read_config_file(config_file)
    if one_device:
        one_device_layout(raw)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        raise ConversionError(config_file, str(exc)) from None


# ----------------------------------------------------------------------------- output directories
CONSOLIDATED_FORMAT = "ascender-dist-consolidated"  # model.safetensors header metadata: our own output


def is_consolidated_output(directory: Path) -> bool:
    """``directory`` was written by :func:`write_consolidated` (its meta.json and config.yaml next to a
    model.safetensors whose header says ``format: ascender-dist-consolidated``), so replacing it
    loses nothing the user did not ask to replace. A training checkpoint tag holds meta.json and
    config.yaml too, but no such weights file."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    if not ((directory / "meta.json").is_file() and (directory / "config.yaml").is_file()):
        return False
    try:
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return (f.metadata() or {}).get("format") == CONSOLIDATED_FORMAT
    except (SafetensorError, OSError):
        return False


def within(path: Path, ancestor: Path) -> bool:
    """``path`` is ``ancestor`` or lies inside it (both resolved by the caller)."""
    return path == ancestor or ancestor in path.parents


def check_output_dir(out_dir: Path, source: Path, tool: str, is_previous_output, marker: str,
                     inside_source_ok: bool = False, own_entries=None) -> None:
    """Refuse an ``--out`` whose replacement would lose data, before any work (and before a command
    re-launches itself on several ranks): the converters write a temporary sibling, then replace
    whatever ``out_dir`` holds by it (:func:`staged_output`). ``out_dir`` may be missing, empty or a
    previous output of ``tool`` (``is_previous_output(dir)``, recognised by ``marker``: users re-run
    exports); never the input ``source``, a directory holding it, a path inside it (unless
    ``inside_source_ok``), a file, or a directory of anything else; nor a previous output holding
    entries the tool did not write (``own_entries(dir)``: their names, None if unknown), which the
    replacement would delete (refused here, not after all the work: replace_output checks again).
    Errors are one line naming the path and why."""
    out_dir, source = Path(out_dir), Path(source)
    if out_dir.name in ("", ".", ".."):  # it is replaced through a sibling: it needs a name of its own
        raise ConversionError(out_dir, "name the output directory itself (not '.' or '..'): it is written "
                                       "as a new directory and replaces what the path holds")
    if out_dir.is_symlink():
        raise ConversionError(out_dir, "output path is a symbolic link: name the directory itself")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(out_dir, "output path is an existing file, not a directory")
    out, src = out_dir.resolve(), source.resolve()
    if out == src:
        raise ConversionError(out_dir, f"output is the input directory {source}: writing it would replace the "
                                       "input; choose another --out")
    if within(src, out):
        raise ConversionError(out_dir, f"output directory contains the input {source}: replacing it would delete "
                                       "the input; choose another --out")
    if within(out, src) and not inside_source_ok:
        raise ConversionError(out_dir, f"output is inside the input directory {source}; choose a directory "
                                       "outside it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_previous_output(out_dir):
        raise ConversionError(out_dir, f"exists, is not empty and is not a previous {tool} output (no {marker}): "
                                       "refusing to replace it; choose a new --out or empty it yourself")
    own = own_entries(out_dir) if own_entries is not None and out_dir.is_dir() else None
    if own is not None:
        _refuse_entries_replacing_would_delete(out_dir, own)


CONSOLIDATED_FILES = frozenset({"meta.json", "config.yaml", "model.safetensors"})  # what consolidate writes


def check_consolidate_out(out_dir: Path, checkpoint_dir: Path) -> None:
    """:func:`check_output_dir` for ``consolidate`` (input: the training checkpoint directory)."""
    check_output_dir(out_dir, checkpoint_dir, "consolidate", is_consolidated_output,
                     f"meta.json + config.yaml + model.safetensors of format {CONSOLIDATED_FORMAT!r}",
                     own_entries=lambda _: CONSOLIDATED_FILES)


def check_reshard_out(out_dir: Path, consolidated_dir: Path) -> None:
    """``reshard`` starts a training checkpoint directory: refuse the input itself, a path inside it,
    a file, and a directory that already holds training checkpoints (its ``latest`` would move back
    to the consolidated step, behind newer checkpoints that pruning could then delete)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(out_dir, "output path is an existing file, not a directory")
    if within(out_dir.resolve(), Path(consolidated_dir).resolve()):
        raise ConversionError(out_dir, f"output is or is inside the input directory {consolidated_dir}; "
                                       "choose a directory outside it")
    held = ckpt.held_tags(out_dir)
    if held:
        raise ConversionError(out_dir, f"already holds training checkpoints (newest {held[-1]}): reshard into "
                                       "a new directory")


def staging_dir(out_dir: Path) -> Path:
    """This process's temporary sibling of ``out_dir``, named by its PID: two writers of the same
    output (lm-eval processes exporting one cache) never delete each other's work."""
    return out_dir.with_name(f".{out_dir.name}.tmp.{os.getpid()}")


def _write_problem(exc: BaseException) -> str:
    """An OSError or a safetensors write error as a short phrase (``No space left on device``)."""
    return getattr(exc, "strerror", None) or " ".join(str(exc).split()) or type(exc).__name__


LM_EVAL_EXPORT_SUBDIR = ".hf-export"  # the lm-eval adapter's export cache inside a consolidated run (and its lock)


_LM_EVAL_CACHE_NAMES = re.compile(rf"\.?{re.escape(LM_EVAL_EXPORT_SUBDIR)}(\.lock|\.(tmp|old)\.\d+)?")


def _lm_eval_cache(name: str) -> bool:
    """The lm-eval export cache (derived from the weights being replaced), its lock, and the staging and
    moved-aside siblings a crashed export of it leaves (``..hf-export.tmp.<pid>``, ``..hf-export.old.<pid>``);
    exactly those names (a user's ``hf-export-results/`` is the user's)."""
    return _LM_EVAL_CACHE_NAMES.fullmatch(name) is not None


def _entries_not_in(out_dir: Path, names) -> list[str]:
    """What ``out_dir`` holds beyond ``names`` and the lm-eval cache: files a user added (a model
    card, evaluation results)."""
    if not out_dir.is_dir():
        return []
    return sorted(entry.name + ("/" if entry.is_dir() else "") for entry in out_dir.iterdir()
                  if entry.name not in names and not _lm_eval_cache(entry.name))


def _refuse_entries_replacing_would_delete(out_dir: Path, names, when: str = "nothing was written") -> None:
    extra = _entries_not_in(out_dir, names)
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise ConversionError(out_dir, f"holds {shown}, which the new output does not: replacing it would delete "
                                       f"them; move them out of it, or choose a new --out ({when})")


def replace_output(tmp: Path, out_dir: Path, own_entries=None) -> None:
    """Publish the finished ``tmp`` as ``out_dir`` (refused in one line when ``out_dir`` holds entries
    the new output does not and the previous output did not write, ``own_entries(out_dir)`` as in
    :func:`check_output_dir`: replacing would delete a user's files; a file only the previous
    output wrote, such as a module an older export vendored, is replaced with it): its files and directories are synced
    (:func:`checkpoint.sync_tree`), the previous output is renamed aside, ``tmp`` renamed in
    (:func:`~ascender_dist.training.publish.publish_directory`), the parent directory synced (the
    renames), and only then the old copy deleted. If the second rename fails, the previous output
    is renamed back; after a crash between the two renames it survives as ``.<name>.old.<pid>``
    next to ``out_dir``."""
    previous = own_entries(out_dir) if own_entries is not None and out_dir.is_dir() else None
    _refuse_entries_replacing_would_delete(out_dir, {entry.name for entry in tmp.iterdir()} | (previous or set()),
                                           "nothing was replaced")
    aside = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
    ckpt.sync_tree(tmp)  # an OSError here: nothing was replaced (staged_output says so)
    try:
        publish_directory(tmp, out_dir, aside)
    except OSError as exc:
        restored = ""
        if aside.is_dir() and not out_dir.exists():
            try:
                os.replace(aside, out_dir)
                restored = ", the previous output is kept"
            except OSError:
                restored = f", the previous output is in {aside.name}"
        raise ConversionError(out_dir, f"cannot rename the new output into place ({_write_problem(exc)})"
                                       f"{restored}") from None
    try:
        ckpt.fsync_dir(out_dir.parent)  # the renames, before the only other copy goes
    except OSError as exc:
        kept = f"; the previous output is kept in {aside.name}" if aside.exists() else ""
        raise ConversionError(out_dir, f"the new output is in place but its directory could not be synced "
                                       f"({_write_problem(exc)}){kept}") from None
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def staged_output(out_dir: Path, own_entries=None) -> Iterator[Path]:
    """A fresh temporary sibling of ``out_dir`` (:func:`staging_dir`) to write an output into; when
    the block ends it replaces ``out_dir`` (:func:`replace_output`, with ``own_entries``). On any failure the temporary
    directory is removed and ``out_dir`` keeps what it held; a write error (disk full, permission,
    safetensors' I/O errors) is a one-line ConversionError naming ``out_dir``."""
    from safetensors import SafetensorError

    out_dir = Path(out_dir)
    tmp = staging_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed process that had this PID
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise ConversionError(out_dir, f"cannot create the output directory ({_write_problem(exc)})") from None
    try:
        yield tmp
        replace_output(tmp, out_dir, own_entries)
    except (OSError, SafetensorError) as exc:
        raise ConversionError(out_dir, f"writing the output failed ({_write_problem(exc)}); nothing was "
                                       "replaced") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- collective steps
def _setup(cfg, vocab_size: int):
    import torch.distributed as dist

    from ascender_dist.config.resolve import derive
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group

    init_process_group()
    derived = derive(cfg, dist.get_world_size(), vocab_size)
    p = cfg.parallel
    pstate = init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, cfg.train.seed)
    return derived, pstate


def consolidate(checkpoint_dir: Path, out_dir: Path, tag: Optional[str] = None,
                expect_architecture: Optional[str] = None) -> Optional[Path]:
    """Collective (world size of the checkpoint's layout). Writes ``out_dir`` on rank 0."""
    import torch.distributed as dist

    from ascender_dist.training.engine import build_engine
    from ascender_dist.training.weights import gather_canonical_state

    check_consolidate_out(out_dir, checkpoint_dir)  # every rank, before the process group: no rank waits
    tag_dir = resolve_tag(checkpoint_dir, tag)
    meta = read_meta(tag_dir, expect_architecture)
    cfg = read_config(tag_dir)
    derived, _ = _setup(cfg, meta["vocab_size"])
    if dist.get_world_size() != meta["world_size"]:
        raise ConversionError(tag_dir, f"saved by {meta['world_size']} ranks, this conversion runs on "
                                       f"{dist.get_world_size()}")
    engine = build_engine(cfg, derived)
    ckpt.load_checkpoint(engine, Path(checkpoint_dir), tag_dir.name)
    state = gather_canonical_state(engine.module, cfg, progress=True)
    if dist.get_rank() == 0:
        state = strip_vocab_padding(state, meta["vocab_size"])
        write_consolidated(out_dir, state, cfg, {**meta, "source": str(tag_dir)})
    dist.barrier()
    return Path(out_dir)


def write_consolidated(out_dir: Path, state: dict, cfg, meta: dict) -> None:
    """Write into a temporary sibling directory, then publish it (:func:`staged_output`): never a
    half-written output, and a failure leaves what ``out_dir`` held. What ``out_dir`` held is
    replaced: callers check it first (:func:`check_consolidate_out`)."""
    from ascender_dist.training.weights import write_weights_file

    out_dir = Path(out_dir)
    raw = one_device_layout(to_dict(cfg))
    raw["checkpoint"]["init_from"] = None
    config_from_dict(raw)  # what it writes, read_consolidated can read
    with staged_output(out_dir) as tmp:
        weights = tmp / "model.safetensors"
        write_weights_file(state, weights, metadata={"format": CONSOLIDATED_FORMAT})
        (tmp / "config.yaml").write_text(dump_yaml(raw))
        # read_consolidated checks them: a flipped byte in the tensor data loads without an error
        meta = {**meta, "weights_bytes": weights.stat().st_size, "weights_sha256": sha256_file(weights)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    log.info("consolidated %d tensors into %s", len(state), out_dir)


def read_consolidated(directory: Path, expect_architecture: Optional[str] = None):
    """(state, cfg, meta) of a consolidated directory, with one-line errors."""
    from ascender_dist.training.weights import read_weights_file

    directory = Path(directory)
    weights = directory / "model.safetensors"
    meta_file = directory / "meta.json"
    for required in (weights, meta_file):
        if not required.is_file():
            raise ConversionError(required, "missing: not a consolidated directory (run `ascender-dist consolidate`)")
    meta = read_json_file(meta_file)
    require_fields(meta, meta_file, {"architecture": str})
    if expect_architecture and meta["architecture"] != expect_architecture:
        raise ConversionError(meta_file, f"architecture is {meta['architecture']!r}, expected {expect_architecture!r}")
    cfg = read_config(directory, one_device=True)
    check_recorded_weights(weights, meta, meta_file)
    try:
        state = read_weights_file(weights, field=None)
    except ConfigError as exc:
        raise ConversionError(weights, exc.message) from None
    return state, cfg, meta


def check_recorded_weights(weights: Path, meta: dict, meta_file: Path) -> None:
    """One-line ConversionError when ``weights`` is not the file consolidate wrote: its size or sha256
    differs from what ``meta_file`` records (directories written before they were recorded: not
    checked)."""
    size, digest = meta.get("weights_bytes"), meta.get("weights_sha256")
    if size is not None and weights.stat().st_size != size:
        raise ConversionError(weights, f"{weights.stat().st_size} bytes, {meta_file} records {size}: truncated or "
                                       "replaced (consolidate again)")
    if digest is not None and sha256_file(weights) != digest:
        raise ConversionError(weights, f"sha256 differs from {meta_file}'s weights_sha256 {str(digest)[:12]}...: "
                                       "corrupt or modified (consolidate again)")


def reshard_config(cfg, checkpoint_dir: Path, overrides: list[str], source: Path, data_parallel: Optional[int] = None):
    """The run config of a reshard: the consolidated run's config + ``--set`` overrides, validated
    like any run config (and against the target world size when ``data_parallel`` is given).
    The run it builds only writes a checkpoint into ``checkpoint_dir``: it has no log sinks (no
    TensorBoard, no W&B, whatever the source run or ``--set`` says) and its output_dir is
    ``checkpoint_dir``, so nothing is written into the source run's directories, a W&B run of the
    source is not resumed, and an unwritable source output_dir does not matter."""
    from ascender_dist.config.resolve import validate

    fixed = {"checkpoint": {"dir": str(checkpoint_dir), "auto_resume": False, "init_from": None},
             "output_dir": str(checkpoint_dir),
             "logging": {"tensorboard": False, "wandb": {"project": "", "entity": None, "mode": "disabled"}}}
    cfg = config_with_overrides(to_dict(cfg), overrides, str(source), fixed)
    if data_parallel is not None:
        if data_parallel < 1:
            raise ConfigError("--data-parallel", f"must be >= 1 (got {data_parallel})")
        p = cfg.parallel
        try:
            validate(cfg, p.tensor_model_parallel_size * p.pipeline_model_parallel_size * data_parallel)
        except ConfigError as exc:  # the layout at this --data-parallel: name it and whose setting failed
            named = named_source(exc, source, overrides)
            raise ConfigError(named.path, f"{named.message} (at --data-parallel {data_parallel})") from None
    return cfg


def check_reshard_data(cfg, source: Path) -> None:
    """The data the reshard's run builds its loader from is named and, for local manifests, exists:
    checked before the ranks start (each rank would fail alone after the launch). ``source``: the
    config.yaml the settings came from."""
    from ascender_dist.training.run import loader_source
    from data_pipeline.shards import MANIFEST_NAME

    src, _ = loader_source(cfg)
    manifests = [m for m, _ in src] if isinstance(src, list) else [src]
    fields = [f"data.mixture[{i}].manifest" for i in range(len(manifests))] if isinstance(src, list) else ["data.manifest"]
    for field_name, manifest in zip(fields, manifests):
        text = str(manifest or "").strip()
        if not text:
            raise ConversionError(source, f"{field_name}: not set; reshard builds the run's data loader (pass "
                                          f"--set {field_name}=PATH)")
        if "://" in text or text.startswith("pipe:"):  # a URL pattern: read by the loader, not checked here
            continue
        # what the loader reads as a manifest (data_pipeline.loader): a .json file, or a directory holding one
        wanted = Path(text) / MANIFEST_NAME if Path(text).is_dir() else Path(text)
        if wanted.suffix == ".json" and not wanted.is_file():
            raise ConversionError(wanted, f"{field_name} of {source} not found here; reshard builds the run's data "
                                          f"loader (pass --set {field_name}=PATH)")


def refuse_other_tokenizer(path, found: str, meta: dict, meta_file: Path, trained: str = "the weights were",
                           note: str = "") -> None:  # fmt: skip
    """One-line ConversionError naming ``path`` when its sha256 ``found`` is not the recorded one
    (nothing to compare when meta.json records none)."""
    recorded = recorded_tokenizer_sha256(meta)
    if recorded and found != recorded:
        raise ConversionError(path, f"sha256 {found[:12]}... is not the tokenizer {trained} trained with "
                                    f"({meta_file} tokenizer_sha256 {recorded[:12]}...{note})")


def check_reshard_tokenizer(cfg, meta: dict, meta_file: Path) -> None:
    """The tokenizer the reshard's run loads (``data.tokenizer``) is the one the weights were trained
    with (``meta_file``'s ``tokenizer_sha256``, when recorded): the new checkpoint records the
    loaded one's, and a replaced file would relabel the weights."""
    from data_pipeline.tokenizer import tokenizer_sha256

    if not (recorded_tokenizer_sha256(meta) and cfg.data.tokenizer):
        return
    try:
        found = tokenizer_sha256(Path(cfg.data.tokenizer))
    except OSError as exc:
        raise ConversionError(cfg.data.tokenizer, f"cannot read the run's tokenizer (data.tokenizer: "
                                                  f"{exc.strerror or exc})") from None
    refuse_other_tokenizer(cfg.data.tokenizer, found, meta, meta_file)


def reshard(consolidated_dir: Path, checkpoint_dir: Path, overrides: list[str]) -> None:
    """Collective: write a training checkpoint of the layout in ``overrides`` (e.g.
    parallel.tensor_model_parallel_size=2) from consolidated weights; ``train`` resumes from it.
    Weights, step, LR schedule position and data position carry over; AdamW moments start at zero.
    The run is built without log sinks (:func:`reshard_config`); it still builds the data loader,
    so the tokenizer and the data manifests must be readable at the paths the config names."""
    from ascender_dist.training.trainer import Trainer
    from ascender_dist.versions import unknown_git_state

    check_reshard_out(checkpoint_dir, consolidated_dir)  # every rank, before the process group
    state, cfg, meta = read_consolidated(consolidated_dir)
    meta_file = Path(consolidated_dir) / "meta.json"
    require_fields(meta, meta_file, {"step": int, "data": dict})
    cfg = reshard_config(cfg, checkpoint_dir, overrides, Path(consolidated_dir) / "config.yaml")
    check_reshard_tokenizer(cfg, meta, meta_file)
    # the code that trained these weights, not this reshard's (unknown for a source that records none)
    trainer = Trainer(cfg, init_state=state, code_record=meta.get("code") or unknown_git_state())
    trainer.loader.load_state_dict(meta["data"])  # the LR follows from the step (training.lr_schedule)
    trainer.save(step=int(meta["step"]))
