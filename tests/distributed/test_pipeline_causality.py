"""No future leak under real pipeline parallelism (PP=2 on two processes over gloo).

tests/unit/test_model_causality checks the pipeline's layer classes in one process (one stage),
test_model_parity TP2 and sequence parallelism. Here the model runs in DeepSpeed's pipeline engine
as the trainer builds it at ``pipeline_model_parallel_size: 2``: one transformer layer per stage,
the activations sent from stage to stage by the engine, the logits from the last stage's
``eval_batch(return_logits=True)``. Changing every token after t must leave the logits at positions
<= t bit-equal and change those after t, for gpt, ascender, connection (softmax | Connection) and
the mixed ASCender | Connection pattern; one launch runs all of them (workers/pipeline_causality).
A custom layer made bidirectional on one stage (the first: its leak crosses the stage boundary;
the last) must be caught by the same comparison.
"""

import pytest

from tests.distributed.workers.pipeline_causality import CONTROLS, MODELS, POSITIONS
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed

# the transformer layers each rank (= pipeline stage) must hold: [global layer number, kind]
STAGE_LAYERS = {"gpt": [[[1, "A"]], [[2, "A"]]], "ascender": [[[1, "S"]], [[2, "S"]]],
                "connection": [[[1, "A"]], [[2, "C"]]], "mixed_sc": [[[1, "S"]], [[2, "C"]]]}


@pytest.fixture(scope="module")
def results():
    return run_ranks("tests.distributed.workers.pipeline_causality:main", world_size=2, timeout=300)


def _assert_pipeline_layout(value: dict, name: str) -> None:
    """The check really ran at PP=2: rank r is stage r and holds layer r + 1 of the model's pattern."""
    assert value["stages"] == 2 and value["stage_of_rank"] == [0, 1], value
    assert value["layers"] == STAGE_LAYERS[name], value["layers"]


@pytest.mark.parametrize("name", list(MODELS))
def test_no_future_leak_under_pipeline_parallelism(results, name):
    """Every token after t changed: the last stage's logits at positions <= t are bit-equal (for
    t inside a chunk of 8, at its end and on a chunk boundary) and those after t differ (so the
    comparison is not vacuous)."""
    assert set(STAGE_LAYERS) == set(MODELS)
    for value in assert_check(results, f"pp2_{name}"):
        _assert_pipeline_layout(value, name)
        assert value["swapped"] == [0, 0]
        by_position = value["by_position"]
        assert sorted(map(int, by_position)) == sorted(POSITIONS)
        for t, diff in by_position.items():
            assert diff["shape"][:2] == [24, 2], diff  # [s, b, v]
            assert diff["prefix_equal"] and diff["prefix"] == 0.0, (name, t, diff)
            assert diff["future"] > 0.0, (name, t, diff)


@pytest.mark.parametrize("control", list(CONTROLS))
def test_the_pipeline_leak_check_catches_a_bidirectional_layer(results, control):
    """The same comparison with one stage's custom layer made bidirectional (causal=False, which the
    config refuses) fails at every t: a leak on the first stage is carried to the logits through
    the engine's stage-to-stage transfer, one on the last stage shows directly."""
    name, stage = CONTROLS[control]
    for value in assert_check(results, f"pp2_bidirectional_{control}"):
        _assert_pipeline_layout(value, name)
        assert value["swapped"] == [int(r == stage) for r in range(2)], value["swapped"]
        assert sorted(map(int, value["by_position"])) == sorted(POSITIONS)
        for t, diff in value["by_position"].items():
            assert not diff["prefix_equal"] and diff["prefix"] > 0.0, (control, t, diff)
