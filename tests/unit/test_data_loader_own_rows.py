"""Each data-parallel rank reads only its own samples, and still yields exactly the batches the
definition of the order gives: checked against a slow reference that builds the global order
from that definition (loader.py's module docstring) and slices it."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from data_pipeline._io import sha256_bytes
from data_pipeline.errors import DataError
from data_pipeline.shards import load_manifest, npy_bytes

from .data_fixtures import SEQ, loader, make_dataset, run_global, sample_tokens, tar_of

COUNTS = [13, 5, 9, 1, 17, 7, 11, 2]  # 65 samples, uneven shards: epochs end inside batches of 24
SEED, MBS, GBS = 3, 2, 24  # 24 divides by MBS * dp for dp in 1..4


def reference_order(counts, seed: int, buffer: int, n_samples: int) -> list[int]:
    """The first ``n_samples`` sample ids of the global order, epoch by epoch: shards in a seeded
    permutation form the stream, cut into blocks of ``buffer``, each block in its own seeded order."""
    shard_ids, first = [], 0
    for n in counts:
        shard_ids.append(list(range(first, first + n)))
        first += n

    def rng(*key):
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % 2**64, 0, *key])))

    out, epoch = [], 0
    while len(out) < n_samples:
        stream = [i for s in rng(epoch, 0).permutation(len(counts)) for i in shard_ids[s]]
        for b, lo in enumerate(range(0, len(stream), buffer)):
            block = stream[lo:lo + buffer]
            out += [block[p] for p in rng(epoch, 1, b).permutation(len(block))]
        epoch += 1
    return out[:n_samples]


def reference_batches(order: list[int], dp_size: int, dp_rank: int, first_step: int, steps: int):
    """Rank ``dp_rank``'s micro-batches of global batches ``first_step ..``: its contiguous slice."""
    per_rank = GBS // dp_size
    out = []
    for s in range(first_step, first_step + steps):
        lo = s * GBS + dp_rank * per_rank
        out += [np.stack([sample_tokens(i) for i in order[m:m + MBS]]) for m in range(lo, lo + per_rank, MBS)]
    return out


