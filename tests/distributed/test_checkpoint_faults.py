"""2 real ranks: a damaged checkpoint file of one rank, and a save whose writer fails on one rank,
end every rank with the same one-line error; a resume checks the model and the data it resumes
(tests/distributed/workers/checkpoint_faults.py)."""

import re

import pytest

from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    args = {"data": make_tiny_dataset(tmp_path_factory.mktemp("data")), "root": str(tmp_path_factory.mktemp("runs"))}
    return run_ranks("tests.distributed.workers.checkpoint_faults:main", world_size=2, timeout=400, args=args)


def test_a_damaged_file_of_one_rank_stops_every_rank_before_loading(results):
    values = assert_check(results, "damaged_file_of_rank1")
    expected = (f"{values[0]['file']}: truncated (1000 of ")
    for value in values:  # the same line on both ranks, naming the file, its rank and the problem
        assert value["message"] is not None and value["message"].startswith(expected), value
        assert value["message"].endswith(" bytes) (rank 1's file, checked before anything was loaded)")
        assert value["rank"] == 1 and value["seconds"] < 30
    assert values[0]["message"] == values[1]["message"]


def test_a_write_failing_on_one_rank_fails_the_save_everywhere_and_keeps_latest(results):
    values = assert_check(results, "write_fails_on_rank1")
    assert values[0]["message"] == values[1]["message"]
    message = values[0]["message"]
    prefix = f"{values[0]['dir']}: saving step_00000002 failed on rank 1: write failed (RuntimeError: "
    assert message.startswith(prefix), message
    assert re.search(r"; \d+\.\d (GiB|MiB) free there; removed step_00000002.partial, latest still names "
                     r"step_00000001$", message), message
    assert "\n" not in message and values[0]["rank"] == 1
    tags = [name for name in values[0]["entries"] if name.startswith("step_")]  # (DeepSpeed adds scripts)
    assert tags == ["step_00000001"] and values[0]["latest"] == "step_00000001"


def test_a_tokenizer_one_rank_cannot_read_stops_every_rank_with_its_line(results):
    own, peer = assert_check(results, "tokenizer_unreadable_on_rank1")[::-1]  # rank 1's, rank 0's
    assert own["type"] == "DataError" and own["message"].endswith(": tokenizer not found (this node's view)"), own
    assert peer["message"] == own["message"] and peer["rank"] == 1, peer
    assert own["seconds"] < 30 and peer["seconds"] < 30


def test_resume_names_a_changed_model_field_and_refuses_other_data_unless_allowed(results):
    for value in assert_check(results, "resume_checks"):
        assert re.fullmatch(r"model.hidden_size: checkpoint \S+/step_00000002 has 32, the config has 64; resume with "
                            r"the checkpoint's model, or start a new checkpoint.dir", value["changed_model"]), value
        assert value["same_start"] == 2  # the same manifest content in another directory resumes
        assert value["refused"].startswith(f"data.manifest: {value['manifest']} differs from the data checkpoint ")
        assert value["refused"].endswith("; set data.allow_change_on_resume: true to resume on it anyway")
        assert value["allowed_start"] == 2
        [change] = value["data_changes"]  # recorded in the checkpoint written after the change
        assert change["step"] == 2 and change["to"] == value["fingerprint"] != change["from"]


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return run_ranks("tests.distributed.workers.universal_wait:main", world_size=2, timeout=120,
                     args={"root": str(tmp_path_factory.mktemp("universal"))})


def test_a_universal_conversion_longer_than_the_group_timeout_keeps_every_rank(universal):
    """Rank 0 converts for twice the process group's timeout; the other rank waits on the files."""
    from tests.distributed.workers.universal_wait import CONVERSION_S

    for value in assert_check(universal, "slow_conversion"):
        assert value.get("tag") == "step_00000001-universal" and value["seconds"] >= CONVERSION_S, value


def test_a_failed_universal_conversion_stops_every_rank_with_rank_0s_message(universal):
    values = assert_check(universal, "failed_conversion")
    for value in values:
        assert "conversion to a universal checkpoint failed: KeyError: 'optimizer_state'" in value.get("error", ""), value
    assert values[0]["error"] == values[1]["error"]


def test_a_conversion_that_writes_reports_progress_on_every_rank_and_a_silent_one_none(universal):
    """A stall watchdog must not end a rollback whose universal conversion outlasts its timeout while
    it advances (each change in its output reaches on_progress, on rank 0 from the heartbeat, on the
    waiting rank from the heartbeat file), and must still end one that hangs: a converter that writes
    nothing for twice the group's timeout (then fails) reports no progress on either rank."""
    from tests.distributed.workers.universal_wait import WRITES

    prefix = "the universal conversion of step_00000005: "
    for value in assert_check(universal, "writing_conversion"):
        assert value.get("tag") == "step_00000005-universal", value
        reports = value["progress"]
        if reports and reports[-1].startswith(prefix + "converted ("):  # when a beat fell between the
            reports = reports[:-1]  # converter's return and the end of the publishing (not always)
        # a beat every 0.2 s sees most of the writes (1 s apart): at least half of them, each a new
        # size; neither the removal of a killed attempt's leftover output nor the publishing (which
        # moves the output away) is reported as progress
        assert WRITES // 2 <= len(reports) <= WRITES and len(set(reports)) == len(reports), reports
        assert all(r.startswith(prefix) and r.endswith(" bytes written") and not r.startswith(prefix + "0 files")
                   for r in reports), reports
    for value in assert_check(universal, "failed_conversion"):
        assert value["progress"] == [], value


