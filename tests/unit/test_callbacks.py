"""Trainer callbacks on a stand-in trainer (the hook order of a real Trainer is checked in
tests/distributed/test_training.py)."""

import hashlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ascender_dist.training.callbacks import (Callback, DataDigest, MetricLogging, PerSequenceValidationLosses,
                                              SkippedShards, Throughput, ValidationCurve, console_line_due,
                                              overrides)
from ascender_dist.training.rollback import DivergenceError


class FakeMetrics:
    def __init__(self):
        self.scalars_calls, self.lines, self.flushed, self.closed = [], [], 0, 0

    def scalars(self, step, values):
        self.scalars_calls.append((step, dict(values)))

    def line(self, step, total, values):
        self.lines.append((step, total, dict(values)))

    def flush(self):
        self.flushed += 1

    def close(self):
        self.closed += 1


def test_overrides_tells_a_defined_hook_from_the_base_one():
    assert overrides(DataDigest(), "on_batch") and not overrides(DataDigest(), "on_step_end")
    assert not overrides(Callback(), "on_batch")


def test_throughput_adds_rates_from_the_measured_seconds(monkeypatch):
    clock = iter([10.0, 12.5])
    monkeypatch.setattr("ascender_dist.training.callbacks.time.perf_counter", lambda: next(clock))
    cb = Throughput(tokens_per_step=1000, flops_per_token=6e9, world_size=2, peak_tflops=1.0)
    values = {"train/loss": 3.0}
    cb.on_step_start(None)
    cb.on_step_end(None, values)
    assert cb.step_times == [2.5]
    assert values["train/step_time_s"] == 2.5 and values["train/tokens_per_s"] == 400.0
    achieved = 6e9 * 400.0 / 2 / 1e12  # FLOPs/token x tokens/s per device, in TFLOP/s
    assert values["train/tflops_per_device"] == pytest.approx(achieved) and values["train/mfu"] == pytest.approx(achieved)


def test_metric_logging_lines_on_the_interval_and_the_last_step():
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=5, train_steps=7)
    for step in range(1, 8):
        trainer = SimpleNamespace(step=step, rollbacks=0)
        values = {"train/loss": float(step), "ascender/layer1/omega": 1.0}
        cb.on_step_end(trainer, values)
        cb.on_log(trainer, values)
    assert [s for s, _ in metrics.scalars_calls] == list(range(1, 8))
    assert [s for s, _, _ in metrics.lines] == [5, 7]
    assert all("ascender/layer1/omega" not in v for _, _, v in metrics.lines)  # per-layer: TensorBoard only
    cb.on_rollback(SimpleNamespace(step=4, rollbacks=1))
    assert metrics.scalars_calls[-1] == (4, {"train/rollbacks": 1.0})
    cb.on_train_end(SimpleNamespace(step=7))
    assert metrics.closed == 1


def test_metric_logging_keeps_the_sinks_open_across_a_stopped_fit():
    """fit(stop_at=...) then fit() on one trainer: the first fit's end must not finish the W&B run
    (a finished run refuses every later log) nor close TensorBoard's writer."""
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=5, train_steps=7)
    cb.on_train_end(SimpleNamespace(step=3))
    assert (metrics.closed, metrics.flushed) == (0, 1)
    cb.on_train_end(SimpleNamespace(step=7))
    assert metrics.closed == 1


def test_metric_logging_writes_the_losses_that_ended_a_diverged_run():
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=1, train_steps=9)
    trainer = SimpleNamespace(step=3)
    cb.on_step_end(trainer, {"train/loss": float("nan")})
    cb.on_exception(trainer, DivergenceError("step 3"))
    assert metrics.scalars_calls[0][0] == 3 and metrics.flushed == 1
    other = FakeMetrics()
    cb = MetricLogging(other, log_interval=1, train_steps=9)
    cb.on_step_end(trainer, {"train/loss": 1.0})
    cb.on_exception(trainer, KeyboardInterrupt())
    assert other.scalars_calls == [] and other.flushed == 1


