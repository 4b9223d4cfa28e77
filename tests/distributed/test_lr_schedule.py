"""Through training on 2 ranks: every optimizer step runs (and logs) at lr_at(step) of the config in
force, from step 1, across layouts, and after a resume that lengthens a cosine run."""

import pytest

from ascender_dist.config.resolve import config_from_dict
from ascender_dist.training.lr_schedule import lr_at
from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.multiproc import assert_check, run_ranks
from tests.helpers.tensorboard import read_scalars

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data = make_tiny_dataset(tmp_path_factory.mktemp("data"))
    args = {"data": data, "root": str(tmp_path_factory.mktemp("runs"))}
    return args, run_ranks("tests.distributed.workers.lr_schedule:main", world_size=2, timeout=500, args=args)


def _expected(args, steps: int, optimizer: dict) -> list:
    cfg = config_from_dict(tiny_run_config(args["data"], "unused", train={"train_steps": steps},
                                           optimizer=optimizer))
    return [lr_at(s, cfg.optimizer, steps) for s in range(1, steps + 1)]


def _check(results, name: str, expected: list, first_step: int = 1) -> None:
    for value in assert_check(results, name):
        # every step updates (ZeRO-1/2 step the torch optimizer once per parameter group)
        steps = sorted({step for step, _ in value["used"]})
        assert steps == list(range(first_step, len(expected) + 1)), value["used"]
        for step, groups in value["used"]:
            assert groups == [expected[step - 1]] * len(groups), (step, groups, expected[step - 1])


def test_cosine_warmup_every_step_and_after_lengthening_the_run(setup):
    args, results = setup
    optimizer = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "lr_schedule": "cosine"}
    six, eight = _expected(args, 6, optimizer), _expected(args, 8, optimizer)
    assert six[:2] == [5e-4, 1e-3]
    _check(results, "cosine_6", six)
    assert assert_check(results, "cosine_resumed_to_8")[0]["start"] == 6
    _check(results, "cosine_resumed_to_8", eight, first_step=7)  # the NEW schedule's rates: still decaying
    assert eight[5] > eight[6] > eight[7] == pytest.approx(1e-4)
    logged = dict(read_scalars(assert_check(results, "cosine_6")[0]["tensorboard"])["train/lr"])
    expected = {**dict(enumerate(six, 1)), 7: eight[6], 8: eight[7]}
    assert sorted(logged) == list(range(1, 9))
    for step, lr in logged.items():  # TensorBoard stores float32
        assert lr == pytest.approx(expected[step], rel=1e-6), step


@pytest.mark.parametrize("name,steps,optimizer", [
    ("zero_warmup_pp2", 3, {"warmup_steps": 0, "lr_schedule": "cosine"}),
    ("linear_zero3", 3, {"warmup_steps": 1, "lr_schedule": "linear"}),
    ("constant_zero0", 3, {"warmup_steps": 2, "lr_schedule": "constant"}),
])
def test_layouts_run_at_the_schedule_from_step_1(setup, name, steps, optimizer):
    args, results = setup
    expected = _expected(args, steps, optimizer)
    if optimizer["warmup_steps"] <= 1:
        assert expected[0] == 3e-3  # the peak of tiny_run_config, not 0
    _check(results, name, expected)


def test_warmup_stable_decay_runs_its_plateau_and_decay(setup):
    args, results = setup
    optimizer = {"warmup_steps": 1, "lr_schedule": "wsd", "wsd_decay_steps": 3, "wsd_decay_shape": "sqrt"}
    expected = _expected(args, 6, optimizer)
    lr, floor = expected[0], expected[-1]
    assert expected[:3] == [lr] * 3 and lr > expected[3] > expected[4] > floor  # plateau 1..3, decay 4..6
    _check(results, "wsd_sqrt", expected)
