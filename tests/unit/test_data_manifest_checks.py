"""Boundaries of data_pipeline/shards.py's small checks that a mutation audit found unpinned: how
many shards become validation (never none when asked for some, never all), and a JSON ``true``
where a manifest holds an integer."""

from __future__ import annotations

import functools
import json

import pytest

from data_pipeline.errors import DataError
from data_pipeline.shards import load_manifest, val_shard_indices

from tests.helpers.errors import one_line as one_line_of

from .data_fixtures import make_dataset

one_line_error = functools.partial(one_line_of, kind=DataError)


@pytest.mark.parametrize("num_shards,fraction,expected", [
    (2, 0.75, {1}),  # round(1.5) = 2 would be every shard: one is kept for training
    (2, 0.99, {1}),
    (3, 0.9, 2),  # round(2.7) = 3: capped at 2
])
def test_validation_never_takes_every_shard(num_shards, fraction, expected):
    """A large val_fraction on a small corpus left no training shard: the run then failed at its
    first step with an empty train split, after the whole corpus was tokenized."""
    val = val_shard_indices(num_shards, fraction)
    assert (val if isinstance(expected, set) else len(val)) == expected
    assert val <= set(range(num_shards)) and len(val) < num_shards


@pytest.mark.parametrize("num_shards,fraction", [(5, 0.05), (2, 0.1), (3, 0.1)])
def test_a_small_validation_fraction_still_gets_one_shard(num_shards, fraction):
    """round(5 * 0.05) = 0: asking for validation data and getting none would turn evaluation into
    an error (or silence) at the first eval_interval, long after the corpus was built."""
    assert len(val_shard_indices(num_shards, fraction)) == 1


@pytest.fixture
def ds(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8], val_counts=[4])
    return tmp_path / "ds"


def _edit_manifest(ds, edit):
    path = ds / "manifest.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return path


@pytest.mark.parametrize("edit,needle", [
    (lambda m: {**m, "seq_length": True}, "seq_length: expected an integer, got bool True"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "num_samples": True}] + m["shards"][1:]},
     "shards[0].num_samples: expected an integer, got bool True"),
], ids=["seq_length-true", "num_samples-true"])
def test_a_json_bool_is_not_an_integer_in_a_manifest(ds, edit, needle):
    """Python's bool is an int: a hand-edited ``"seq_length": true`` read as 1 would pass the type
    check and then a sequence-length mismatch (or a 1-sample shard) would surface far from its cause."""
    path = _edit_manifest(ds, edit)
    with pytest.raises(DataError) as e:
        load_manifest(path)
    one_line_error(e, str(path), needle)
