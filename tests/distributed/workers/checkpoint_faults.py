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


def _trainer(data, out: Path, **sections):
    from ascender_dist.training.trainer import Trainer

    return Trainer(config_from_dict(tiny_run_config(data, out, train={"train_steps": 4}, **sections)))


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


def main(args):
    data, root = args["data"], Path(args["root"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_checks({"damaged_file_of_rank1": lambda: damaged_file_of_rank1(data, root),
                       "write_fails_on_rank1": lambda: write_fails_on_rank1(data, root)})
