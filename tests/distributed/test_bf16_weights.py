"""bf16 training keeps fp32 master weights in its ZeRO optimizer; consolidation, resharding and
checkpoint.init_from must carry those, not the bf16-rounded parameters (which would throw away
every update smaller than a bf16 ulp of the weight)."""

import pytest

from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    data = make_tiny_dataset(tmp_path_factory.mktemp("data"))
    args = {"data": data, "root": str(tmp_path_factory.mktemp("runs"))}
    return run_ranks("tests.distributed.workers.bf16_weights:main", world_size=2, timeout=500, args=args)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_weights_leave_and_enter_as_fp32_masters(results, stage):
    first, *others = assert_check(results, f"zero{stage}")
    # the gathered weights hold values bf16 cannot: the test would pass vacuously without them
    assert first["off_grid"] > 0, first
    assert first["gathered_vs_masters"] == 0.0, first
    for value in [first, *others]:
        assert value["params_are_bf16"], value
        assert value["loaded_masters_vs_file"] == 0.0, value


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_gradients_are_reduced_in_fp32_by_default(results, stage):
    """Accumulated over micro-batches and reduced over DP=2 unrounded (float32 sums of the bf16
    micro-batch gradients); DeepSpeed's own bf16 default rounds them to bf16, which this measures too
    (so the check can tell the two apart)."""
    for fp32 in assert_check(results, f"reduce_z{stage}_fp32"):
        assert fp32 < 1e-6, fp32
    for bf16 in assert_check(results, f"reduce_z{stage}_bf16"):
        assert bf16 > 1e-4, bf16
