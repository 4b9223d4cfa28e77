"""Ranks agree on which shards a loader uses: the set-up checks are decided on the union of every
rank's findings (a shard one rank could not use is dropped on all, or every rank raises the same
line), and a transient I/O error mid-run is retried before it can make one rank skip a shard its
peers read. Ranks are threads here, meeting in an ``all_gather`` at a barrier as processes would
(tests/distributed/test_data_skips.py does it over gloo through ``build_loader``)."""

from __future__ import annotations

import errno
import functools
import threading
import time

import pytest

from data_pipeline import loader as loader_mod
from data_pipeline.errors import DataError

from tests.helpers.errors import one_line

from .data_fixtures import ThreadRanks, loader, make_dataset, run_global, sample_ids


@pytest.fixture
def ds(tmp_path):
    make_dataset(tmp_path / "ds", [8, 8, 8, 8, 8, 8], val_counts=[4, 4])
    return tmp_path / "ds"


@pytest.fixture
def waits(monkeypatch):
    """The pauses between read attempts, recorded instead of slept."""
    got: list[float] = []
    monkeypatch.setattr(loader_mod, "_wait", got.append)
    return got


def fail_precheck_on(monkeypatch, ranks: ThreadRanks, where: dict) -> None:
    """``_precheck`` of shard ``where[rank]`` fails on that rank only: ESTALE on rank 1, not found
    on rank 0 (a shard briefly invisible to one node)."""
    real = loader_mod._Dataset._precheck
    errors = {0: FileNotFoundError(errno.ENOENT, "No such file or directory"),
              1: OSError(errno.ESTALE, "Stale file handle")}

    def precheck(spec):
        name = where.get(ranks.rank())
        if name and spec.url.endswith(name):
            raise loader_mod._unreadable(spec.url, errors[ranks.rank()])
        return real(spec)

    monkeypatch.setattr(loader_mod._Dataset, "_precheck", staticmethod(precheck))


def first_ids(ld, n: int = 6) -> list[int]:
    it = iter(ld)
    return [i for _ in range(n) for i in sample_ids(next(it)["tokens"])]


# --------------------------------------------------------------------------- the union
def test_agreed_faults_are_the_union_over_ranks_in_shard_order():
    reports = [[(3, "s3", "missing shard (file not found)", True)],
               [(1, "s1", "cannot read shard (OSError: stale)", True), (3, "s3", "cannot read shard (EIO)", True)]]
    got = loader_mod._agreed_faults(reports[0], lambda mine: reports)
    assert got == [(1, "s1", "cannot read shard (OSError: stale)", True, [1]),
                   (3, "s3", "missing shard (file not found)", True, [0, 1])]  # the lowest rank's words
    assert loader_mod._found_by([1]) == " (found by rank 1)"
    assert loader_mod._found_by([0, 1]) == " (found by ranks 0, 1)"
    assert loader_mod._found_by([]) == ""


def test_a_fault_that_stops_the_run_outranks_a_skippable_one_on_the_same_shard():
    reports = [[(2, "s2", "cannot read shard (EIO)", True)], [(2, "s2", "token id 900 >= vocab size 300", False)]]
    assert loader_mod._agreed_faults(reports[0], lambda mine: reports) == \
        [(2, "s2", "token id 900 >= vocab size 300", False, [1])]


def test_without_all_gather_a_process_decides_alone_and_names_no_rank():
    mine = [(0, "s0", "empty shard", True)]
    assert loader_mod._agreed_faults(mine) == [(0, "s0", "empty shard", True, [])]