def batches(ld, steps: int, dp_size: int):
    it = iter(ld)
    return [next(it)["tokens"].numpy() for _ in range(steps * GBS // dp_size // MBS)]


def same(got, want) -> bool:
    return len(got) == len(want) and all(g.shape == w.shape and np.array_equal(g, w) for g, w in zip(got, want))


@pytest.fixture
def ds(tmp_path):
    make_dataset(tmp_path / "ds", COUNTS, val_counts=[6, 5, 4])
    return tmp_path / "ds"


@pytest.mark.parametrize("dp_size,workers,buffer,partial", [
    (1, 0, 16, None), (2, 0, 16, None), (3, 0, 16, None), (4, 0, 16, None), (4, 0, 5, None),
    (1, 0, 16, True), (3, 0, 16, False), (2, 1, 16, None), (3, 2, 5, None)])
def test_rank_batches_equal_the_reference_across_epochs_and_after_resume(ds, dp_size, workers, buffer, partial):
    steps, cut = 9, 4  # 216 samples: three epochs of 65 and a bit; resume inside epoch 2
    order = reference_order(COUNTS, SEED, buffer, steps * GBS)
    make = functools.partial(loader, ds, seed=SEED, micro_batch_size=MBS, global_batch_size=GBS, dp_size=dp_size,
                             num_workers=workers, shuffle_buffer=buffer, partial_reads=partial)
    for r in range(dp_size):
        ld = make(dp_rank=r)
        assert same(batches(ld, cut, dp_size), reference_batches(order, dp_size, r, 0, cut)), f"rank {r}"
        state = ld.state_dict()
        ld.close()
        resumed = make(dp_rank=r)
        resumed.load_state_dict(state)
        assert same(batches(resumed, steps - cut, dp_size), reference_batches(order, dp_size, r, cut, steps - cut))
        resumed.close()


@pytest.mark.parametrize("dp_size", [2, 3])
def test_resume_mid_global_batch_equals_the_reference(ds, dp_size):
    order = reference_order(COUNTS, SEED, 16, 6 * GBS)
    micro = GBS // dp_size // MBS
    for r in range(dp_size):
        ld = loader(ds, seed=SEED, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=r, dp_size=dp_size)
        it = iter(ld)
        first = [next(it)["tokens"].numpy() for _ in range(3 * micro + 1)]  # one micro-batch into step 3
        again = loader(ds, seed=SEED, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=r, dp_size=dp_size)
        again.load_state_dict(ld.state_dict())
        rest = batches(again, 6, dp_size)[:6 * micro - len(first)]
        assert same(first + rest, reference_batches(order, dp_size, r, 0, 6))


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_val_batches_equal_stored_order_sliced(ds, dp_size):
    first_val = sum(COUNTS)
    step = MBS * dp_size
    n_steps = 15 // step  # 15 val samples; the tail that does not fill a step is dropped
    for r in range(dp_size):
        got = [b["tokens"].numpy() for b in loader(ds, split="val", micro_batch_size=MBS, dp_rank=r, dp_size=dp_size,
                                                   global_batch_size=GBS)]
        want = [np.stack([sample_tokens(first_val + t * step + r * MBS + j) for j in range(MBS)])
                for t in range(n_steps)]
        assert same(got, want)


def test_mixture_ranks_read_own_rows_and_match_one_rank(tmp_path):
    from data_pipeline.loader import MixtureLoader
    make_dataset(tmp_path / "a", [10, 7, 12])
    make_dataset(tmp_path / "b", [9, 9], first_id=1000)

    def make(**kw):
        args = dict(seq_length=SEQ, micro_batch_size=MBS, global_batch_size=GBS, seed=5, shuffle_buffer=8)
        return MixtureLoader([(tmp_path / "a", 3.0), (tmp_path / "b", 1.0)], **{**args, **kw})

    ref, _ = run_global(make, 1, 8, micro_batch_size=MBS, global_batch_size=GBS)
    got, _ = run_global(make, 3, 8, micro_batch_size=MBS, global_batch_size=GBS)
    assert got == ref
    ranks = [make(dp_rank=r, dp_size=3) for r in range(3)]
    for ld in ranks:
        batches(ld, 8, 3)
    one = make(dp_rank=0, dp_size=1, partial_reads=True)  # reads every sample of the blocks it touches
    batches(one, 8, 1)
    assert 8 * GBS <= sum(ld.rows_read for ld in ranks) <= one.rows_read  # not 3x: each its own samples


def test_a_rank_reads_only_its_own_samples(tmp_path):
    counts, buffer, steps = [16] * 20, 32, 10  # one epoch of 320; 240 consumed
    make_dataset(tmp_path / "ds", counts)
    for dp in (2, 4):
        per = GBS // dp
        for r in range(dp):
            ld = loader(tmp_path / "ds", micro_batch_size=MBS, global_batch_size=GBS, dp_rank=r, dp_size=dp,
                        shuffle_buffer=buffer)
            batches(ld, steps, dp)
            # the blocks the rank has touched, and of those exactly the samples it yields
            touched = ((steps - 1) * GBS + (r + 1) * per - 1) // buffer + 1
            g = np.arange(touched * buffer)
            assert ld.rows_read == int(((g % GBS) // per == r).sum()), (dp, r)
    whole = loader(tmp_path / "ds", micro_batch_size=MBS, global_batch_size=GBS, dp_rank=0, dp_size=4,
                   shuffle_buffer=buffer, partial_reads=False)
    batches(whole, steps, 4)
    touched = ((steps - 1) * GBS + GBS // 4 - 1) // buffer + 1
    assert whole.rows_read == touched * buffer  # whole shards: every sample of the blocks touched


# ------------------------------------------------------------------ shards a partial read cannot use
def _rewrite_shard(ds, index: int, members) -> None:
    """Replace train shard ``index`` by a tar of ``members`` and update its manifest entry."""
    data = tar_of(members)
    m = load_manifest(ds)
    shard = m.split_shards("train")[index]
    (ds / shard.name).write_bytes(data)
    shard.sha256, shard.bytes = sha256_bytes(data), len(data)
    m.save(ds / "manifest.json")


def test_foreign_layout_shard_is_read_whole_with_one_log_line(ds, caplog):
    first = sum(COUNTS[:2])
    rows = [sample_tokens(first + k).astype("uint16") for k in range(COUNTS[2])]
    _rewrite_shard(ds, 2, [m for k, row in enumerate(rows)
                           for m in ((f"s{k:03d}.tokens.npy", npy_bytes(row)), (f"s{k:03d}.txt", b"extra"))])
    order = reference_order(COUNTS, SEED, 16, 6 * GBS)
    with caplog.at_level(logging.INFO, logger="data_pipeline.loader"):
        for r in range(2):
            ld = loader(ds, seed=SEED, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=r, dp_size=2)
            assert same(batches(ld, 6, 2), reference_batches(order, 2, r, 0, 6))
    notes = [rec for rec in caplog.records if "older or foreign shard" in rec.getMessage()]
    assert len(notes) == 2  # one line per rank's loader
    assert "syn-train-000002.tar" in notes[0].getMessage()


def test_changed_sample_header_stops_even_in_skip_mode(ds):
    shard = ds / "syn-train-000004.tar"  # 17 samples
    data = bytearray(shard.read_bytes())
    pos = 2048 + 8 * 1024  # sample 9's header (sample 0 + meta.json take 2048 bytes, then 1024 each)
    assert data[pos:pos + 6] == b"000009"
    data[pos + 124:pos + 135] = b"00000000001"
    shard.write_bytes(bytes(data))
    errors = []
    for r in range(2):
        ld = loader(ds, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=r, dp_size=2, on_corrupt="skip")
        try:
            batches(ld, 3, 2)  # 72 samples: more than one epoch, so every sample is read by its owner
        except DataError as e:
            errors.append(str(e))
    assert errors  # the owner of sample 9 stops (the other rank too, if it owns it in epoch 1)
    assert all("syn-train-000004.tar" in e and "sample 9" in e and "\n" not in e for e in errors)


def test_whole_reads_at_dp2_keep_the_sha256_check(ds):
    shard = ds / "syn-train-000004.tar"
    data = bytearray(shard.read_bytes())
    data[2048 + 8 * 1024 + 512 + 130] ^= 1  # a token of sample 9: ids stay in range, only the sha256 changes
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256 mismatch"):
        for r in range(2):
            batches(loader(ds, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=r, dp_size=2,
                           partial_reads=False), 3, 2)


@pytest.mark.parametrize("verify, partial", [(False, True), (True, False)])
def test_run_config_chooses_partial_reads_or_whole_shard_sha256(ds, tmp_path, verify, partial):
    """``data.verify_shard_sha256`` in the run config: whole shards (sha256 checked) on every rank, or,
    by default with data parallelism, each rank's own samples only."""
    import torch

    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.parallel.setup import ParallelState
    from ascender_dist.training.run import build_loader
    from tests.helpers.data import tiny_run_config

    raw = tiny_run_config({"manifest": str(ds / "manifest.json"), "tokenizer": ""}, tmp_path / "run",
                          model={"seq_length": SEQ, "vocab_size": 512},
                          train={"micro_batch_size": MBS, "global_batch_size": GBS})
    raw["data"]["verify_shard_sha256"] = verify
    pstate = ParallelState(rank=1, world_size=2, local_rank=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                           dp_rank=1, dp_size=2, device=torch.device("cpu"))
    ld = build_loader(config_from_dict(raw), None, pstate)
    assert [d.partial for d in ld.datasets] == [partial]
