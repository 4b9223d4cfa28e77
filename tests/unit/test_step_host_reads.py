"""The bad-step guard judges a step's micro-batch losses from one host read, after the step's last
forward: a read per micro-batch (``loss.item()``) stalls a GPU once per micro-batch while the host
waits for the loss, which at 64 micro-batches per step (the scaling configs) starves the device."""

from __future__ import annotations

import pytest

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

ACCUMULATION = 4


def test_the_guard_reads_a_steps_losses_once_after_its_last_forward(single_rank_group, tmp_path):
    from ascender_dist.training.trainer import Trainer

    data = make_tiny_dataset(tmp_path / "data", corpus_bytes=60_000)
    cfg = config_from_dict(tiny_run_config(data, tmp_path / "run", train={
        "micro_batch_size": 2, "global_batch_size": 2 * ACCUMULATION, "train_steps": 2}))
    trainer = Trainer(cfg)
    assert trainer.derived.gradient_accumulation_steps == ACCUMULATION
    forwards, judged = [], []
    trainer.engine.module.register_forward_hook(lambda *_: forwards.append(1))
    judge = trainer.guard.is_bad

    def recording(loss: float) -> bool:
        judged.append((len(forwards), loss))
        return judge(loss)

    trainer.guard.is_bad = recording
    trainer.fit()
    # every micro-batch judged, each step's four only once its fourth forward ran
    assert [f for f, _ in judged] == [ACCUMULATION] * ACCUMULATION + [2 * ACCUMULATION] * ACCUMULATION
    for step, loss in enumerate(trainer.losses):
        micro = [x for _, x in judged[step * ACCUMULATION:(step + 1) * ACCUMULATION]]
        assert loss == pytest.approx(sum(micro) / ACCUMULATION, rel=1e-6)
