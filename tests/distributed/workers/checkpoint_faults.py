"""Checkpoint faults on 2 real ranks (DP=2, ZeRO-1): a damaged file of one rank stops every rank
before anything is loaded; a write that fails on one rank fails the save on every rank."""

import os
import resource
import signal
import time
from pathlib import Path

import torch.distributed as dist

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks


def _trainer(dataset, out: Path, **sections):
    from ascender_dist.training.trainer import Trainer

    from ascender_dist.config.loader import deep_merge

    raw = deep_merge(tiny_run_config(dataset, out, train={"train_steps": 4}), sections)  # (sections may hold data=)
    return Trainer(config_from_dict(raw))


def _error_of(fn) -> dict:
    from ascender_dist.training.checkpoint import CheckpointError

    started = time.monotonic()
    try:
        fn()
    except CheckpointError as exc:
        return {"message": str(exc), "rank": exc.rank, "seconds": time.monotonic() - started}
    return {"message": None}


def damaged_file_of_rank1(data, root: Path) -> dict:
    out = root / "damaged"
    _trainer(data, out).fit(stop_at=2)
    shard = out / "checkpoints" / "step_00000002" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if dist.get_rank() == 0:
        shard.write_bytes(shard.read_bytes()[:1000])  # truncated
    dist.barrier()
    return {"file": str(shard), **_error_of(lambda: _trainer(data, out))}


def write_fails_on_rank1(data, root: Path) -> dict:
    """RLIMIT_FSIZE on rank 1 makes its writer fail part-way (EFBIG), like a full disk."""
    out = root / "full"
    trainer = _trainer(data, out)
    trainer.fit(stop_at=1)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))
    try:
        error = _error_of(lambda: trainer.fit(stop_at=2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    dist.barrier()
    checkpoints = out / "checkpoints"
    return {**error, "dir": str(checkpoints), "entries": sorted(p.name for p in checkpoints.iterdir()),
            "latest": (checkpoints / "latest").read_text()}


def _config_error_of(fn) -> dict:
    from ascender_dist.config.errors import ConfigError

    try:
        fn()
    except ConfigError as exc:
        return {"message": str(exc)}
    return {"message": None}


def resume_checks(data, root: Path) -> dict:
    """Resume with another model field, then on a manifest of other content (refused, then allowed)."""
    import json
    import shutil

    out = root / "checked"
    _trainer(data, out).fit(stop_at=2)
    changed_model = _config_error_of(lambda: _trainer(data, out, model={"hidden_size": 64}))
    moved = root / "moved_shards"
    if dist.get_rank() == 0:  # the same shards elsewhere, and a manifest of other bytes (re-indented)
        shutil.copytree(Path(data["manifest"]).parent, moved)
        manifest = json.loads((moved / "manifest.json").read_text())
        (moved / "manifest.json").write_text(json.dumps(manifest, indent=3))
        shutil.copytree(Path(data["manifest"]).parent, root / "same_shards")
    dist.barrier()
    same = {**data, "manifest": str(root / "same_shards" / "manifest.json")}
    same_start = _trainer(same, out).step  # moved, same content: resumes
    other = {**data, "manifest": str(moved / "manifest.json")}
    refused = _config_error_of(lambda: _trainer(other, out))
    allowed = _trainer(other, out, data={"allow_change_on_resume": True})
    start = allowed.step
    allowed.fit(stop_at=3)
    meta = json.loads((out / "checkpoints" / "step_00000003" / "meta.json").read_text())
    return {"changed_model": changed_model["message"], "same_start": same_start, "refused": refused["message"],
            "allowed_start": start, "data_changes": meta["data_changes"], "fingerprint": meta["data_fingerprint"],
            "manifest": other["manifest"]}


def tokenizer_unreadable_on_rank1(data, root: Path) -> dict:
    """Rank 1 cannot read the tokenizer (a node without the mount): every rank stops with its line
    instead of rank 0 waiting in the next collective until the group's timeout."""
    from unittest import mock

    from data_pipeline.errors import DataError
    from data_pipeline.tokenizer import Tokenizer

    missing = DataError(data["tokenizer"], "tokenizer not found (this node's view)")
    patch = mock.patch.object(Tokenizer, "load", side_effect=missing) if dist.get_rank() == 1 else mock.MagicMock()
    started = time.monotonic()
    try:
        with patch:
            _trainer(data, root / "no_tokenizer")
    except Exception as exc:  # the failing rank's own DataError, the peer's UserError naming rank 1
        return {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None),
                "seconds": time.monotonic() - started}
    return {"message": None}


def main(args):
    data, root = args["data"], Path(args["root"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_checks({"damaged_file_of_rank1": lambda: damaged_file_of_rank1(data, root),
                       "write_fails_on_rank1": lambda: write_fails_on_rank1(data, root),
                       "resume_checks": lambda: resume_checks(data, root),
                       "tokenizer_unreadable_on_rank1": lambda: tokenizer_unreadable_on_rank1(data, root)})
