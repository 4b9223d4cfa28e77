"""Crash-safe checkpoints on top of DeepSpeed's save/load.

DeepSpeed writes one directory per tag; it moves its own ``latest`` file as it goes, so a crash
mid-save can leave ``latest`` naming a half-written tag. We never let DeepSpeed touch ``latest``,
and never write into a directory a complete checkpoint lives in:

1. every rank writes its shard into a staging directory ``<dir>/<tag>.partial/``;
2. all ranks meet at a barrier; rank 0 drops a ``COMPLETE`` marker into the staging directory
   and renames it to ``<dir>/<tag>`` (a complete checkpoint of the same step, left by an earlier
   run into the same directory, is first renamed aside to ``<tag>.replaced``, removed last);
3. only then rank 0 replaces ``<dir>/latest`` atomically (temporary file + ``os.replace``).

A crash at any moment therefore leaves ``latest`` naming a complete checkpoint; in the one window
where it names a tag just renamed aside, ``latest_tag`` reads the ``.replaced`` copy, which is
complete. Per-rank RNG states are saved next to DeepSpeed's files so a resumed run draws the same
random numbers (dropout) as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ascender_dist.config.errors import UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of the files we add next to DeepSpeed's (COMPLETE, meta.json, config.yaml, rng/)
LATEST = "latest"
COMPLETE = "COMPLETE"
PARTIAL = ".partial"  # suffix of a tag being written
REPLACED = ".replaced"  # suffix of a complete tag moved aside by a save of the same step
_TAG_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; ``str(e)`` is one line naming it."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of_tag(tag: str) -> int:
    match = _TAG_RE.match(tag)
    if not match:
        raise CheckpointError(f"checkpoint tag {tag!r} is not of the form step_<N>")
    return int(match.group(1))


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prepare_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Create the checkpoint directory at start-up (every rank; shared storage), so that a path that
    is a file or not writable stops the run before it trains, not at its first save."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory is an existing file")
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{checkpoint_dir}: cannot create the checkpoint directory "
                              f"({exc.strerror or exc})") from None
    if not os.access(checkpoint_dir, os.W_OK):
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory is not writable")


def latest_tag(checkpoint_dir: Path) -> Optional[str]:
    """The tag ``latest`` names, if it is complete; None when there is no checkpoint yet.

    Refuses a directory that holds complete checkpoints but no ``latest`` (deleted by hand?):
    starting from step 0 there would silently orphan them, and later saves could replace them."""
    pointer = Path(checkpoint_dir) / LATEST
    if not pointer.is_file():
        found = complete_tags(checkpoint_dir)
        if found:
            raise CheckpointError(f"{pointer}: missing, but the directory holds complete checkpoints (newest "
                                  f"{found[-1]}); restore it (`echo {found[-1]} > {pointer}`) or use a new "
                                  f"checkpoint.dir")
        return None
    tag = pointer.read_text(encoding="utf-8").strip()
    if (Path(checkpoint_dir) / tag / COMPLETE).is_file():
        return tag
    if (Path(checkpoint_dir) / (tag + REPLACED) / COMPLETE).is_file():  # a save crashed mid-swap
        log.warning("%s: %s is being replaced; reading the complete copy %s%s", pointer, tag, tag, REPLACED)
        return tag + REPLACED
    raise CheckpointError(f"{pointer}: names {tag!r}, which has no {COMPLETE} marker (corrupt checkpoint dir)")


def complete_tags(checkpoint_dir: Path) -> list[str]:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    tags = [p.name for p in checkpoint_dir.iterdir()
            if p.is_dir() and _TAG_RE.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(tags, key=step_of_tag)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _prune(checkpoint_dir: Path, keep_last: int, latest: str) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last``, incomplete ones older than
    latest, and what crashed saves left behind (staging and moved-aside directories)."""
    keep = set(complete_tags(checkpoint_dir)[-keep_last:]) | {latest}
    latest_step = step_of_tag(latest)
    for path in list(Path(checkpoint_dir).iterdir()):
        if not path.is_dir() or path.name in keep:
            continue
        base = path.with_name(path.name.rsplit(".", 1)[0])
        if path.name.endswith(REPLACED) and not base.exists() and (path / COMPLETE).is_file():
            os.replace(path, base)  # a save crashed mid-swap: this is still that step's checkpoint
        elif path.name.endswith((PARTIAL, REPLACED)) and _TAG_RE.match(base.name):
            shutil.rmtree(path, ignore_errors=True)
        elif _TAG_RE.match(path.name) and ((path / COMPLETE).is_file() or step_of_tag(path.name) < latest_step):
            shutil.rmtree(path, ignore_errors=True)


