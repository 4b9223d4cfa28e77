"""Trainer callbacks: what a run measures and records, separate from the loop that trains.

The Trainer calls every callback, in list order, at these points (names as in Lightning and
OLMo-core), so a new measurement is a new callback instead of a patch of the Trainer:

  on_train_start(trainer)                 before the first step of ``fit``
  on_batch(trainer, item)                 each loader item the training loop reads (micro-batches)
  on_step_start(trainer)                  before each optimizer step (``trainer.step`` is the last done)
  on_step_end(trainer, values)            after it (``trainer.step`` counts it); add scalars to ``values``
  on_validation_start(trainer)            before each validation pass
  on_validation_end(trainer, loss)        after it, with the mean loss
  on_log(trainer, values)                 the step's scalars, complete (validation included), or a
                                          validation alone ({"val/loss"}) that a stop left due
  on_rollback(trainer)                    after a rollback to an earlier checkpoint
  on_save(trainer, tag)                   after a checkpoint is complete on every rank
  on_load(trainer, tag)                   after a checkpoint is loaded (a resume, or a rollback)
  on_progress(trainer, what)              long work between two hooks advanced (a rollback target's
                                          universal conversion wrote more): not in step across ranks,
                                          on rank 0 from a helper thread; no collectives, no trainer state
  on_exception(trainer, error)            the run stops with ``error`` (re-raised afterwards)
  on_train_end(trainer)                   ``fit`` finished (after its last save)

Every rank runs every callback: a callback that gathers over ranks may (in any hook but
``on_progress``); one that writes files checks ``trainer.pstate.is_logging_rank``. The default list of a run is :func:`default_callbacks`.

A callback with a ``state_key`` keeps state in the checkpoint (as Lightning's callback state): the
Trainer saves ``state_dict(trainer)`` under that key before each save (every rank calls it: it may
gather) and hands it to ``load_state_dict(trainer, state)`` when it loads the checkpoint (a resume,
a rollback).
"""

from __future__ import annotations

import hashlib
import time
from typing import Optional


class Callback:
    """Base class: every hook does nothing; override the ones you need."""

    state_key: Optional[str] = None  # set (unique per run) to keep state_dict() in the checkpoint

    def state_dict(self, trainer) -> dict:
        """What the checkpoint keeps of this callback (with a ``state_key``); collective allowed."""
        return {}

    def load_state_dict(self, trainer, state: dict) -> None:
        """Take back what ``state_dict`` returned, from the checkpoint just loaded."""

    def on_train_start(self, trainer) -> None:
        pass

    def on_batch(self, trainer, item) -> None:
        pass

    def on_step_start(self, trainer) -> None:
        pass

    def on_step_end(self, trainer, values: dict) -> None:
        pass

    def on_validation_start(self, trainer) -> None:
        pass

    def on_validation_end(self, trainer, loss: float) -> None:
        pass

    def on_log(self, trainer, values: dict) -> None:
        pass

    def on_rollback(self, trainer) -> None:
        pass

    def on_save(self, trainer, tag: str) -> None:
        pass

    def on_load(self, trainer, tag: str) -> None:
        """A checkpoint was loaded into the engine (a resume, or a rollback before its save)."""

    def on_progress(self, trainer, what: str) -> None:
        """Long work between two other hooks advanced (``what`` says which and how far): a rollback
        target's universal conversion wrote more. May be called from a helper thread: keep it short
        and touch no trainer state."""

    def on_exception(self, trainer, error: BaseException) -> None:
        pass

    def on_train_end(self, trainer) -> None:
        pass


def console_line_due(step: int, log_interval: int, train_steps: int) -> bool:
    """Whether step ``step`` prints a console line: every ``log_interval``-th and the run's last."""
    return step % log_interval == 0 or step == train_steps