@pytest.mark.parametrize("split", ["train", "val"])
def test_ranks_built_together_drop_every_shard_any_rank_could_not_use(ds, monkeypatch, split):
    ranks = ThreadRanks(2)
    hidden = {"train": {0: "syn-train-000004.tar", 1: "syn-train-000001.tar"}, "val": {1: "syn-val-000000.tar"}}
    fail_precheck_on(monkeypatch, ranks, hidden[split])
    loaders = ranks.run(lambda r: loader(ds, on_corrupt="skip", split=split, all_gather=ranks.all_gather))
    assert not any(isinstance(ld, Exception) for ld in loaders), loaders
    a, b = loaders
    names = [[s.url.rsplit("/", 1)[1] for s in d.specs] for d in a.datasets]
    assert names == [[s.url.rsplit("/", 1)[1] for s in d.specs] for d in b.datasets]
    bad = {names[0][i] for i in a.datasets[0].bad}  # kept in the order, skipped on both ranks
    assert bad == {names[0][i] for i in b.datasets[0].bad} == set(hidden[split].values())
    assert a.samples_per_epoch == b.samples_per_epoch == (48 if split == "train" else 8)
    assert a.skipped_shards == b.skipped_shards == len(hidden[split])
    if split == "train":
        assert first_ids(a) == first_ids(b)
        hidden_ids = {8 * int(name[-10:-4]) + j for name in hidden["train"].values() for j in range(8)}
        assert not set(first_ids(a, 24)) & hidden_ids
    else:
        assert len(a) == len(b) == 4


def test_a_shard_found_bad_when_a_job_restarts_keeps_the_order_it_saved(tmp_path):
    """Dropped at set-up, the shard shortened the permutation: a job restarting after a shard went
    bad resumed another order than it saved (it re-read ~a quarter of the consumed samples and
    missed as many; one warning line). Kept in the order and skipped as a mid-run find is, the
    resumed stream is the one a run with the fault from the start reads from that position."""
    root = tmp_path / "ds"
    make_dataset(root, [37, 5, 64, 23, 50])
    make = functools.partial(loader, root, on_corrupt="skip", shuffle_buffer=16)
    healthy = make()
    it = iter(healthy)
    for _ in range(40):  # 80 samples, then the checkpoint
        next(it)
    state = healthy.state_dict()
    (root / "syn-train-000003.tar").unlink()
    from_start = make()
    assert from_start.datasets[0].bad == {3} and from_start.samples_per_epoch == healthy.samples_per_epoch
    reference = first_ids(from_start, 40 + 60)[80:]
    resumed = make()
    resumed.load_state_dict(state)
    assert first_ids(resumed, 60) == reference


def test_a_plain_url_shard_one_rank_cannot_read_is_left_out_on_every_rank(ds, monkeypatch):
    """Plain URLs are counted by each rank's own first scan: the rank that cannot read the shard has
    no count for it, its peers do. Keeping a skipped shard by its scanned count kept it on those
    peers and dropped it on that rank: other orders per rank for the whole run, silently."""
    ranks = ThreadRanks(2)
    real = loader_mod.read_shard_and_meta

    def read(spec, *args, **kwargs):
        if getattr(ranks.local, "rank", None) == 1 and spec.url.endswith("syn-train-000002.tar"):  # set-up
            raise loader_mod._unreadable(spec.url, OSError(errno.EIO, "Input/output error"))
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(loader_mod, "read_shard_and_meta", read)
    urls = [str(ds / f"syn-train-{i:06d}.tar") for i in range(6)]
    loaders = ranks.run(lambda r: loader(urls, on_corrupt="skip", all_gather=ranks.all_gather))
    assert not any(isinstance(ld, Exception) for ld in loaders), loaders
    a, b = (ld.datasets[0] for ld in loaders)
    assert [s.url for s in a.specs] == [s.url for s in b.specs] == urls[:2] + urls[3:]
    assert a.bad == b.bad == set() and loaders[0].samples_per_epoch == loaders[1].samples_per_epoch == 40
    assert first_ids(loaders[0]) == first_ids(loaders[1])