def _publish(checkpoint_dir: Path, tag: str) -> None:
    """Rename the finished staging directory to ``tag``; a complete tag of the same name is moved
    aside first (both renames are atomic) and deleted only after ``latest`` has moved (_prune)."""
    final, staged = checkpoint_dir / tag, checkpoint_dir / (tag + PARTIAL)
    if final.exists():
        aside = checkpoint_dir / (tag + REPLACED)
        shutil.rmtree(aside, ignore_errors=True)
        if (final / COMPLETE).is_file():
            os.replace(final, aside)
        else:  # an incomplete directory of that name (written by an older version): nothing to keep
            shutil.rmtree(final)
    os.replace(staged, final)


def save_checkpoint(engine, checkpoint_dir: Path, step: int, client_state: dict, keep_last: int,
                    extra_files: Optional[dict[str, str]] = None) -> str:
    """Collective: every rank must call it. Returns the tag written."""
    checkpoint_dir = Path(checkpoint_dir)
    tag = tag_for_step(step)
    staged = tag + PARTIAL
    rank = dist.get_rank()
    if rank == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(checkpoint_dir / staged, ignore_errors=True)  # a crash left a half-written save
    dist.barrier()
    engine.save_checkpoint(str(checkpoint_dir), tag=staged, client_state=client_state, save_latest=False)
    rng_dir = checkpoint_dir / staged / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        for name, text in (extra_files or {}).items():
            atomic_write_text(checkpoint_dir / staged / name, text)
        atomic_write_text(checkpoint_dir / staged / COMPLETE, f"{step}\n")
        _publish(checkpoint_dir, tag)
        atomic_write_text(checkpoint_dir / LATEST, tag)
        _prune(checkpoint_dir, keep_last, tag)
    dist.barrier()
    return tag


def load_checkpoint(engine, checkpoint_dir: Path, tag: Optional[str] = None) -> Optional[dict]:
    """Load ``tag`` (default: latest) into the engine; returns the client state, or None if none exists."""
    checkpoint_dir = Path(checkpoint_dir)
    tag = tag or latest_tag(checkpoint_dir)
    if tag is None:
        return None
    try:
        path, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{checkpoint_dir / tag}: unreadable on rank {dist.get_rank()} "
                              f"({_first_line(exc)})") from exc
    if path is None:
        raise CheckpointError(f"{checkpoint_dir / tag}: DeepSpeed could not load this checkpoint")
    rng_file = checkpoint_dir / tag / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        try:
            _set_rng_state(torch.load(rng_file, weights_only=False))
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"{rng_file}: unreadable ({_first_line(exc)})") from exc
    else:
        log.warning("%s: no RNG state for this rank (world size changed?); continuing with fresh RNG", rng_file)
    return client_state


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def read_meta(checkpoint_dir: Path, tag: str) -> dict:
    """meta.json of a tag (step, layout, data state), which every save writes: resuming without
    it would have to guess the data-parallel size the optimizer state was sharded for."""
    path = Path(checkpoint_dir) / tag / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every save writes it; checkpoint from another tool?)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({_first_line(exc)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _universal_input_view(tag_dir: Path, view: Path) -> None:
    """DeepSpeed's ds_to_universal fails on the ``None`` entries megatron puts in a module state
    dict (``*._extra_state``). Give it a view of the tag: links to every file, except model-state
    files rewritten without those entries. The checkpoint itself is never modified."""
    view.mkdir(parents=True)
    for item in tag_dir.iterdir():
        if item.name.endswith("model_states.pt"):
            state = torch.load(item, map_location="cpu", weights_only=False)
            if isinstance(state.get("module"), dict):
                state["module"] = {k: v for k, v in state["module"].items() if v is not None}
            torch.save(state, view / item.name)
        else:
            (view / item.name).symlink_to(item.resolve())


def ensure_universal(checkpoint_dir: Path, tag: str) -> str:
    """Collective. A DeepSpeed *universal* copy of ``tag`` (optimizer state independent of the
    data-parallel size), made once by rank 0 next to it as ``<tag>-universal``; returns its tag."""
    import subprocess
    import sys

    checkpoint_dir = Path(checkpoint_dir)
    universal = f"{tag}-universal"
    if dist.get_rank() == 0 and not (checkpoint_dir / universal / COMPLETE).is_file():
        work = checkpoint_dir / f".{universal}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        _universal_input_view(checkpoint_dir / tag, work / tag)
        result = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(work / tag),
             "--output_folder", str(work / universal), "--inject_missing_state", "--num_extract_workers", "1",
             "--num_merge_workers", "1"], capture_output=True, text=True)
        if result.returncode:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
            raise CheckpointError(f"{checkpoint_dir / tag}: conversion to a universal checkpoint failed: {tail[0]}")
        atomic_write_text(work / universal / COMPLETE, "universal\n")
        shutil.rmtree(checkpoint_dir / universal, ignore_errors=True)
        (work / universal).rename(checkpoint_dir / universal)
        shutil.rmtree(work, ignore_errors=True)
        log.info("converted %s to a universal checkpoint for a new data-parallel size", checkpoint_dir / tag)
    dist.barrier()
    return universal