def test_metric_logging_writes_the_step_that_set_off_a_rollback_at_its_own_step():
    """The Trainer logs nothing of the step after which it rolls back (on_log is not called): its
    losses, which explain the rollback, go to TensorBoard at that step under rollback/ (the re-run
    logs that step's train/ scalars again), then the rollback count at the step the run went back to."""
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=1, train_steps=9)
    bad = {"train/loss": float("inf"), "train/step_skipped": 1.0}
    cb.on_step_end(SimpleNamespace(step=6), bad)
    cb.on_rollback(SimpleNamespace(step=4, rollbacks=1))
    assert metrics.scalars_calls == [(6, {"rollback/train/loss": float("inf"), "rollback/train/step_skipped": 1.0}),
                                     (4, {"train/rollbacks": 1.0})]
    cb.on_exception(SimpleNamespace(step=4), DivergenceError("later"))  # written once, not again
    assert len(metrics.scalars_calls) == 2


@pytest.mark.parametrize("step, due", [(1, False), (5, True), (6, False), (7, True), (10, True)])
def test_console_lines_fall_on_the_interval_and_the_last_step(step, due):
    assert console_line_due(step, log_interval=5, train_steps=7) is due


class Logits(nn.Module):
    """Stands in for GPTModel: logits [b, s, v] that favour token (input + 1) % v."""

    def forward(self, inputs):
        return 4.0 * nn.functional.one_hot((inputs + 1) % 5, 5).double()


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.vocab_size = Logits(), 5

    def forward(self, tokens):  # tokens [b, s+1]
        return self.model(tokens[:, :-1])


def test_per_sequence_validation_losses_cover_one_pass_and_unhook(monkeypatch):
    def reference(logits, labels, vocab_size):  # float64 cross entropy per token, [b, s]
        return nn.functional.cross_entropy(logits[..., :vocab_size].transpose(1, 2), labels, reduction="none")

    def in_place_like_megatron(logits, labels, vocab_size):  # and overwrites its input, as megatron's does
        losses = reference(logits, labels, vocab_size)
        logits.zero_()
        return losses

    monkeypatch.setattr("ascender_dist.models.build.vocab_cross_entropy", in_place_like_megatron)
    module = LanguageModel()
    trainer = SimpleNamespace(engine=SimpleNamespace(module=module))
    cb = PerSequenceValidationLosses()
    module(torch.tensor([[0, 1, 2]]))  # before validation: not collected
    cb.on_validation_start(trainer)
    one_hot = 4.0 * torch.eye(5, dtype=torch.float64)[None, :1]  # logits [1, 1, 5] favouring id 0
    hit, miss = (reference(one_hot, torch.tensor([[label]]), 5).item() for label in (0, 1))
    batch = torch.tensor([[0, 1, 2], [0, 3, 2]])  # sequence 1: both predicted; sequence 2: none
    assert torch.equal(module(batch), Logits()(batch[:, :-1]))  # the run's own loss reads intact logits
    module(torch.tensor([[4, 0, 0]]))  # first predicted, second not
    cb.on_validation_end(trainer, 0.0)
    module(torch.tensor([[0, 1, 2]]))  # after: not collected
    assert cb.losses == pytest.approx([hit, miss, (hit + miss) / 2])
    assert cb._hooks == [] and not module._forward_pre_hooks and not module.model._forward_hooks
    cb.on_validation_start(trainer)  # a new pass starts a new list
    module(torch.tensor([[1, 2, 3]]))
    cb.on_validation_end(trainer, 0.0)
    assert cb.losses == pytest.approx([hit])