def test_ranks_built_together_raise_the_same_line_naming_shard_and_rank(ds, monkeypatch):
    ranks = ThreadRanks(2)
    fail_precheck_on(monkeypatch, ranks, {1: "syn-train-000002.tar"})
    errors = ranks.run(lambda r: loader(ds, on_corrupt="error", all_gather=ranks.all_gather))
    assert all(isinstance(e, DataError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    one_line(errors[0], "syn-train-000002.tar", "cannot read shard (OSError: [Errno 116] Stale file handle)",
             "(found by rank 1)", kind=DataError)


def test_a_rank_alone_keeps_the_old_line(ds, monkeypatch):
    (ds / "syn-train-000002.tar").unlink()
    with pytest.raises(DataError) as e:
        loader(ds)
    assert str(e.value) == f"{ds / 'syn-train-000002.tar'}: missing shard (file not found)"


# --------------------------------------------------------------------------- mid-run retries
def _flaky(monkeypatch, name: str, attr: str, failures: int, err: OSError) -> list:
    """``loader_mod.<attr>`` raises ``err`` for the first ``failures`` calls on shard ``name``;
    returns the list of its calls on that shard."""
    real, calls = getattr(loader_mod, attr), []

    def flaky(target, *args):
        if str(target).endswith(name):
            calls.append(str(target))
            if len(calls) <= failures:
                raise err
        return real(target, *args)

    monkeypatch.setattr(loader_mod, attr, flaky)
    return calls


def test_a_transient_error_in_a_whole_shard_read_is_retried_not_skipped(ds, monkeypatch, waits):
    clean = first_ids(loader(ds, on_corrupt="skip"), 24)  # a whole epoch
    calls = _flaky(monkeypatch, "syn-train-000003.tar", "_fetch_bytes", 2, OSError(errno.EIO, "Input/output error"))
    ld = loader(ds, on_corrupt="skip")
    assert first_ids(ld, 24) == clean and ld.skipped_shards == 0
    assert len(calls) == 3 and waits == [0.5, 1.0]


def test_a_transient_error_in_a_partial_read_is_retried_not_skipped(ds, monkeypatch, waits):
    clean, _ = run_global(functools.partial(loader, ds, on_corrupt="skip"), 2, 8)
    calls = _flaky(monkeypatch, "syn-train-000003.tar", "_open_local", 1, OSError(errno.ESTALE, "Stale file handle"))
    loaders = []

    def make(**kw):
        loaders.append(loader(ds, on_corrupt="skip", **kw))
        return loaders[-1]

    ids, _ = run_global(make, 2, 8)  # dp 2: positioned reads of each rank's rows
    assert ids == clean and all(ld.skipped_shards == 0 for ld in loaders)
    assert len(calls) >= 2 and waits == [0.5]


def test_a_persistent_io_error_makes_the_shard_corrupt_after_the_last_try(ds, monkeypatch, waits):
    monkeypatch.setattr(loader_mod, "IO_TRIES", 5)
    calls = _flaky(monkeypatch, "syn-train-000001.tar", "_fetch_bytes", 99, OSError(errno.ETIMEDOUT, "timed out"))
    spec = loader(ds).datasets[0].specs[1]
    with pytest.raises(loader_mod._CorruptShard) as e:
        loader_mod.read_shard(spec, loader_mod.ShardChecks(8))
    one_line(e, "syn-train-000001.tar", "cannot read shard (TimeoutError: [Errno 110] timed out)", kind=DataError)
    assert len(calls) == 5 and waits == [0.5, 1.0, 2.0, 2.0]  # doubling, capped at IO_BACKOFF_MAX_S


@pytest.mark.parametrize("attr, dp_size", [("_fetch_bytes", 1), ("_open_local", 2)])  # whole / positioned reads
def test_a_shard_unreadable_mid_run_stops_a_rank_with_tensor_or_pipeline_peers(ds, monkeypatch, waits, attr, dp_size):
    """Skipping alone would feed this rank other tokens than its peers from then on; without peers
    the shard is skipped as before (only this rank reads those rows)."""
    _flaky(monkeypatch, "syn-train-000003.tar", attr, 99, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(DataError) as e:
        run_global(functools.partial(loader, ds, on_corrupt="skip", peers_share_rows=True), dp_size, 8)
    one_line(e, "syn-train-000003.tar", "cannot read shard (OSError: [Errno 5] Input/output error); not skipped: "
             "this rank's tensor/pipeline peers read the same samples", kind=DataError)
    loaders = []

    def make(**kw):
        loaders.append(loader(ds, on_corrupt="skip", **kw))
        return loaders[-1]

    ids, _ = run_global(make, dp_size, 8)
    assert len(ids) == 64 and not set(ids) & set(range(24, 32))  # nothing from the unreadable shard
    assert any(ld.skipped_shards for ld in loaders)


def test_bad_bytes_mid_run_are_skipped_with_peers_too(ds):
    """Every reader of the shard meets its bytes, so peers reach the same verdict alone."""
    shard = ds / "syn-train-000003.tar"
    data = bytearray(shard.read_bytes())
    data[600:900] = b"\xff" * 300
    shard.write_bytes(bytes(data))
    ld = loader(ds, on_corrupt="skip", peers_share_rows=True)
    ids = first_ids(ld, 24)
    assert len(ids) == 48 and not set(ids) & set(range(24, 32)) and ld.skipped_shards == 1


def test_content_errors_are_not_retried(ds, monkeypatch, waits):
    """Bad bytes are the file's: every rank reading it meets them, so there is nothing to wait for."""
    shard = ds / "syn-train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600:900] = b"\xff" * 300
    shard.write_bytes(bytes(data))
    calls = _flaky(monkeypatch, "syn-train-000001.tar", "_fetch_bytes", 0, OSError())
    spec = loader(ds).datasets[0].specs[1]
    with pytest.raises(loader_mod._CorruptShard) as e:
        loader_mod.read_shard(spec, loader_mod.ShardChecks(8))
    one_line(e, "sha256 mismatch", kind=DataError)
    assert len(calls) == 1 and waits == []


# --------------------------------------------------------------------------- sources one rank cannot resolve
def _impatient_ranks() -> ThreadRanks:
    """Two thread ranks whose all_gather gives up after 5 s: a peer left waiting in it (the old
    behaviour) shows as a BrokenBarrierError instead of a 30 s wait."""
    ranks = ThreadRanks(2)
    ranks.barrier = threading.Barrier(2, timeout=5)
    return ranks


@pytest.mark.parametrize("missing_on", [[1], [0, 1]])
def test_a_manifest_some_ranks_cannot_load_stops_every_rank_with_the_same_line(ds, tmp_path, missing_on):
    """A mount missing on one node: that rank fails while loading the manifest, before the set-up
    checks' first all_gather. Its peers must not wait in that collective (gloo: "Connection closed
    by peer", NCCL: a hang until the timeout): every rank raises the lowest failing rank's line."""
    ranks = _impatient_ranks()
    gone = tmp_path / "missing-mount" / "manifest.json"
    start = time.monotonic()
    errors = ranks.run(lambda r: loader(gone if r in missing_on else ds, all_gather=ranks.all_gather))
    assert time.monotonic() - start < 4.5
    assert all(isinstance(e, DataError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    found_by = "(found by rank 1)" if missing_on == [1] else "(found by ranks 0, 1)"
    one_line(errors[0], str(gone), "manifest not found", found_by, kind=DataError)


def test_a_source_check_one_rank_fails_later_is_pooled_too(ds, monkeypatch):
    """The same for the checks between resolving and the shard scan (``_check_distinct_shards``)."""
    ranks = _impatient_ranks()
    real = loader_mod._check_distinct_shards

    def check(resolved):
        if ranks.rank() == 1:
            raise DataError("syn-train-000001.tar", "shard listed twice in dataset x")
        return real(resolved)

    monkeypatch.setattr(loader_mod, "_check_distinct_shards", check)
    errors = ranks.run(lambda r: loader(ds, all_gather=ranks.all_gather))
    assert all(isinstance(e, DataError) for e in errors), errors
    assert str(errors[0]) == str(errors[1]) == \
        "syn-train-000001.tar: shard listed twice in dataset x (found by rank 1)"
