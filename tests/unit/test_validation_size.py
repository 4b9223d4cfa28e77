"""A validation split too small for the data-parallel size stops the run when it is built, not at the
first validation: eval_interval steps of training later, and (when save_interval is a multiple of
eval_interval) before any checkpoint was written, so a restarted job would fail at the same step
every time."""

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
