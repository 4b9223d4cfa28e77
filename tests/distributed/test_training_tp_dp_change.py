"""Resumed at another data-parallel size under tensor parallelism (TP2 x DP2 saved, TP2 x DP1 resumed):
the optimizer state of TP-sharded weights goes through DeepSpeed's universal conversion, and the
resumed run continues the straight run's losses (GPT under ZeRO-1 and ZeRO-2, ASCender under ZeRO-1)."""

import pytest

from tests.distributed.workers.training import TP_DP_CHANGE
from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return {"data": make_tiny_dataset(tmp_path_factory.mktemp("data")), "root": str(tmp_path_factory.mktemp("runs"))}


@pytest.fixture(scope="module")
def saved(args):
    return run_ranks("tests.distributed.workers.training:tp2_dp2_legs", world_size=4, timeout=400, args=args)


@pytest.fixture(scope="module")
def resumed(args, saved):
    return run_ranks("tests.distributed.workers.training:resume_at_tp2_dp1", world_size=2, timeout=300, args=args)


@pytest.mark.parametrize("name", sorted(TP_DP_CHANGE))
def test_resume_at_another_data_parallel_size_under_tensor_parallelism(saved, resumed, name):
    straight = assert_check(saved, name)[0]["straight"]
    assert len(straight) == 6, straight
    for value in assert_check(resumed, name):  # both TP ranks
        assert value["start"] == 3 and value["universal"], value
        assert len(value["losses"]) == 3, value
        # same weights, optimizer moments, LR position and data; only the reduction order differs
        for got, expected in zip(value["losses"], straight[3:]):
            assert abs(got - expected) < 1e-5, (value["losses"], straight)