def test_validation_curve_every_n_steps():
    calls = []
    trainer = SimpleNamespace(step=0, validate=lambda: calls.append(trainer.step) or 1.0 / trainer.step)
    cb = ValidationCurve(every=3)
    for step in range(1, 8):
        trainer.step = step
        cb.on_step_end(trainer, {})
    assert cb.curve == [(3, 1 / 3), (6, 1 / 6)] and calls == [3, 6]
    with pytest.raises(ValueError, match="every must be >= 1"):
        ValidationCurve(0)


def test_data_digest_is_the_sha256_of_the_token_bytes_in_order():
    a = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    b = torch.arange(6, 12, dtype=torch.int64).reshape(2, 3)
    cb = DataDigest()
    for item in ({"tokens": a}, {"tokens": b}):
        cb.on_batch(None, item)
    assert cb.hexdigest() == hashlib.sha256(a.numpy().tobytes() + b.numpy().tobytes()).hexdigest()
    swapped = DataDigest()
    for item in ({"tokens": b}, {"tokens": a}):
        swapped.on_batch(None, item)
    assert swapped.hexdigest() != cb.hexdigest()


def test_the_console_line_averages_the_steps_since_the_last_line():
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=3, train_steps=3)
    # two plain steps of 1 s, then the logged step that also gathered layer statistics (4 s)
    for step, (loss, seconds) in enumerate([(3.0, 1.0), (2.0, 1.0), (1.0, 4.0)], start=1):
        trainer = SimpleNamespace(step=step, rollbacks=0)
        values = {"train/loss": loss, "train/step_time_s": seconds, "train/tokens_per_s": 600 / seconds,
                  "train/mfu": 0.6 / seconds}
        cb.on_step_end(trainer, values)
        cb.on_log(trainer, values)
    assert [v["train/loss"] for _, v in metrics.scalars_calls] == [3.0, 2.0, 1.0]  # TensorBoard: each step's own
    (_, _, line), = metrics.lines
    assert line["train/loss"] == pytest.approx(2.0)
    assert line["train/step_time_s"] == pytest.approx(2.0)
    assert line["train/tokens_per_s"] == pytest.approx(300.0)  # 1800 tokens in 6 s, not the last step's 150
    assert line["train/mfu"] == pytest.approx(0.3)


def test_throughput_reads_its_clock_before_the_layer_statistics_gather():
    from ascender_dist.training.callbacks import LayerStats, default_callbacks

    cfg = SimpleNamespace(logging=SimpleNamespace(log_interval=1),
                          train=SimpleNamespace(global_batch_size=2, train_steps=3), model=SimpleNamespace(seq_length=8))
    callbacks = default_callbacks(cfg, 4, FakeMetrics(), 1.0, None)
    kinds = [type(c) for c in callbacks]
    assert kinds.index(Throughput) < kinds.index(LayerStats) < kinds.index(MetricLogging)
    assert SkippedShards in kinds
    throughput = callbacks[kinds.index(Throughput)]
    # the whole job's tokens per optimizer step (global batch x sequence), not a rank's share: tokens/s,
    # TFLOPs per device and MFU all scale with it
    assert throughput.tokens_per_step == 2 * 8 and throughput.world_size == 4


def test_skipped_shards_counts_each_shard_once_and_keeps_them_through_a_checkpoint():
    """One process (no pooling collective): the count is the shards' names, not skip events, and
    the checkpoint's names are added to, not replaced (a rollback keeps what the abandoned steps met)."""
    loader = SimpleNamespace(skipped_shard_names=frozenset({"a.tar"}))
    trainer = SimpleNamespace(step=1, loader=loader)
    cb = SkippedShards(log_interval=2, train_steps=4)
    values = {}
    cb.on_step_end(trainer, values)
    assert values["data/skipped_shards"] == 1.0 and cb.names == set()  # step 1: no console line, not pooled
    trainer.step = 2
    cb.on_step_end(trainer, values)
    assert values["data/skipped_shards"] == 1.0 and cb.names == {"a.tar"}
    assert cb.state_dict(trainer) == {"names": ["a.tar"]}

    fresh = SkippedShards(log_interval=2, train_steps=4)
    trainer = SimpleNamespace(step=3, loader=SimpleNamespace(skipped_shard_names=frozenset({"b.tar"})))
    fresh.load_state_dict(trainer, {"names": ["a.tar"]})
    fresh.on_step_end(trainer, values)
    assert values["data/skipped_shards"] == 2.0
    trainer.step = 4
    fresh.on_step_end(trainer, values)
    assert fresh.names == {"a.tar", "b.tar"} and fresh.state_dict(trainer) == {"names": ["a.tar", "b.tar"]}


