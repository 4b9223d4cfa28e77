"""The training loop: data -> DeepSpeed engine -> metrics -> checkpoints.

Order of set-up (each a separate step): process group, megatron model-parallel groups and seeds
(:mod:`ascender_dist.parallel.setup`), data loader (sharded by data-parallel rank), engine
(:mod:`ascender_dist.training.engine`), resume from the latest complete checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ascender_dist.config.loader import to_dict
from ascender_dist.config.resolve import Derived, derive
from ascender_dist.config.schema import RunConfig
from ascender_dist.parallel.setup import ParallelState, init_model_parallel, init_process_group
from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.engine import build_engine, pipeline_batches
from ascender_dist.training.guard import LossGuard, any_rank, poison
from ascender_dist.training.layer_stats import gather_layer_stats, set_collect_stats, set_training_step
from ascender_dist.training.lr_schedule import lr_at, set_lr
from ascender_dist.models.ascender.common import set_aux_loss_scale
from ascender_dist.models.counting import count_model
from ascender_dist.training.metrics import MetricLogger, peak_tflops_per_device, throughput
from ascender_dist.training.resume_check import check_resume, data_fingerprint
from ascender_dist.training.rollback import DivergenceError, RollbackPolicy
from ascender_dist.training.weights import pad_vocab, read_weights_file

log = logging.getLogger("ascender_dist")


def _tokenizer(cfg: RunConfig):
    from data_pipeline.tokenizer import Tokenizer

    return Tokenizer.load(Path(cfg.data.tokenizer)) if cfg.data.tokenizer else None


def build_loader(cfg: RunConfig, tokenizer, pstate: ParallelState, split: str = "train"):
    """Sharded by DATA-parallel rank: tensor/pipeline peers of one replica read identical batches."""
    from data_pipeline.loader import StreamingLoader

    d = cfg.data
    source = [(m.manifest, m.weight) for m in d.mixture] if d.mixture else d.manifest
    return StreamingLoader(
        source,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=pstate.dp_rank,
        dp_size=pstate.dp_size,
        seed=cfg.train.seed,
        split=split,
        num_workers=d.num_workers,
        shuffle_buffer=d.shuffle_buffer,
        url_template=d.url_template,
        tokenizer_sha256=tokenizer.sha256 if tokenizer else None,
        vocab_size=tokenizer.vocab_size if tokenizer else cfg.model.vocab_size,
        on_corrupt=d.on_corrupt,
    )


def _mean_over(group, value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def aux_loss_gradient_scale(gradient_accumulation_steps: int, tensor_parallel: int) -> float:
    """Gradient of ASCender's auxiliary losses relative to a task loss of 1: DeepSpeed divides the
    task loss of every micro-batch by the accumulation steps, and each tensor-parallel rank's aux
    loss is a mean over its own heads only, so summed over TP ranks it would count tp times
    (measured: 2x at TP=2 before this scale; tests/distributed/test_model_parity.py)."""
    return 1.0 / (gradient_accumulation_steps * tensor_parallel)


class Trainer:
    def __init__(self, cfg: RunConfig, init_state: Optional[dict] = None):
        """``init_state``: canonical full weights to start from (else ``checkpoint.init_from``, else
        random init); ignored when a checkpoint to resume from exists."""
        self.cfg = cfg
        init_process_group(cfg.parallel.distributed_timeout_minutes)
        self.tokenizer = _tokenizer(cfg)
        self.derived: Derived = derive(cfg, dist.get_world_size(),
                                       self.tokenizer.vocab_size if self.tokenizer else None)
        set_aux_loss_scale(aux_loss_gradient_scale(self.derived.gradient_accumulation_steps,
                                                   cfg.parallel.tensor_model_parallel_size))
        p = cfg.parallel
        self.pstate = init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, cfg.train.seed,
                                          p.distributed_timeout_minutes)
        self.loader = build_loader(cfg, self.tokenizer, self.pstate)
        self.val_loader = build_loader(cfg, self.tokenizer, self.pstate, split="val") if cfg.train.eval_interval else None
        ckpt.prepare_checkpoint_dir(self.derived.checkpoint_dir)
        resuming = cfg.checkpoint.auto_resume and ckpt.latest_tag(self.derived.checkpoint_dir) is not None
        if init_state is None and cfg.checkpoint.init_from and not resuming:
            init_state = read_weights_file(cfg.checkpoint.init_from)
        if init_state is not None:
            init_state = pad_vocab(init_state, self.derived.padded_vocab_size)
        self.guard = LossGuard(spike_factor=cfg.train.loss_spike_factor,
                               initial_loss=math.log(self.derived.vocab_size))
        self.rollback_policy = RollbackPolicy(cfg.train.max_rollbacks)
        self.resume_tag = self._resume_tag_for_this_layout() if resuming else None
        universal = self.resume_tag is not None and self.resume_tag.endswith("-universal")
        self.engine = build_engine(cfg, self.derived, init_state, self.guard, load_universal=universal)
        self.pipelined = p.pipeline_model_parallel_size > 1
        self.step = 0
        self.consecutive_bad = 0
        self.rollbacks = 0
        self.losses: list[float] = []  # per-step training loss (mean over the global batch), for tests
        vocab = cfg.model.vocab_size or (self.tokenizer.vocab_size if self.tokenizer else self.derived.padded_vocab_size)
        self.flops_per_token = count_model(cfg, vocab).flops_per_token
        self.peak_tflops = peak_tflops_per_device(cfg.logging.peak_tflops_per_device)
        self.metrics = MetricLogger(self.derived.tensorboard_dir if cfg.logging.tensorboard else None,
                                    enabled=self.pstate.is_logging_rank, wandb=cfg.logging.wandb,
                                    run_dir=self.derived.output_dir, run_name=cfg.name, run_config=to_dict(cfg))
        self.data_record = {"data_fingerprint": data_fingerprint(cfg), "data_changes": []}  # -> meta.json
        if cfg.checkpoint.auto_resume:
            self.resume()

    # ---------------------------------------------------------------- checkpoints
    def _resume_tag_for_this_layout(self) -> str:
        """The latest tag, or its universal copy when the data-parallel size changed since it was saved
        (tensor and pipeline sizes must match; change those with consolidate + reshard)."""
        directory = self.derived.checkpoint_dir
        tag = ckpt.latest_tag(directory)
        meta = ckpt.read_meta(directory, tag)
        saved_dp = meta.get("data_parallel_size", self.pstate.dp_size)
        if saved_dp == self.pstate.dp_size:
            return tag
        saved = (meta.get("tensor_model_parallel_size"), meta.get("pipeline_model_parallel_size"))
        if saved != (self.pstate.tp_size, self.pstate.pp_size):
            from ascender_dist.config.errors import ConfigError

            raise ConfigError("parallel", f"{directory / tag} was saved at tp x pp = {saved[0]} x {saved[1]}; resuming "
                              f"at {self.pstate.tp_size} x {self.pstate.pp_size} needs `ascender-dist consolidate` "
                              f"then `reshard`")
        if self.pstate.is_logging_rank:
            log.info("data-parallel size changed %d -> %d: resuming through a universal checkpoint",
                     saved_dp, self.pstate.dp_size)
        return ckpt.ensure_universal(directory, tag)

    def resume(self, tag: Optional[str] = None) -> bool:
        tag = tag or self.resume_tag or ckpt.latest_tag(self.derived.checkpoint_dir)
        self.resume_tag = None  # a universal copy is read once; later rollbacks use our own checkpoints
        if tag is not None:  # same model, same data (or a change the config allows), before loading
            self.data_record = check_resume(self.cfg, self.derived.checkpoint_dir, tag, self.pstate.is_logging_rank)
        client_state = ckpt.load_checkpoint(self.engine, self.derived.checkpoint_dir, tag)
        if client_state is None:
            return False
        self.engine._config.load_universal_checkpoint = False
        if "step" not in client_state:  # a universal copy may not carry our client state
            client_state = ckpt.read_meta(self.derived.checkpoint_dir, tag.removesuffix("-universal"))
        self.step = int(client_state["step"])
        self.loader.load_state_dict(client_state["data"])
        if "guard" in client_state:
            self.guard.load_state_dict(client_state["guard"])
        if self.pstate.is_logging_rank:
            log.info("resumed from %s at step %d", self.derived.checkpoint_dir / tag if tag else
                     self.derived.checkpoint_dir / ckpt.tag_for_step(self.step), self.step)
        return True

    def checkpoint_meta(self) -> dict:
        """What a converter needs to read this checkpoint without the run's YAML or launch."""
        from importlib.metadata import version

        p = self.pstate
        return {
            "format": ckpt.FORMAT_VERSION, "step": self.step, "architecture": self.cfg.model.architecture,
            "world_size": p.world_size, "tensor_model_parallel_size": p.tp_size,
            "pipeline_model_parallel_size": p.pp_size, "data_parallel_size": p.dp_size,
            "zero_stage": self.cfg.parallel.zero_stage,
            "vocab_size": self.cfg.model.vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None),
            "padded_vocab_size": self.derived.padded_vocab_size,
            "data": self.loader.state_dict(), **self.data_record,
            "versions": {name: version(name) for name in ("ascender-dist", "megatron-core", "deepspeed", "torch")},
        }

    def save(self) -> str:
        import json

        import yaml

        tag = ckpt.save_checkpoint(
            self.engine, self.derived.checkpoint_dir, self.step,
            client_state={"step": self.step, "data": self.loader.state_dict(), "config": to_dict(self.cfg),
                          "guard": self.guard.state_dict(),
                          "padded_vocab_size": self.derived.padded_vocab_size},
            keep_last=self.cfg.checkpoint.keep_last,
            extra_files={"config.yaml": yaml.safe_dump(to_dict(self.cfg), sort_keys=False),
                         "meta.json": json.dumps(self.checkpoint_meta(), indent=1)},
        )
        self.rollback_policy.saved(self.step)
        if self.pstate.is_logging_rank:
            log.info("saved checkpoint %s", self.derived.checkpoint_dir / tag)
        return tag

    # ---------------------------------------------------------------- steps
    def train_step(self, batches, log_layers: bool = False) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
        from megatron.core import parallel_state as mps

        model = self.engine.module
        set_training_step(model, self.step)
        set_collect_stats(model, log_layers)
        lr = lr_at(self.step + 1, self.cfg.optimizer, self.cfg.train.train_steps)
        set_lr(self.engine.optimizer, lr)  # the rate this step uses and logs (DeepSpeed owns no scheduler)
        skipped_before = self.engine.skipped_steps
        if self.pipelined:  # DeepSpeed's pipeline schedule runs all micro-batches and the step
            step_loss = float(self.engine.train_batch(data_iter=batches))
        else:
            losses, bad = [], False
            accumulation = self.derived.gradient_accumulation_steps
            for micro in range(accumulation):
                tokens = next(batches)["tokens"].to(self.pstate.device)
                loss = self.engine(tokens)
                bad = self.guard.is_bad(loss.item()) or bad
                # the step's fate is decided once, before its last backward, identically on all ranks
                last = micro == accumulation - 1
                self.engine.backward(poison(loss) if last and any_rank(bad) else loss)
                self.engine.step()
                losses.append(loss.detach())
            step_loss = _mean_over(mps.get_data_parallel_group(), torch.stack(losses).mean())
        skipped = self.engine.skipped_steps > skipped_before
        set_collect_stats(model, False)
        grad_norm = self.engine.get_global_grad_norm()
        values = {"train/loss": step_loss, "train/lr": lr,
                  "train/grad_norm": float(grad_norm) if grad_norm is not None and not skipped else None,
                  "train/skipped_steps": float(self.engine.skipped_steps), "train/step_skipped": float(skipped)}
        if log_layers:
            values.update(gather_layer_stats(model, mps.get_tensor_model_parallel_group(),
                                             mps.get_pipeline_model_parallel_group()))
        return values

    @torch.no_grad()
    def validate(self) -> float:
        from megatron.core import parallel_state as mps

        """Mean loss over the first ``eval_iters`` validation batches (the same ones every time)."""
        iters = min(self.cfg.train.eval_iters, len(self.val_loader))
        if iters == 0:
            from data_pipeline.errors import DataError

            raise DataError(self.cfg.data.manifest or "data.mixture",
                            "the validation split has fewer samples than one micro-batch per data-parallel rank")
        batches = iter(self.val_loader)
        if self.pipelined:
            return float(self.engine.eval_batch(pipeline_batches(batches), num_micro_batches=iters))
        self.engine.eval()
        losses = [self.engine(next(batches)["tokens"].to(self.pstate.device)) for _ in range(iters)]
        self.engine.train()
        return _mean_over(mps.get_data_parallel_group(), torch.stack(losses).mean())

    def _after_step(self, values: dict, batches):
        """Bad-step bookkeeping; after ``max_consecutive_bad_steps`` skips, roll back (see
        :mod:`ascender_dist.training.rollback`). Returns the batch iterator to continue with."""
        t = self.cfg.train
        if not values["train/step_skipped"]:
            self.consecutive_bad = 0
            self.guard.accept(values["train/loss"])
            return batches
        self.consecutive_bad += 1
        if self.pstate.is_logging_rank:
            log.warning("step %d skipped on all ranks: loss %.4g (non-finite, or above %s)", self.step,
                        values["train/loss"], self.guard.threshold)
        limit = t.max_consecutive_bad_steps
        if limit and self.consecutive_bad >= limit:
            return self.rollback(values["train/loss"])
        if not limit and self.consecutive_bad >= 10:
            raise DivergenceError(f"step {self.step}: {self.consecutive_bad} bad steps in a row (loss "
                                  f"{values['train/loss']:.4g}); set train.max_consecutive_bad_steps to roll back")
        return batches

    def _complete_checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints, as rank 0 sees them (every rank must load the same one)."""
        steps = [[ckpt.step_of_tag(tag) for tag in ckpt.complete_tags(self.derived.checkpoint_dir)]]
        dist.broadcast_object_list(steps, src=0)
        return steps[0]

    def rollback(self, loss: float):
        """Load an earlier checkpoint (weights, optimizer, step, guard) but keep the data position, so
        the batches that failed are not replayed; or stop the job when the run keeps diverging."""
        bad_step, bad_start = self.step, self.step - self.consecutive_bad + 1
        good = [step for step in self._complete_checkpoint_steps() if step < bad_start]
        target = self.rollback_policy.next_target(bad_step, good)
        if target is None:
            last_good = (f"last good checkpoint {self.derived.checkpoint_dir / ckpt.tag_for_step(good[-1])}"
                         if good else f"no checkpoint from before step {bad_start} to roll back to")
            raise DivergenceError(
                f"step {bad_step}: loss {loss:.4g}, {self.consecutive_bad} bad steps in a row after "
                f"{self.rollback_policy.in_a_row} rollbacks in a row (train.max_rollbacks: "
                f"{self.cfg.train.max_rollbacks}); {last_good}")
        data_state = self.loader.state_dict()
        self.resume(ckpt.tag_for_step(target))
        self.loader.load_state_dict(data_state)
        self.consecutive_bad = 0
        self.rollbacks += 1
        if self.pstate.is_logging_rank:
            log.warning("rolled back from step %d to the checkpoint of step %d (rollback %d in a row of at most "
                        "%d); data continues where it was", bad_step, self.step, self.rollback_policy.in_a_row,
                        self.cfg.train.max_rollbacks)
        return self._batches()

    def _batches(self):
        batches = iter(self.loader)
        return pipeline_batches(batches) if self.pipelined else batches

    def fit(self, stop_at: Optional[int] = None) -> list[float]:
        """Train to ``train.train_steps`` (or stop early at ``stop_at``, e.g. an interrupted job), then save."""
        cfg, t = self.cfg, self.cfg.train
        last_step = min(t.train_steps, stop_at) if stop_at is not None else t.train_steps
        saved_at = self.step
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        batches = self._batches()
        if self.pstate.is_logging_rank:
            log.info("training %s (%s) from step %d to %d: world %d = tp %d x pp %d x dp %d, grad accum %d",
                     cfg.name, cfg.model.architecture, self.step, t.train_steps, self.pstate.world_size,
                     self.pstate.tp_size, self.pstate.pp_size, self.pstate.dp_size,
                     self.derived.gradient_accumulation_steps)
        while self.step < last_step:
            start = time.perf_counter()
            log_now = (self.step + 1) % cfg.logging.log_interval == 0
            values = self.train_step(batches, log_layers=log_now)
            self.step += 1
            elapsed = time.perf_counter() - start
            values["train/tokens_per_s"] = tokens_per_step / elapsed
            values["train/step_time_s"] = elapsed
            values.update(throughput(self.flops_per_token, values["train/tokens_per_s"], self.pstate.world_size,
                                     self.peak_tflops))
            values["data/skipped_shards"] = float(self.loader.skipped_shards)
            self.losses.append(values["train/loss"])
            rollbacks = self.rollbacks
            try:
                batches = self._after_step(values, batches)
            except DivergenceError:
                self.metrics.scalars(self.step, values)  # the losses that ended the run stay readable
                self.metrics.flush()
                raise
            if self.rollbacks != rollbacks:
                self.metrics.scalars(self.step, {"train/rollbacks": float(self.rollbacks)})
                saved_at = self.step
                continue  # the step went back to the checkpoint: nothing of this step to log or save
            if t.eval_interval and self.step % t.eval_interval == 0:
                values["val/loss"] = self.validate()
            self.metrics.scalars(self.step, values)
            if log_now or self.step == t.train_steps:
                self.metrics.line(self.step, t.train_steps, {k: v for k, v in values.items() if "/layer" not in k})
            # never in a row of skipped steps: the weights may be diverged, and the save could replace a
            # good checkpoint of the same step that a rollback would need
            interval = cfg.checkpoint.save_interval
            if interval and self.step % interval == 0 and not self.consecutive_bad:
                self.save()
                saved_at = self.step
        if saved_at != self.step:
            self.save()
        self.metrics.close()
        return self.losses
