"""MixtureLoader: deterministic interleaving by weight, same invariances as a single dataset."""

from __future__ import annotations

import functools

import pytest

from data_pipeline.errors import DataError
from data_pipeline.loader import MixtureLoader, mixture_counts

from .data_fixtures import SEQ, make_dataset, run_global, sample_ids


@pytest.fixture
def two(tmp_path):
    make_dataset(tmp_path / "a", [10, 7, 12], val_counts=[4])        # train ids 0..28, val 29..32
    make_dataset(tmp_path / "b", [9, 9], val_counts=[3], first_id=1000)  # train 1000..1017, val 1018..1020
    return tmp_path / "a", tmp_path / "b"


def mix(two, wa=3.0, wb=1.0, **kw):
    args = dict(seq_length=SEQ, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1, seed=5,
                shuffle_buffer=8)
    args.update(kw)
    return MixtureLoader([(two[0], wa), (two[1], wb)], **args)


def test_weights_give_exact_proportions(two):
    ids, _ = run_global(functools.partial(mix, two), 1, 40)  # 320 samples
    from_b = sum(i >= 1000 for i in ids)
    assert from_b == 80  # 1:3 exactly, period 4
    assert sum(i >= 1000 for i in ids[:4]) == 1  # interleaved, not blocks


def test_each_dataset_keeps_its_own_epochs(two):
    ids, _ = run_global(functools.partial(mix, two, wa=1.0, wb=1.0), 1, 10)
    a = [i for i in ids if i < 1000]
    b = [i for i in ids if i >= 1000]
    assert sorted(a[:29]) == list(range(29)) and sorted(b[:18]) == list(range(1000, 1018))
    assert sorted(b[18:36]) == list(range(1000, 1018)) and b[18:36] != b[:18]  # b's second epoch


def test_mixture_invariant_to_dp_workers_and_resume(two):
    make = functools.partial(mix, two)
    ref, _ = run_global(make, 1, 24)
    assert run_global(make, 2, 24)[0] == ref
    assert run_global(functools.partial(mix, two, num_workers=2), 4, 24)[0] == ref
    first, state = run_global(make, 2, 9)
    rest, _ = run_global(make, 1, 15, state=state)
    assert first + rest == ref


def test_mixture_val_visits_every_val_sample_once(two):
    ld = mix(two, split="val", micro_batch_size=1)
    ids = [i for b in ld for i in sample_ids(b["tokens"])]
    assert ids == [29, 30, 31, 32, 1018, 1019, 1020]


def test_fractional_weights(two):
    ids, _ = run_global(functools.partial(mix, two, wa=0.7, wb=0.3), 1, 25)  # 200 samples
    assert sum(i >= 1000 for i in ids) == 60


def test_a_small_weight_keeps_its_small_share(two):
    """Weights 1 : 3000 give dataset a about 1 sample in 3000, not one in two (a share below the old
    1/1000 resolution was raised to one slot per period)."""
    ids, _ = run_global(functools.partial(mix, two, wa=1.0, wb=3000.0), 1, 25)  # 200 samples
    assert sum(i < 1000 for i in ids) <= 1


@pytest.mark.parametrize("weights,period", [([3, 1], 4), ([0.7, 0.2, 0.1], 10), ([2, 1], 3), ([1, 3000], 2999),
                                            ([0.45, 0.35, 0.2, 0.0001], 9992), ([0.6, 0.3, 0.1, 0.001], 1000)])
def test_mixture_period_is_short_and_shares_are_within_a_thousandth(weights, period):
    counts = mixture_counts(weights, [f"d{i}" for i in range(len(weights))])
    assert int(counts.sum()) == period  # the old lcm of 1/1000 fractions gave 4,860,443 and 5.5e10 here
    total = sum(weights)
    for n, w in zip(counts, weights):
        assert abs(n / counts.sum() - w / total) <= 1e-3 * w / total


def test_a_weight_too_small_to_resolve_is_refused_by_name():
    with pytest.raises(DataError, match=r"^tiny: mixture weight is 1e-06 of the total, below the 1/200000"):
        mixture_counts([1.0, 1e-6], ["big", "tiny"])
