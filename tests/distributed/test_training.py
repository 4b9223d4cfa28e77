"""Real multi-rank training: an interrupted and resumed run reproduces the straight run exactly."""

import pytest

from tests.distributed.workers.training import TP_DP_CHANGE
from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return {"data": make_tiny_dataset(tmp_path_factory.mktemp("data")), "root": str(tmp_path_factory.mktemp("runs"))}


@pytest.fixture(scope="module")
def results(args):
    return run_ranks("tests.distributed.workers.training:main", world_size=2, timeout=500, args=args)


@pytest.fixture(scope="module")
def dp1_results(args, results):
    return run_ranks("tests.distributed.workers.training:resume_at_dp1", world_size=1, timeout=300, args=args)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_reproduces_straight_run(results, stage):
    for value in assert_check(results, f"resume_zero{stage}"):
        assert value["start_step"] == 3
        assert len(value["straight"]) == 6 and len(value["second_leg"]) == 3, value  # both legs really trained
        assert value["first_leg"] == value["straight"][:3]
        # fp32 on CPU is deterministic: the resumed steps must be bit-identical, not merely close
        assert value["second_leg"] == value["straight"][3:], value


def test_separation_joins_at_its_start_step_through_the_trainers_step(results):
    """The trainer hands every ASCender layer its step: with separation_start_step 2, delta and kappa
    (read by Separation alone) get no gradient in steps 0 and 1 and a non-zero one from step 2 on."""
    for value in assert_check(results, "separation_schedule"):
        assert [entry["step"] for entry in value] == [0, 1, 2, 3], value
        for entry in value:
            step = entry["step"]
            assert entry["layer_steps"] == [step], value
            for name in ("delta", "kappa"):
                assert (entry[name] > 0) == (step >= 2), (step, name, value)


def test_a_stop_on_a_validation_step_validates_when_the_run_goes_on(results):
    for value in assert_check(results, "stop_on_a_validation_step"):
        straight = value["straight"]
        assert [step for step, _ in straight] == [2, 4], value
        assert value["stopped_at"] == 2 and value["stopped"] == [], value  # the save came first
        assert value["start"] == 2 and value["resumed"] == straight, value  # same weights, same batches
        # the due validation on its own at step 2, then step 3's scalars (JSON: lists)
        (due_step, due_keys), (next_step, next_keys) = value["resumed_logged"]
        assert (due_step, due_keys, next_step) == (2, ["val/loss"], 3) and "train/loss" in next_keys, value
        assert value["last"] == straight, value  # the last step's, before its final save
        assert value["rerun"] == [] and value["off"] == [], value
    first_rank = assert_check(results, "stop_on_a_validation_step")[0]
    assert first_rank["board_val_steps"] == [2, 4] and first_rank["board_last_val_steps"] == [2, 4], first_rank


def test_skipped_shards_are_counted_over_the_data_parallel_ranks_and_kept_on_resume(results):
    rank0, rank1 = assert_check(results, "skipped_shards")
    assert rank0["met"] == [] and len(rank1["met"]) == 1  # rank 1 alone met the corrupt shard ...
    assert rank0["own"] == 0 and rank1["own"] == 1
    for rank in (rank0, rank1):  # ... and both count it from the console step on (rank 0 logs it)
        assert rank["first"] == {"1": rank["own"], "2": 1.0}, rank  # logged value per step (JSON: str keys)
        assert rank["second"] == {"3": 1.0, "4": 1.0}, rank  # kept in the checkpoint: the resumed job never met it
        assert rank["resumed_own"] == 0


def test_layer_statistics_are_reduced_over_the_data_parallel_replicas(results):
    for value in assert_check(results, "layer_stats_over_replicas"):  # ranks: (1, 2) and (2, 5)
        assert value == {"connection/steps_mean/layer02": 1.5, "connection/steps_max/layer02": 5.0}


def test_per_head_layer_statistics_are_gathered_over_tensor_parallel_ranks_in_head_order(results):
    expected = {"ascender/gate_coh_mean/layer03/head00": 0.0, "ascender/gate_coh_mean/layer03/head01": 1.0,
                "ascender/gate_coh_mean/layer03/head02": 10.0, "ascender/gate_coh_mean/layer03/head03": 11.0,
                "ascender/gate_coh_mean/layer03": 5.5, "ascender/aux_compactness/layer03": 2.0}
    for value in assert_check(results, "layer_stats_per_head_over_tensor_parallel"):  # the same on both ranks
        assert value == expected


