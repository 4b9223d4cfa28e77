"""StreamingLoader: order is a pure function of (seed, index); dp/workers/resume never change it."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from data_pipeline import loader as loader_mod
from data_pipeline.errors import DataError

from tests.helpers.errors import one_line

from .data_fixtures import loader, make_dataset, run_global, sample_ids

UNEVEN = [13, 5, 9, 1, 17, 7, 11]  # 63 samples: epochs end mid-batch (G = 8)


@pytest.fixture
def uneven(tmp_path):
    make_dataset(tmp_path / "ds", UNEVEN, val_counts=[6, 5])
    return tmp_path / "ds"


def test_order_is_same_for_dp_1_2_4_and_workers(uneven):
    make = functools.partial(loader, uneven)
    ref, _ = run_global(make, 1, 20)
    assert run_global(make, 2, 20)[0] == ref
    assert run_global(make, 4, 20)[0] == ref
    with_workers = functools.partial(loader, uneven, num_workers=2)
    assert run_global(with_workers, 2, 20)[0] == ref


def test_order_depends_on_seed_and_epochs_differ(uneven):
    a, _ = run_global(functools.partial(loader, uneven, seed=1), 1, 16)
    b, _ = run_global(functools.partial(loader, uneven, seed=2), 1, 16)
    assert a != b
    n = sum(UNEVEN)
    assert a[:n] != a[n:2 * n]  # a new permutation each epoch


def test_each_epoch_is_a_permutation_despite_uneven_shards(uneven):
    n = sum(UNEVEN)
    ids, _ = run_global(functools.partial(loader, uneven), 2, 3 * n // 8 + 1)
    for e in range(3):
        assert sorted(ids[e * n:(e + 1) * n]) == list(range(n))


def test_shuffle_mixes_across_shards_and_within_blocks(uneven):
    ids, _ = run_global(functools.partial(loader, uneven, shuffle_buffer=64), 1, 8)
    assert ids[:sum(UNEVEN)] != sorted(ids[:sum(UNEVEN)])
    assert set(ids[:UNEVEN[0]]) != set(range(UNEVEN[0]))  # epoch does not start with shard 0 intact


def test_resume_at_dp2_matches_straight_run(uneven):
    make = functools.partial(loader, uneven)
    straight, _ = run_global(make, 2, 30)
    first, state = run_global(make, 2, 11)
    rest, _ = run_global(make, 2, 19, state=state)
    assert first + rest == straight
    assert set(state) >= {"epoch", "consumed_samples", "seed"}
    assert all(isinstance(v, int) for v in state.values())


def test_resume_after_changing_dp_2_to_1(uneven):
    make = functools.partial(loader, uneven)
    straight, _ = run_global(make, 2, 30)
    first, state = run_global(make, 2, 11)
    rest, _ = run_global(make, 1, 19, state=state)
    assert first + rest == straight


def test_resume_mid_global_batch(uneven):
    """A state taken between micro-batches (same geometry) also resumes exactly."""
    ld = loader(uneven, dp_size=1)
    it = iter(ld)
    got = [sample_ids(next(it)["tokens"]) for _ in range(7)]  # 7 micro-batches of 4 per batch
    state = ld.state_dict()
    ld2 = loader(uneven, dp_size=1)
    ld2.load_state_dict(state)
    it2 = iter(ld2)
    cont = [sample_ids(next(it2)["tokens"]) for _ in range(5)]
    ref = loader(uneven, dp_size=1)
    itr = iter(ref)
    assert got + cont == [sample_ids(next(itr)["tokens"]) for _ in range(12)]


def test_mid_batch_state_with_other_dp_is_refused(uneven):
    ld = loader(uneven, dp_size=1)
    next(iter(ld))
    with pytest.raises(DataError, match="middle of a global batch"):
        loader(uneven, dp_size=2).load_state_dict(ld.state_dict())


def test_resume_reads_no_consumed_shard(tmp_path, monkeypatch):
    counts = [16] * 10
    make_dataset(tmp_path / "ds", counts)
    opened = []
    real, real_local = loader_mod._fetch_bytes, loader_mod._open_local
    monkeypatch.setattr(loader_mod, "_fetch_bytes", lambda url: opened.append(url) or real(url))
    monkeypatch.setattr(loader_mod, "_open_local", lambda path: opened.append(str(path)) or real_local(path))
    make = functools.partial(loader, tmp_path / "ds", shuffle_buffer=16)
    straight, _ = run_global(make, 1, 20)  # 160 samples = 1 epoch
    late_state = {"seed": 3, "consumed_samples": 144, "global_batch_size": 8, "version": 1}
    for partial in (True, False):  # dp 2 reads its own samples by positioned reads, or whole shards
        opened.clear()
        rest, _ = run_global(functools.partial(make, partial_reads=partial), 2, 2, state=late_state)
        assert rest == straight[144:160]
        assert 1 <= len(set(opened)) <= 2  # only the shard(s) of the current shuffle block


def test_resume_cost_does_not_grow_with_position(tmp_path, monkeypatch):
    make_dataset(tmp_path / "ds", [16] * 10)
    opened = []
    real, real_local = loader_mod._fetch_bytes, loader_mod._open_local
    monkeypatch.setattr(loader_mod, "_fetch_bytes", lambda url: opened.append(url) or real(url))
    monkeypatch.setattr(loader_mod, "_open_local", lambda path: opened.append(str(path)) or real_local(path))
    sizes = []
    for consumed in (16, 80, 144):
        opened.clear()
        ld = loader(tmp_path / "ds")
        ld.load_state_dict({"seed": 3, "consumed_samples": consumed})
        next(iter(ld))
        sizes.append(len(opened))
    assert 1 <= sizes[0] == sizes[1] == sizes[2] <= 2  # a read happened, and only the current block's


def test_val_split_is_finite_ordered_and_unshuffled(uneven):
    ld = loader(uneven, split="val", dp_size=1, micro_batch_size=2)
    ids = [i for b in ld for i in sample_ids(b["tokens"])]
    assert ids == list(range(63, 63 + 10))  # 11 val samples, tail of 1 dropped
    assert len(ld) == 5
    ranks = [[i for b in loader(uneven, split="val", dp_rank=r, dp_size=2) for i in sample_ids(b["tokens"])]
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 4
    assert sorted(ranks[0] + ranks[1]) == list(range(63, 71))


def test_brace_pattern_and_pipe_urls_without_manifest(uneven):
    pattern = str(uneven / "syn-train-{000000..000006}.tar")
    via_manifest, _ = run_global(functools.partial(loader, uneven), 1, 10)
    via_brace, _ = run_global(functools.partial(loader, pattern), 1, 10)
    via_pipe, _ = run_global(functools.partial(loader, "pipe:cat " + pattern), 1, 10)
    assert via_brace == via_manifest == via_pipe


def test_batch_geometry_is_checked(uneven):
    with pytest.raises(DataError, match="not divisible"):
        loader(uneven, global_batch_size=10, micro_batch_size=4, dp_size=1)
    with pytest.raises(DataError, match="dp_rank"):
        loader(uneven, dp_rank=2, dp_size=2)


def test_the_global_batch_must_split_over_every_data_parallel_rank(uneven):
    """6 samples over 4 ranks of micro-batch 1: divisible by the micro-batch alone, but the ranks
    would disagree on the number of micro-batches per step (a hang in the gradient all-reduce)."""
    with pytest.raises(DataError, match=r"global_batch_size 6 is not divisible by micro_batch_size \* dp_size "
                                        r"= 1 \* 4"):
        loader(uneven, global_batch_size=6, micro_batch_size=1, dp_size=4)
    loader(uneven, global_batch_size=8, micro_batch_size=1, dp_size=4)  # 2 micro-batches per rank: fine


def test_batches_are_long_tensors_of_seq_plus_one(uneven):
    b = next(iter(loader(uneven, with_index=True)))
    assert b["tokens"].dtype.is_floating_point is False and str(b["tokens"].dtype) == "torch.int64"
    assert tuple(b["tokens"].shape) == (2, 9)
    assert b["index"].tolist() == [0, 1]


def test_every_sample_used_once_per_epoch_at_dp4(uneven):
    ids, _ = run_global(functools.partial(loader, uneven), 4, 63 // 8 * 2, micro_batch_size=1)
    c = Counter(ids[:63])
    assert set(c.values()) == {1}


def test_url_template_for_object_store_style_urls(uneven):
    ref, _ = run_global(functools.partial(loader, uneven), 1, 6)
    tmpl = "pipe:cat " + str(uneven) + "/{name}"
    assert run_global(functools.partial(loader, uneven, url_template=tmpl), 1, 6)[0] == ref


def test_buffer_larger_than_dataset_and_negative_seed(uneven):
    ids, _ = run_global(functools.partial(loader, uneven, shuffle_buffer=10_000, seed=-5), 2, 8)
    assert sorted(ids[:63]) == list(range(63)) and ids[:63] != list(range(63))


def test_checkpoint_seed_wins_on_resume(uneven):
    straight, _ = run_global(functools.partial(loader, uneven, seed=11), 1, 10)
    first, state = run_global(functools.partial(loader, uneven, seed=11), 1, 4)
    rest, _ = run_global(functools.partial(loader, uneven, seed=99), 1, 6, state=state)
    assert first + rest == straight


def test_checkpoint_shuffle_buffer_wins_on_resume(uneven):
    """The order depends on the shuffle block size: a resume with another data.shuffle_buffer
    continues the saved order (no sample repeated or skipped in the epoch)."""
    straight, _ = run_global(functools.partial(loader, uneven, shuffle_buffer=8), 1, 10)
    first, state = run_global(functools.partial(loader, uneven, shuffle_buffer=8), 1, 4)
    assert state["shuffle_buffer"] == 8
    rest, _ = run_global(functools.partial(loader, uneven, shuffle_buffer=32), 1, 6, state=state)
    assert first + rest == straight


def test_mid_batch_state_is_refused_at_another_geometry_with_a_fitting_remainder(uneven):
    """dp 2 x 2 micro-batches of 1 leave 4 samples consumed, a multiple of dp 1 x micro 4, but the
    consumed ones are the heads of two rank slices, not a prefix: no other geometry continues them."""
    ld = loader(uneven, dp_size=2, micro_batch_size=1)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    assert (state["dp_size"], state["micro_batch_size"]) == (2, 1)
    with pytest.raises(DataError, match=r"middle of a global batch.*\[8, 1, 2\].*8, 4, 1"):
        loader(uneven, dp_size=1, micro_batch_size=4).load_state_dict(state)


def test_resume_at_another_global_batch_size_reads_only_this_ranks_rows(tmp_path):
    """A state at sample 40 resumed with global batch 16 starts batches off a multiple of 16: each
    rank's read mask follows, so it decodes as few rows as from an aligned position, and yields the
    same batches as one rank would."""
    make_dataset(tmp_path / "ds", [64] * 16)
    make = functools.partial(loader, tmp_path / "ds", shuffle_buffer=128)
    state = {"seed": 3, "consumed_samples": 40, "batch_start": 40, "global_batch_size": 8, "version": 1}
    aligned = {**state, "consumed_samples": 48, "batch_start": 48}
    reads = {}
    for name, st in (("aligned", aligned), ("shifted", state)):
        ids, _ = run_global(make, 4, 10, state=st, global_batch_size=16)
        single, _ = run_global(make, 1, 10, state=st, global_batch_size=16)
        assert ids == single
        lds = [make(dp_rank=r, dp_size=4, micro_batch_size=2, global_batch_size=16) for r in range(4)]
        for ld in lds:
            ld.load_state_dict(st)
            it = iter(ld)
            for _ in range(20):
                next(it)
        reads[name] = [ld.rows_read for ld in lds]
    assert reads["shifted"] == reads["aligned"]


def test_a_path_to_one_shard_is_a_source(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8])
    assert loader(tmp_path / "ds" / "syn-train-000000.tar").samples_per_epoch == 8


def test_loader_workers_leave_a_jobs_signals_to_the_trainer(tmp_path):
    """Slurm's time-limit warning and a preemption's SIGTERM reach every process of a job: a worker
    spawned while the trainer handles them got the default action and died (BrokenProcessPool in the
    step that should have saved). The workers ignore them; the loader reads on."""
    import os
    import signal
    import time

    from .data_fixtures import loader, make_dataset

    make_dataset(tmp_path / "ds", [8, 8, 8, 8])
    ld = loader(tmp_path / "ds", num_workers=1)
    batches = iter(ld)
    first = [next(batches)["tokens"].clone() for _ in range(2)]
    workers = list(ld._pool._processes.values())  # the spawned worker (read-only look)
    assert workers
    for worker in workers:
        os.kill(worker.pid, signal.SIGUSR1)
        os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in workers)
    more = [next(batches)["tokens"] for _ in range(12)]  # past the first epoch's shards: new reads
    assert len(more) == 12 and first[0].shape == more[0].shape


# --------------------------------------------------------------------------- URL sources and splits
@pytest.mark.parametrize("split, source, culprit", [
    ("val", "syn-train-{000000..000006}.tar", "syn-train-000000.tar"),   # evaluate on a train pattern
    ("train", "syn-val-{000000..000001}.tar", "syn-val-000000.tar"),
    ("val", "pipe:cat {dir}/syn-train-000003.tar", "syn-train-000003.tar"),
])
def test_url_sources_of_the_other_split_are_refused(uneven, split, source, culprit):
    """Plain URLs carry no split: a val loader given train shards (or a train loader given val
    shards), recognised by the writer's ``-{split}-NNNNNN.tar`` names, is one line naming the shard,
    not a "validation loss" over training data."""
    src = source.format(dir=uneven) if "{dir}" in source else str(uneven / source)
    with pytest.raises(DataError) as e:
        loader(src, split=split)
    other = "val" if split == "train" else "train"
    one_line(e, culprit, "plain URLs carry no split", f"{other}-split shard", "pass the manifest", kind=DataError)


def test_a_train_url_list_with_a_val_shard_in_it_is_refused(uneven):
    """A glob over the dataset directory picks up the val shards too: a train loader must not train on them."""
    urls = [str(p) for p in sorted(uneven.glob("syn-*.tar"))]
    with pytest.raises(DataError) as e:
        loader(urls)
    one_line(e, "syn-val-000000.tar", "plain URLs carry no split", kind=DataError)


def test_url_sources_of_the_requested_split_or_without_a_split_name_are_read_as_it(uneven, tmp_path):
    val = loader(str(uneven / "syn-val-{000000..000001}.tar"), split="val", micro_batch_size=2)
    assert [i for b in val for i in sample_ids(b["tokens"])] == list(range(63, 73))
    (tmp_path / "plain.tar").write_bytes((uneven / "syn-train-000000.tar").read_bytes())
    assert len(loader(str(tmp_path / "plain.tar"), split="val", micro_batch_size=1, global_batch_size=1)) == 13
