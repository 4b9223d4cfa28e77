"""Shards one rank cannot use at set-up are dropped on every rank (skip) or stop every rank with the
same line (error), on 2 real ranks through the trainer's build_loader: tensor-parallel peers keep
reading identical batches, and the validation length stays the same everywhere. A manifest one
rank cannot load stops every rank at once with the same line (no peer left in a collective)."""

import json
from pathlib import Path

import pytest

from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data = make_tiny_dataset(tmp_path_factory.mktemp("data"))
    shards = json.loads(Path(data["manifest"]).read_text())["shards"]
    train = [s["name"] for s in shards if s["split"] == "train"]
    val = [s["name"] for s in shards if s["split"] == "val"]
    assert len(train) >= 4 and len(val) >= 2, (train, val)
    args = {"data": data, "root": str(tmp_path_factory.mktemp("run")), "hide_train": [train[2]], "hide_val": [val[0]],
            "unreadable_train": train[1],
            "missing_manifest": str(tmp_path_factory.mktemp("mount") / "missing" / "manifest.json")}
    return args, run_ranks("tests.distributed.workers.data_skips:main", world_size=2, timeout=300, args=args)


def test_skip_mode_skips_a_shard_one_rank_could_not_use_on_every_rank(setup):
    args, results = setup
    rank0, rank1 = assert_check(results, "skip_train")
    assert rank0["skipped"] == rank1["skipped"] == args["hide_train"]  # kept in the order, skipped on both
    assert rank0["shards"] == rank1["shards"] and rank0["skipped_shards"] == rank1["skipped_shards"] == 1
    assert rank0["samples_per_epoch"] == rank1["samples_per_epoch"]
    assert rank0["batches"] == rank1["batches"]  # tensor-parallel peers: identical tokens


def test_skip_mode_keeps_the_validation_length_the_same_on_every_rank(setup):
    args, results = setup
    rank0, rank1 = assert_check(results, "skip_val")
    assert rank0["skipped"] == rank1["skipped"] == args["hide_val"] and rank0["shards"] == rank1["shards"]
    assert rank0["samples_per_epoch"] == rank1["samples_per_epoch"] and rank0["len"] == rank1["len"]
    assert rank0["batches"] == rank1["batches"]


def test_error_mode_stops_every_rank_with_the_same_line(setup):
    args, results = setup
    errors = [r["error_train"] for r in results]
    assert not any(e["ok"] for e in errors), errors  # not one rank raising while the other trains on
    assert errors[0]["error"] == errors[1]["error"]
    assert args["hide_train"][0] in errors[0]["error"] and "(found by rank 1)" in errors[0]["error"]
    assert errors[0]["error"].startswith("DataError: ") and "\n" not in errors[0]["error"]


def test_a_shard_one_rank_cannot_read_mid_run_stops_that_rank_in_skip_mode(setup):
    """TP=2: the peers read the same rows, so rank 1 skipping alone would train on other tokens."""
    args, results = setup
    rank0, rank1 = assert_check(results, "unreadable_mid_run")
    assert rank0 == {"error": None, "skipped_shards": 1}, rank0  # 1: the set-up check's (hide_train), on both
    assert rank1["error"].startswith("DataError: ") and args["unreadable_train"] in rank1["error"], rank1
    assert "cannot read shard (OSError: [Errno 5] Input/output error); not skipped" in rank1["error"], rank1
    assert rank1["skipped_shards"] == 1 and "\n" not in rank1["error"]


def test_a_manifest_one_rank_cannot_load_stops_every_rank_with_the_same_line(setup):
    args, results = setup
    rank0, rank1 = assert_check(results, "missing_manifest")
    assert rank0["error"] == rank1["error"], (rank0, rank1)  # not a raw "Connection closed by peer" on rank 0
    assert rank0["error"] == f"DataError: {args['missing_manifest']}: manifest not found (found by rank 1)"
    assert rank0["seconds"] < 10 and rank1["seconds"] < 10, (rank0, rank1)  # no wait for a collective's timeout
