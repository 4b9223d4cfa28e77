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
    """Weights 1 : 3000 give dataset a exactly its ``mixture_counts`` slots in one period (1 of 2999):
    not one in two (a share below the old 1/1000 resolution was raised to one slot per period), and
    not none."""
    counts = mixture_counts([1.0, 3000.0], ["a", "b"])
    period = int(counts.sum())
    ids, _ = run_global(functools.partial(mix, two, wa=1.0, wb=3000.0), 1, 1,  # one batch of one period
                        micro_batch_size=period, global_batch_size=period)
    assert len(ids) == period
    assert sum(i < 1000 for i in ids) == int(counts[0]) == 1


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


def test_datasets_resolving_to_one_shard_url_are_refused(tmp_path):
    """Shards written with the same prefix behind one url_template would read each other's shards."""
    make_dataset(tmp_path / "a", [8, 8])
    make_dataset(tmp_path / "b", [8, 8], first_id=1000)
    shared = str(tmp_path / "a") + "/{name}"
    with pytest.raises(DataError, match="also a shard of"):
        mix((tmp_path / "a", tmp_path / "b"), url_template=shared, dp_size=2)
    own = [str(tmp_path / "a") + "/{name}", str(tmp_path / "b") + "/{name}"]  # one template each
    ids, _ = run_global(functools.partial(mix, (tmp_path / "a", tmp_path / "b"), url_template=own), 2, 2)
    assert any(i >= 1000 for i in ids) and any(i < 1000 for i in ids)


def test_a_dataset_listed_twice_is_refused(two):
    with pytest.raises(DataError, match="list it once"):
        mix((two[0], two[0]))


def test_datasets_made_with_different_tokenizers_are_refused(tmp_path):
    """Without a run tokenizer each dataset is checked only against itself: the mixture compares them."""
    make_dataset(tmp_path / "a", [8], tokenizer_sha256="a" * 64)
    make_dataset(tmp_path / "b", [8], tokenizer_sha256="b" * 64, first_id=1000)
    with pytest.raises(DataError, match="tokenizer mismatch inside the mixture"):
        mix((tmp_path / "a", tmp_path / "b"))


def test_run_config_gives_each_mixture_dataset_its_template(tmp_path):
    """``data.mixture[i].url_template`` overrides ``data.url_template`` for that dataset only."""
    import torch

    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.parallel.setup import ParallelState
    from ascender_dist.training.run import build_loader
    from tests.helpers.data import tiny_run_config

    for name, first in (("a", 0), ("b", 1000), ("b_copy", 1000)):
        make_dataset(tmp_path / name, [8, 8], first_id=first)
    mixture = [{"manifest": str(tmp_path / "a" / "manifest.json"), "weight": 1.0},
               {"manifest": str(tmp_path / "b" / "manifest.json"), "weight": 1.0,
                "url_template": "pipe:cat " + str(tmp_path / "b_copy") + "/{name}"}]
    raw = tiny_run_config({"manifest": "", "tokenizer": ""}, tmp_path / "run",
                          model={"seq_length": SEQ, "vocab_size": 512},
                          train={"micro_batch_size": 2, "global_batch_size": 8})
    raw["data"].update(mixture=mixture, url_template="pipe:cat " + str(tmp_path / "a") + "/{name}")
    pstate = ParallelState(rank=0, world_size=1, local_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                           dp_rank=0, dp_size=1, device=torch.device("cpu"))
    ld = build_loader(config_from_dict(raw), None, pstate)
    assert [d.specs[0].url for d in ld.datasets] == [f"pipe:cat {tmp_path / 'a'}/syn-train-000000.tar",
                                                     f"pipe:cat {tmp_path / 'b_copy'}/syn-train-000000.tar"]