def overrides(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` defines ``hook`` itself (so the Trainer skips per-item hooks nobody uses)."""
    return getattr(type(callback), hook) is not getattr(Callback, hook)


class LayerStats(Callback):
    """Per-layer statistics (ASCender omegas, Connection steps; see :mod:`.layer_stats`) on the steps
    that print a console line (every ``log_interval``-th and the last): switched on before the step
    (every micro-batch contributes), gathered over TP / PP and reduced over the data-parallel
    replicas after it."""

    def __init__(self, log_interval: int, train_steps: int = 0):
        self.log_interval = log_interval
        self.train_steps = train_steps
        self.collecting = False

    def on_step_start(self, trainer) -> None:
        from ascender_dist.training.layer_stats import set_collect_stats

        step = trainer.step + 1
        self.collecting = console_line_due(step, self.log_interval, self.train_steps)
        set_collect_stats(trainer.engine.module, self.collecting)

    def on_step_end(self, trainer, values: dict) -> None:
        from megatron.core import parallel_state as mps

        from ascender_dist.training.layer_stats import gather_layer_stats, set_collect_stats

        set_collect_stats(trainer.engine.module, False)
        if self.collecting:
            values.update(gather_layer_stats(trainer.engine.module, mps.get_tensor_model_parallel_group(),
                                             mps.get_pipeline_model_parallel_group(), mps.get_data_parallel_group()))


class SkippedShards(Callback):
    """``data/skipped_shards``: the corrupt shards the run has skipped (``data.on_corrupt: skip``),
    each counted once however many ranks met it and kept in the checkpoint, so the count goes on
    across restarts and rollbacks (a shard found bad mid-run is found again only if read again).

    Data-parallel ranks read different shards, so each rank's own finds are pooled over every
    rank: on the steps that print a console line and before each save, one all-reduce asks whether
    any rank has met a shard the pool lacks, and only then are the names gathered. Between those
    steps the value is this rank's view (the pool plus its own finds since)."""

    state_key = "skipped_shards"

    def __init__(self, log_interval: int, train_steps: int):
        self.log_interval = log_interval
        self.train_steps = train_steps
        self.names: set[str] = set()  # the pool: every rank's skipped shards, as of the last pooling

    def _pool(self, trainer) -> None:
        """Collective when distributed: add every rank's new finds to the pool."""
        import torch.distributed as dist

        from ascender_dist.training.guard import any_rank

        new = sorted(trainer.loader.skipped_shard_names - self.names)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            self.names.update(new)
            return
        if any_rank(bool(new)):
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, new)
            for names in gathered:
                self.names.update(names)

    def on_step_end(self, trainer, values: dict) -> None:
        if console_line_due(trainer.step, self.log_interval, self.train_steps):
            self._pool(trainer)
        values["data/skipped_shards"] = float(len(self.names | trainer.loader.skipped_shard_names))

    def state_dict(self, trainer) -> dict:
        self._pool(trainer)
        return {"names": sorted(self.names)}

    def load_state_dict(self, trainer, state: dict) -> None:
        self.names.update(state.get("names", ()))  # a rollback keeps what the abandoned steps met


class Throughput(Callback):
    """``train/tokens_per_s``, ``train/step_time_s`` (wall clock of the optimizer step),
    ``train/tflops_per_device`` and ``train/mfu`` (see :func:`.metrics.throughput`); keeps every step's
    seconds in ``step_times``."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, world_size: int, peak_tflops):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.step_times: list[float] = []
        self._start = 0.0

    def on_step_start(self, trainer) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, trainer, values: dict) -> None:
        from ascender_dist.training.metrics import throughput

        elapsed = time.perf_counter() - self._start
        self.step_times.append(elapsed)
        values["train/tokens_per_s"] = self.tokens_per_step / elapsed
        values["train/step_time_s"] = elapsed
        values.update(throughput(self.flops_per_token, values["train/tokens_per_s"], self.world_size,
                                 self.peak_tflops))


ROLLBACK_PREFIX = "rollback/"  # the scalars of the step that set off a rollback (MetricLogging.on_rollback)


class MetricLogging(Callback):
    """Scalars to TensorBoard / Weights & Biases (every step) and the console line (every
    ``log_interval`` steps), through a :class:`.metrics.MetricLogger` (which writes only on the
    logging rank). The console line averages over the steps since the previous line, as Megatron's
    does: the loss over those steps, the rates from their total time (the line's own step also
    gathers the layer statistics, so its rate alone would understate the run's)."""

    def __init__(self, metrics, log_interval: int, train_steps: int):
        self.metrics = metrics
        self.log_interval = log_interval
        self.train_steps = train_steps
        self._pending: Optional[tuple[int, dict]] = None  # (step, its scalars) until they are logged
        self._interval: list[dict] = []  # the steps' scalars since the last console line

    def on_step_end(self, trainer, values: dict) -> None:
        self._pending = (trainer.step, values)

    def _write_pending(self, prefix: str = "") -> None:
        """The scalars of a step that ``on_log`` will not see (the step that set off a rollback, or
        the one that ended a diverged run), at that step, each tag after ``prefix``: the losses that
        explain the event."""
        if self._pending is not None:
            step, values = self._pending
            self.metrics.scalars(step, {prefix + name: value for name, value in values.items()})
            self._pending = None

    def on_log(self, trainer, values: dict) -> None:
        self._pending = None
        self.metrics.scalars(trainer.step, values)
        if "train/loss" not in values:  # a validation alone (due after a stop): its own line
            self.metrics.line(trainer.step, self.train_steps, values)
            return
        self._interval.append(values)
        if console_line_due(trainer.step, self.log_interval, self.train_steps):
            line = interval_averages(self._interval)
            self._interval = []
            self.metrics.line(trainer.step, self.train_steps, {k: v for k, v in line.items() if "/layer" not in k})

    def on_train_start(self, trainer) -> None:
        self._interval = []  # a later fit of the same trainer (fit(stop_at=...) then fit()) starts a new line

    def on_save(self, trainer, tag: str) -> None:
        # what was logged up to a checkpoint is on disk with it: a job killed later (the writer
        # flushes every 2 minutes) loses no step that the resumed job will not log again
        self.metrics.flush()

    def on_rollback(self, trainer) -> None:
        # under rollback/ (rollback/train/loss, ...): the resume's new event file hides what the rolled-back
        # steps logged, and the re-run logs this step's train/ scalars again; written there they were
        # a second point at this step (a zig-zag) while the row's earlier bad steps were hidden
        self._write_pending(prefix=ROLLBACK_PREFIX)
        self._interval = []  # the steps rolled back are not the run's any more
        self.metrics.scalars(trainer.step, {"train/rollbacks": float(trainer.rollbacks)})

    def on_exception(self, trainer, error: BaseException) -> None:
        from ascender_dist.training.rollback import DivergenceError

        if isinstance(error, DivergenceError):
            self._write_pending()
        self.metrics.flush()

    def on_train_end(self, trainer) -> None:
        """Close the sinks once the run is over; a fit stopped early (``stop_at``) only flushes
        them, since the next fit of the same trainer logs on (a finished W&B run refuses it)."""
        if trainer.step >= self.train_steps:
            self.metrics.close()
        else:
            self.metrics.flush()


def interval_averages(steps: list[dict]) -> dict:
    """The last step's scalars (its lr, skipped-step count, validation loss ...) with the loss
    averaged over the steps of ``steps`` that were not skipped (as Megatron: a skipped step's loss,
    often non-finite, stays out; the last step's own when all were skipped) and the rates (tokens/s,
    TFLOP/s, MFU, step time) taken over the total time of all of them, skipped ones included (their
    time was spent): tokens/s = tokens of all steps / their seconds."""
    last = dict(steps[-1])
    losses = [v["train/loss"] for v in steps if v.get("train/loss") is not None and not v.get("train/step_skipped")]
    if losses:
        last["train/loss"] = sum(losses) / len(losses)
    times = [v.get("train/step_time_s") for v in steps]
    if len(steps) > 1 and all(t is not None for t in times) and last.get("train/tokens_per_s"):
        mean_time = sum(times) / len(times)
        scale = last["train/step_time_s"] / mean_time  # rate of the interval / rate of the last step
        last["train/step_time_s"] = mean_time
        for key in ("train/tokens_per_s", "train/tflops_per_device", "train/mfu"):
            if last.get(key) is not None:
                last[key] *= scale
    return last


class PerSequenceValidationLosses(Callback):
    """The loss of every validation sequence of the latest validation pass (``losses``, in loader
    order on this rank): the same per-token cross entropy as the run's loss (over the tokenizer's
    ids, :func:`~ascender_dist.models.build.vocab_cross_entropy`), averaged over each sequence.
    Reads the tokens going into the engine's module and the logits its GPTModel returns (PP=1)."""

    def __init__(self):
        self.losses: list[float] = []
        self._hooks = []
        self._tokens = None

    def on_validation_start(self, trainer) -> None:
        self.losses = []
        language_model = trainer.engine.module  # forward(tokens [b, s+1]) -> mean loss
        self._hooks = [language_model.register_forward_pre_hook(self._keep_tokens),
                       language_model.model.register_forward_hook(self._sequence_losses(language_model.vocab_size))]

    def _keep_tokens(self, module, args) -> None:
        self._tokens = args[0]

    def _sequence_losses(self, vocab_size: int):
        def hook(module, args, logits) -> None:  # logits [b, s, v/tp]
            from ascender_dist.models.build import vocab_cross_entropy

            labels = self._tokens[:, 1:]  # [b, s]
            # a copy: megatron's cross entropy works in place on the logits the run's own loss reads next
            per_token = vocab_cross_entropy(logits.detach().clone(), labels, vocab_size)  # [b, s]
            self.losses.extend(per_token.float().mean(dim=1).cpu().tolist())
        return hook

    def on_validation_end(self, trainer, loss: float) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._tokens = [], None

    def on_exception(self, trainer, error: BaseException) -> None:
        self.on_validation_end(trainer, float("nan"))


class ValidationCurve(Callback):
    """Validate every ``every`` steps (independently of ``train.eval_interval``) and keep
    ``(step, loss)`` in ``curve``; the same validation batches each time."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"ValidationCurve: every must be >= 1 (got {every})")
        self.every = every
        self.curve: list[tuple[int, float]] = []

    def on_step_end(self, trainer, values: dict) -> None:
        if trainer.step % self.every == 0:
            self.curve.append((trainer.step, trainer.validate()))


class DataDigest(Callback):
    """SHA-256 over the token bytes of every training item read, in order: two runs with equal
    digests saw the same data."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def on_batch(self, trainer, item) -> None:
        if isinstance(item, dict):
            self.digest.update(item["tokens"].numpy().tobytes())

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def default_callbacks(cfg, world_size: int, metrics, flops_per_token: float,
                      peak_tflops: Optional[float]) -> list[Callback]:
    """A run's measurements, in the order they add scalars: throughput first (its clock stops before
    the layer statistics' collectives), layer statistics, logging."""
    return [
        Throughput(cfg.train.global_batch_size * cfg.model.seq_length, flops_per_token, world_size, peak_tflops),
        LayerStats(cfg.logging.log_interval, cfg.train.train_steps),
        SkippedShards(cfg.logging.log_interval, cfg.train.train_steps),
        MetricLogging(metrics, cfg.logging.log_interval, cfg.train.train_steps),
    ]