def test_a_progress_report_that_raises_stops_neither_the_heartbeat_nor_the_conversion(universal):
    """A failing on_progress callback on rank 0 ended its heartbeat thread (the waiting rank then took
    rank 0 for dead), and on a waiting rank left the conversion's protocol (rank 0 then waited for it in
    the closing collective). Each rank's failure is logged once and no report follows; both ranks get
    the copy."""
    for value in assert_check(universal, "raising_progress"):
        assert value.get("tag") == "step_00000006-universal" and len(value["progress"]) == 1, value


def test_any_exception_of_rank_0s_conversion_stops_every_rank_with_its_message(universal):
    """A RuntimeError (torch.load of a damaged shard) wrote no failure note: the other ranks waited forever."""
    for value in assert_check(universal, "crashed_conversion"):
        assert "step_00000003: conversion to a universal checkpoint failed: RuntimeError: PytorchStreamReader" in \
            value.get("error", ""), value


def test_a_rank_0_that_stops_beating_during_conversion_stops_the_waiting_ranks(universal):
    """Rank 0 killed mid-conversion (here: silent for longer than the waiting rank's patience) left
    ranks on other nodes waiting forever."""
    for value in assert_check(universal, "dead_rank0"):
        assert "no sign of rank 0's universal checkpoint conversion" in value.get("error", ""), value


def test_a_checkpoint_dir_that_differs_between_ranks_is_refused_on_every_rank(universal):
    assert all(v["error"] is None for v in assert_check(universal, "shared_dir"))
    for value in assert_check(universal, "node_local_dir"):
        assert value["error"].startswith("rank 1: ") and "local1: not the directory rank 0 sees" in value["error"], value
        assert "storage every rank shares" in value["error"]


def test_every_rank_resumes_from_the_tag_rank_0_reads(universal):
    """Rank 1's `latest` is an older cached copy: before, it resumed from step 1 while rank 0
    resumed from step 2 (mixed weights, no error)."""
    assert [v.get("tag") for v in assert_check(universal, "stale_latest")] == ["step_00000002"] * 2


def test_a_resume_tag_another_rank_cannot_see_stops_every_rank_naming_it(universal):
    for value in assert_check(universal, "marker_not_visible"):
        assert value["error"].startswith("rank 1: ") and "step_00000001: rank 0's latest checkpoint, but its" in \
            value["error"] and "storage every rank shares" in value["error"], value


def test_a_resume_target_whose_meta_one_rank_cannot_read_stops_every_rank_naming_it(universal):
    """The layout check reads meta.json on every rank (on_every_rank): rank 1 failing alone must stop
    rank 0 too, with rank 1's message, rather than leave it waiting in the next collective (the
    process group's 5 s timeout would end it with a timeout instead)."""
    rank0, rank1 = assert_check(universal, "meta_unreadable_rank1")
    assert rank0.get("rank") == 1 and rank1.get("rank") is None, (rank0, rank1)  # rank 0 names rank 1; rank 1 its own
    assert rank0["error"] == rank1["error"], (rank0, rank1)
    assert rank0["error"].endswith("step_00000001/meta.json: unreadable (Stale file handle)"), rank0


def test_rank_0s_error_reading_latest_stops_every_rank_with_its_message(universal):
    values = assert_check(universal, "latest_missing")
    assert values[0]["error"] == values[1]["error"] and "latest: missing, but the directory holds complete" in \
        values[0]["error"], values


def test_every_file_of_a_save_is_hashed_when_one_ranks_listing_is_stale(universal):
    """Before, each rank split its own listing: rank 1 missing b.pt shifted the split and b.pt and
    sub/d.pt went unrecorded (never checked on resume)."""
    for value in assert_check(universal, "stale_listing"):
        assert value["files"] == ["a.pt", "b.pt", "c.pt", "sub/d.pt"], value


def test_init_from_weights_that_fail_on_one_stage_stop_every_rank(universal):
    """Before, the stage lacking a layer raised and the others waited in the next collective until
    the process group's timeout."""
    rank0, rank1 = assert_check(universal, "init_from_rank1")
    assert rank1["error"] == "checkpoint.init_from: w.safetensors: no tensor decoder.layers.3.mlp.linear_fc1.weight"
    assert rank0 == {"error": rank1["error"], "rank": 1}  # the job's error line names rank 1


def test_a_configuration_that_differs_on_one_rank_stops_every_rank(universal):
    for value in assert_check(universal, "config_rank1"):
        assert value["error"].startswith("config: ranks [1] loaded another configuration than rank 0"), value


def test_a_checkpoint_dir_one_rank_cannot_write_stops_every_rank(universal):
    rank0, rank1 = assert_check(universal, "read_only_rank1")
    assert rank1["error"].endswith("read-only: checkpoint directory is not writable"), rank1
    assert rank0 == {"error": rank1["error"], "rank": 1}


def test_an_os_error_on_one_rank_is_raised_on_every_rank(universal):
    rank0, rank1 = assert_check(universal, "os_error_rank1")
    assert rank1 == {"os_error": "[Errno 28] No space left on device"}
    assert rank0 == {"error": "OSError: [Errno 28] No space left on device", "rank": 1}
