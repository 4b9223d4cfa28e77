"""TP=2 vs TP=1 of whole models with the same weights: loss, logits and every gradient within 1e-5."""

import pytest

from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_ranks("tests.distributed.workers.model_parity:main", world_size=2, timeout=400)


@pytest.mark.parametrize("check", ["gpt_tp2", "gpt_swiglu_rmsnorm_gqa_tp2", "gpt_learned_pos_untied_tp2",
                                   "ascender_tp2", "ascender_gqa_swiglu_tp2"])
def test_tensor_parallel_matches_single_rank(results, check):
    for diffs in assert_check(results, check):
        assert diffs["num_params"] > 0
        assert diffs["loss"] < TOL, diffs
        assert diffs["logits"] < TOL, diffs
        assert diffs["max_grad"] < TOL, diffs
