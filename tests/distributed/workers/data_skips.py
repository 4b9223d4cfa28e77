"""2 ranks, TP=2 (one data-parallel replica, so both ranks must read identical batches): shards that
fail the set-up check on rank 1 only, in skip and in error mode, as the trainer builds its loaders;
a shard rank 1 cannot read mid-run; and a manifest that rank 1 cannot load at all (its mount missing)."""

import errno
import time
from unittest import mock

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks

MICRO_BATCHES = 4


def loader_config(args, on_corrupt: str):
    raw = tiny_run_config(args["data"], args["root"], parallel={"tensor_model_parallel_size": 2})
    raw["data"]["on_corrupt"] = on_corrupt
    return config_from_dict(raw)


def _hidden_on(rank: int, names: list[str]):
    """``_precheck`` of the shards ``names`` fails with ESTALE on rank 1 only (a shard briefly
    invisible to one node)."""
    from data_pipeline import loader as loader_mod

    real = loader_mod._Dataset._precheck

    def precheck(spec):
        if rank == 1 and spec.url.rsplit("/", 1)[-1] in names:
            raise loader_mod._unreadable(spec.url, OSError(errno.ESTALE, "Stale file handle"))
        return real(spec)

    return mock.patch.object(loader_mod._Dataset, "_precheck", staticmethod(precheck))


def _build(args, pstate, on_corrupt: str, split: str):
    from ascender_dist.training.run import build_loader, load_tokenizer

    cfg = loader_config(args, on_corrupt)
    with _hidden_on(pstate.rank, args["hide_" + split]):
        return build_loader(cfg, load_tokenizer(cfg), pstate, split=split)


def _view(ld) -> dict:
    """What must be the same on both ranks: the shards, the counts, the first batches."""
    it = iter(ld)
    return {"shards": [s.url.rsplit("/", 1)[-1] for d in ld.datasets for s in d.specs],
            "skipped": sorted(d.specs[i].url.rsplit("/", 1)[-1] for d in ld.datasets for i in d.bad),
            "samples_per_epoch": ld.samples_per_epoch, "skipped_shards": ld.skipped_shards,
            "batches": [next(it)["tokens"].tolist() for _ in range(MICRO_BATCHES)]}


def _unreadable_mid_run_on_rank_1(args, pstate) -> dict:
    """Skip mode, one shard failing with EIO on every read of rank 1 only, after the set-up checks
    passed on both: what each rank met within two epochs (rank 1 must stop, not skip the shard
    its tensor-parallel peer goes on reading)."""
    from data_pipeline import loader as loader_mod

    real = loader_mod._fetch_bytes

    def fetch(url):
        if pstate.rank == 1 and url.rsplit("/", 1)[-1] == args["unreadable_train"]:
            raise OSError(errno.EIO, "Input/output error")
        return real(url)

    ld = _build(args, pstate, "skip", "train")
    it, micro_batches = iter(ld), 2 * ld.samples_per_epoch // ld.micro_batch_size
    with mock.patch.object(loader_mod, "_fetch_bytes", fetch), mock.patch.object(loader_mod, "_wait", lambda s: None):
        try:
            for _ in range(micro_batches):
                next(it)
        except Exception as exc:  # compared across ranks by the test
            return {"error": f"{type(exc).__name__}: {exc}", "skipped_shards": ld.skipped_shards}
    return {"error": None, "skipped_shards": ld.skipped_shards}


def _missing_manifest_on_rank_1(args, pstate) -> dict:
    """Build the loader with rank 1's manifest on a missing mount: what each rank raised, and when.
    Last of the checks: a rank that raised alone would leave its peer in the set-up all_gather."""
    from ascender_dist.training.run import build_loader, load_tokenizer

    cfg = loader_config(args, "error")
    tokenizer = load_tokenizer(cfg)
    if pstate.rank == 1:
        cfg.data.manifest = str(args["missing_manifest"])
    start = time.monotonic()
    try:
        build_loader(cfg, tokenizer, pstate)
        return {"error": None, "seconds": time.monotonic() - start}
    except Exception as exc:  # compared across ranks by the test
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}


def main(args):
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group

    init_process_group()
    pstate = init_model_parallel(2, 1, seed=1)
    return run_checks({
        "skip_train": lambda: _view(_build(args, pstate, "skip", "train")),
        "skip_val": lambda: {**_view(_build(args, pstate, "skip", "val")),
                             "len": len(_build(args, pstate, "skip", "val"))},
        "error_train": lambda: type(_build(args, pstate, "error", "train")).__name__,  # a raise, on every rank
        "unreadable_mid_run": lambda: _unreadable_mid_run_on_rank_1(args, pstate),
        "missing_manifest": lambda: _missing_manifest_on_rank_1(args, pstate),  # keep last (see its docstring)
    })