def test_resume_at_another_data_parallel_size_is_refused_in_one_line_under_zero3(results, dp1_results):
    assert len(assert_check(results, "dp2_leg_zero3")[0]["straight"]) == 6  # the saved run trained to its end
    message = assert_check(dp1_results, "resume_dp1_zero3_refused")[0]
    assert message and message.startswith("parallel: ") and "\n" not in message, message
    assert "saved at data-parallel size 2 with ZeRO-3; resuming at 1 is not supported" in message, message


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_resume_at_another_data_parallel_size_continues_the_same_losses(results, dp1_results, stage):
    """Saved at DP=2 after 3 steps, resumed by a 1-rank job (ZeRO 1-3: through a DeepSpeed universal
    checkpoint; ZeRO-0: natively, every rank holds the whole optimizer state)."""
    universal = stage != 0
    straight = assert_check(results, f"dp2_leg_zero{stage}")[0]["straight"]
    assert len(straight) == 6, straight
    value = assert_check(dp1_results, f"resume_dp1_zero{stage}")[0]
    assert value["start"] == 3
    assert value["rng_restored"], "the resumed rank must continue the saved rank's RNG streams"
    assert len(value["losses"]) == 3
    # same weights, optimizer moments, LR position and data; only the reduction order differs
    for got, expected in zip(value["losses"], straight[3:]):
        assert abs(got - expected) < 1e-5, (value["losses"], straight)
    # then our own DP=1 checkpoint loads through an engine built to read native checkpoints
    assert value["read_universal"] == universal and value["reloaded"] and not value["reads_universal_after"]
    # each optimizer group keeps its own settings (ZeRO-3's universal loader copies group 0's)
    assert value["weight_decay_by_group"] == [0.1, 0.0], value  # decay, no-decay (the config's 0.1)
    assert value["step_after"] == 6 and value["val_after"] == value["val_before"]
    # and a rollback target saved at DP=2 is read through its universal copy, not refused by DeepSpeed
    assert value["rolled_back"] and value["rolled_back_step"] == 3
    assert value["rolled_back_reads_universal"] == universal
    # its conversion, made again, told the callbacks it advanced (no conversion: no progress)
    assert (value["rollback_progress"] > 0) == universal, value["rollback_progress"]
    # callbacks: hooks in order, the step they saw; validation every 2 steps; per-sequence losses
    # of the last validation (2 batches of micro-batch 4, one rank) average to its loss
    step_hooks = [("on_step_start", s) for s in (3, 4, 5)]
    assert tuple(value["fit_calls"][0]) == ("on_load", None)  # the resume, before the trainer existed
    calls = [tuple(c) for c in value["fit_calls"][1:]
             if c[0] not in ("on_batch", "on_validation_start", "on_validation_end")]
    assert calls[0] == ("on_train_start", 3) and calls[-2:] == [("on_save", 6), ("on_train_end", 6)], calls
    assert [c for c in calls if c[0] == "on_step_start"] == step_hooks, calls
    assert [c for c in calls if c[0] == "on_log"] == [("on_log", s) for s in (4, 5, 6)], calls
    assert [c[0] for c in calls[1:4]] == ["on_step_start", "on_step_end", "on_log"], calls
    assert [step for step, _ in value["curve"]] == [4, 6]
    assert len(value["per_sequence"]) == 8
    assert abs(sum(value["per_sequence"]) / 8 - value["val_after"]) < 1e-5, value


@pytest.mark.parametrize("stage", [0, 1])
def test_resume_takes_the_configs_optimizer_settings(results, stage):
    """weight decay (decay group only), betas, eps and clipping come from the resumed run's config."""
    value = assert_check(results, f"optimizer_settings_zero{stage}")[0]
    assert value["step_at_resume_end"] == 4
    assert value["groups"] == [[0.05, [0.9, 0.999], 1e-6], [0.0, [0.9, 0.999], 1e-6]]  # decay group first
    assert value["clip"] == 0.5


# Resumed at another data-parallel size under tensor parallelism (TP2 x DP2 saved, TP2 x DP1 resumed): the
# optimizer state of TP-sharded weights goes through DeepSpeed's universal conversion.
@pytest.fixture(scope="module")
def tp2_dp2_results(args):
    return run_ranks("tests.distributed.workers.training:tp2_dp2_legs", world_size=4, timeout=400, args=args)


@pytest.fixture(scope="module")
def tp2_dp1_results(args, tp2_dp2_results):
    return run_ranks("tests.distributed.workers.training:resume_at_tp2_dp1", world_size=2, timeout=300, args=args)


@pytest.mark.parametrize("name", sorted(TP_DP_CHANGE))
def test_resume_at_another_data_parallel_size_under_tensor_parallelism(tp2_dp2_results, tp2_dp1_results, name):
    """GPT under ZeRO-1 and ZeRO-2, ASCender under ZeRO-1: the resumed run continues the straight run's losses."""
    straight = assert_check(tp2_dp2_results, name)[0]["straight"]
    assert len(straight) == 6, straight
    for value in assert_check(tp2_dp1_results, name):  # both TP ranks
        assert value["start"] == 3 and value["universal"], value
        assert len(value["losses"]) == 3, value
        # same weights, optimizer moments, LR position and data; only the reduction order differs
        for got, expected in zip(value["losses"], straight[3:]):
            assert abs(got - expected) < 1e-5, (value["losses"], straight)
