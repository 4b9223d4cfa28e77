"""What the run's build says about the data it reads.

A validation split too small for the data-parallel size stops the run when it is built, not at the
first validation: eval_interval steps of training later, and (when save_interval is a multiple of
eval_interval) before any checkpoint was written, so a restarted job would fail at the same step
every time. A split smaller than train.eval_iters, an eval_iters that the data-parallel size does not
divide, and more loader processes than CPUs, are said."""

from __future__ import annotations

import pytest

from ascender_dist.config.resolve import config_from_dict
from data_pipeline.errors import DataError
from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)


def test_a_validation_split_smaller_than_one_micro_batch_stops_the_build(single_rank_group, tmp_path):
    from ascender_dist.training.run import build_run
    from data_pipeline.loader import StreamingLoader

    data = make_tiny_dataset(tmp_path / "data", corpus_bytes=60_000)
    val = StreamingLoader(data["manifest"], seq_length=32, micro_batch_size=1, global_batch_size=1,
                          dp_rank=0, dp_size=1, seed=1, split="val")
    micro = len(val) + 1  # one sample more than the split holds
    cfg = config_from_dict(tiny_run_config(data, tmp_path / "run", train={
        "micro_batch_size": micro, "global_batch_size": micro, "eval_interval": 2, "train_steps": 4}))
    with pytest.raises(DataError, match=r"the validation split has fewer samples than one micro-batch per "
                                        r"data-parallel rank") as info:
        build_run(cfg)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_eval_iters_above_the_split_is_logged_once_at_build(single_rank_group, tmp_path, caplog):
    """An eval_iters the validation split cannot fill is used clipped to the split (every batch):
    said at build, not silently."""
    import logging

    from ascender_dist.training.run import build_run
    from data_pipeline.loader import StreamingLoader

    data = make_tiny_dataset(tmp_path / "data", corpus_bytes=60_000)
    batches = len(StreamingLoader(data["manifest"], seq_length=32, micro_batch_size=1, global_batch_size=1,
                                  dp_rank=0, dp_size=1, seed=1, split="val"))
    raw = tiny_run_config(data, tmp_path / "run", train={"micro_batch_size": 1, "global_batch_size": 1,
                                                          "eval_interval": 2, "train_steps": 4, "eval_iters": batches + 5})
    with caplog.at_level(logging.WARNING, logger="ascender_dist"):
        build_run(config_from_dict(raw))
    said = [r.getMessage() for r in caplog.records if "train.eval_iters" in r.getMessage()]
    assert said == [f"train.eval_iters: {batches + 5} validation micro-batches asked, the validation split gives "
                    f"{batches} ({batches} per data-parallel rank); each validation uses those {batches}"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ascender_dist"):
        build_run(config_from_dict({**raw, "train": {**raw["train"], "eval_iters": batches}}))
    assert not [r for r in caplog.records if "train.eval_iters" in r.getMessage()]


def test_validation_batches_per_rank_are_eval_iters_over_dp_rounded_up_and_clipped():
    """The count per rank: ceil(eval_iters / dp), clipped to what a rank has. (That the loader's
    dealing makes these the split's first micro-batches: test_data_loader_own_rows; the loss against
    one process's: tests/distributed/test_layouts.)"""
    from ascender_dist.training.run import validation_batches_per_rank

    assert [validation_batches_per_rank(8, dp, 100) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert validation_batches_per_rank(5, 2, 100) == 3 and validation_batches_per_rank(4, 8, 100) == 1
    assert validation_batches_per_rank(8, 2, 3) == 3 and validation_batches_per_rank(1 << 62, 4, 7) == 7


@pytest.mark.parametrize("asked,dp,batches,said", [
    (8, 2, 10, None), (8, 1, 10, None),
    (5, 2, 10, "train.eval_iters: 5 validation micro-batches do not divide over 2 data-parallel ranks; each "
               "validation uses 6 (3 per rank)"),
    (30, 2, 10, "train.eval_iters: 30 validation micro-batches asked, the validation split gives 20 (10 per "
                "data-parallel rank); each validation uses those 20")])
def test_a_rounded_or_clipped_validation_size_is_said(caplog, asked, dp, batches, said):
    import logging

    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.training.run import log_validation_size

    cfg = config_from_dict({"train": {"eval_iters": asked}})
    with caplog.at_level(logging.WARNING, logger="ascender_dist"):
        log_validation_size(cfg, batches, dp, logging_rank=True)
        log_validation_size(cfg, batches, dp, logging_rank=False)
    assert [r.getMessage() for r in caplog.records] == ([said] if said else [])


def test_loader_workers_above_the_nodes_usable_cpus_are_logged(caplog):
    import logging

    from ascender_dist.training.run import log_loader_workers_above_cpus

    def cfg(workers):
        return config_from_dict({"model": {"preset": "debug"}, "data": {"num_workers": workers}})

    with caplog.at_level(logging.WARNING, logger="ascender_dist"):
        log_loader_workers_above_cpus(cfg(200), 8, 1, logging_rank=True)
        log_loader_workers_above_cpus(cfg(200), 8, 1, logging_rank=False)  # said once per job, by the logging rank
        log_loader_workers_above_cpus(cfg(4), 8, 2, logging_rank=True)  # 8 processes on 8 CPUs
        log_loader_workers_above_cpus(cfg(3), 8, 4, logging_rank=True)  # 12 on 8: the node's ranks count
    assert [r.getMessage() for r in caplog.records] == [
        "data.num_workers: 200 loader processes per rank x 1 ranks on this node, over its 8 usable CPUs; they "
        "will contend for them",
        "data.num_workers: 3 loader processes per rank x 4 ranks on this node, over its 8 usable CPUs; they "
        "will contend for them"]


def test_usable_cpus_follow_the_affinity_mask():
    """Under a cpuset (Slurm, a container, taskset) the process may use fewer CPUs than the node has."""
    import os

    from ascender_dist.parallel.setup import usable_cpus

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert usable_cpus() == len(allowed)