def test_the_console_average_leaves_out_skipped_and_rolled_back_steps():
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=3, train_steps=6)
    steps = [(1, 3.0, 0.0), (2, float("nan"), 1.0), (3, 2.0, 0.0)]  # step 2 skipped: its NaN stays out
    for step, loss, skipped in steps:
        values = {"train/loss": loss, "train/step_skipped": skipped}
        cb.on_log(SimpleNamespace(step=step, rollbacks=0), values)
    assert metrics.lines[-1][2]["train/loss"] == pytest.approx(2.5)
    cb.on_log(SimpleNamespace(step=4, rollbacks=0), {"train/loss": 100.0, "train/step_skipped": 0.0})
    cb.on_rollback(SimpleNamespace(step=3, rollbacks=1))  # steps 4.. are redone: the 100 is not the run's
    for step in (4, 5, 6):
        cb.on_log(SimpleNamespace(step=step, rollbacks=1), {"train/loss": 1.0, "train/step_skipped": 0.0})
    assert metrics.lines[-1][0] == 6 and metrics.lines[-1][2]["train/loss"] == pytest.approx(1.0)


def test_a_skipped_line_step_shows_its_own_values_and_the_interval_counts_its_time():
    """The line's own step skipped: the line still shows that step's lr, skipped count and
    validation loss (not the previous step's, without the val loss), the loss of the steps that
    were not skipped, and tokens/s over the time of both steps."""
    metrics = FakeMetrics()
    cb = MetricLogging(metrics, log_interval=2, train_steps=10)
    first = {"train/loss": 3.0, "train/lr": 1e-3, "train/skipped_steps": 0.0, "train/step_skipped": 0.0,
             "train/step_time_s": 1.0, "train/tokens_per_s": 100.0}
    second = {"train/loss": float("nan"), "train/lr": 2e-3, "train/skipped_steps": 1.0, "train/step_skipped": 1.0,
              "train/step_time_s": 3.0, "train/tokens_per_s": 100 / 3, "val/loss": 3.5}
    for step, values in ((1, first), (2, second)):
        cb.on_log(SimpleNamespace(step=step, rollbacks=0), values)
    (step, _, line), = metrics.lines
    assert step == 2
    assert line["train/loss"] == pytest.approx(3.0)  # the NaN of the skipped step stays out
    assert line["train/lr"] == 2e-3 and line["train/skipped_steps"] == 1.0 and line["val/loss"] == 3.5
    assert line["train/tokens_per_s"] == pytest.approx(50.0)  # 200 tokens in 4 s


def test_layer_statistics_are_collected_for_the_last_steps_console_line_too():
    """The last step prints a console line whatever log_interval is; its statistics were missing
    when train_steps was not a multiple of it (found by a review)."""
    from ascender_dist.training.callbacks import LayerStats

    layer = nn.Linear(1, 1)
    layer.collect_stats, layer.last_stats = False, {}
    trainer = SimpleNamespace(step=0, engine=SimpleNamespace(module=nn.Sequential(layer)))
    cb = LayerStats(log_interval=4, train_steps=6)
    collected = []
    for step in range(6):
        trainer.step = step  # the steps done so far: on_step_start prepares step + 1
        cb.on_step_start(trainer)
        collected.append(layer.collect_stats)
    assert [s + 1 for s, on in enumerate(collected) if on] == [4, 6]
