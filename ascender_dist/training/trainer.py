"""The training loop: data -> DeepSpeed engine -> callbacks (metrics) -> checkpoints.

:func:`ascender_dist.training.run.build_run` sets up the process groups, loaders and engine; the
:class:`Trainer` steps, validates, skips bad steps and rolls back, saves, and calls its callbacks
(:mod:`ascender_dist.training.callbacks`) at each of those points.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ascender_dist.config.architectures import unreached_warmups
from ascender_dist.config.loader import dump_yaml, to_dict
from ascender_dist.config.schema import RunConfig
from ascender_dist.training import checkpoint as ckpt
from ascender_dist.training.callbacks import Callback, overrides
from ascender_dist.training.engine import apply_optimizer_config, build_engine, pipeline_batches
from ascender_dist.models.build import poison
from ascender_dist.training.guard import any_rank, max_over_ranks, on_every_rank
from ascender_dist.training.layer_stats import last_training_step, set_training_step
from ascender_dist.training.lr_schedule import lr_at, set_lr
from ascender_dist.training.resume_check import check_resume, data_fingerprint, data_tokenizer_sha256
from ascender_dist.training.rollback import DivergenceError, RollbackPolicy
from ascender_dist.versions import git_state, package_versions
from ascender_dist.training.run import aux_loss_gradient_scale, build_loader, build_run  # noqa: F401 (re-exported)
from ascender_dist.training.run import require_validation_batches, resume_tag_for_layout, validation_batches_per_rank

log = logging.getLogger("ascender_dist")


def _mean_over(group, value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


class Trainer:
    def __init__(self, cfg: RunConfig, init_state: Optional[dict] = None, callbacks: Sequence[Callback] = (),
                 code_record: Optional[dict] = None):
        """``init_state``: canonical full weights to start from (else ``checkpoint.init_from``, else
        random init); ignored when a checkpoint to resume from exists. ``callbacks`` run after the
        default ones (see :func:`~ascender_dist.training.run.build_run`). ``code_record``: the code
        its checkpoints' meta.json names (default: this checkout's git state, the job that trains; a
        reshard, which trains nothing, passes its source's)."""
        run = build_run(cfg, init_state, callbacks)
        self.cfg = cfg
        self.tokenizer = run.tokenizer
        self.derived = run.derived
        self.pstate = run.pstate
        self.loader = run.loader
        self.val_loader = run.val_loader
        self.guard = run.guard
        self.resume_tag = run.resume_tag
        self.engine = run.engine
        self.metrics = run.metrics
        self.callbacks = run.callbacks
        self.rollback_policy = RollbackPolicy(cfg.train.max_rollbacks)
        self.pipelined = cfg.parallel.pipeline_model_parallel_size > 1
        self.step = 0
        self.consecutive_bad = 0
        self.rollbacks = 0
        # skipped optimizer steps over the whole run: DeepSpeed's engine.skipped_steps is restored
        # from the checkpoint a rollback loads, which would un-count the steps that caused it
        self.skipped_steps = 0
        self.losses: list[float] = []  # per-step training loss (mean over the global batch), for tests
        self.stop_reason: Optional[str] = None  # set by request_stop: fit saves and ends after this step
        self.last_saved_tag: Optional[str] = None  # this process's newest complete save
        # the step whose validation a stop skipped (the save came first): run when training goes on from it
        self.validation_due: Optional[int] = None
        self.data_record = {"data_fingerprint": data_fingerprint(cfg), "data_changes": []}  # -> meta.json
        self.code_record = code_record if code_record is not None else git_state()  # -> meta.json
        if cfg.checkpoint.auto_resume:
            self.resume()

    def request_stop(self, reason: str) -> None:
        """End ``fit`` after the current step, with a checkpoint (a callback's decision, the same on
        every rank: see :mod:`ascender_dist.training.preemption`)."""
        self.stop_reason = reason

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _progress(self, what: str) -> None:
        """Long work between two hooks (a rollback target's universal conversion) advanced: on_progress.
        Called from the conversion's heartbeat thread on rank 0."""
        self._call("on_progress", what)

    # ---------------------------------------------------------------- checkpoints
    def _engine_for(self, tag: Optional[str]):
        """The engine that reads ``tag``. DeepSpeed fixes at initialisation whether an engine reads
        universal checkpoints (its ``checkpoint.load_universal`` config); after a resume through a
        universal copy, loading one of our own checkpoints (a rollback) needs an engine built
        without it: the weights, optimizer state and RNG all come from the checkpoint."""
        reads_universal = bool(tag) and tag.endswith(ckpt.UNIVERSAL)
        if tag is None or self.engine.load_universal_checkpoint() == reads_universal:
            return self.engine
        self.engine = None  # the old engine's memory goes before the new one's is allocated
        return build_engine(self.cfg, self.derived, None, self.guard, load_universal=reads_universal)

    def resume(self, tag: Optional[str] = None) -> bool:
        """Load ``tag`` (a rollback target; default: the tag build_run chose, else the latest):
        through its universal copy when it was saved at another data-parallel size."""
        if tag is not None:
            tag = resume_tag_for_layout(self.derived.checkpoint_dir, self.pstate, self.cfg.parallel.zero_stage, tag,
                                        precision=self.cfg.train.precision, progress=self._progress)
        tag = tag or self.resume_tag or ckpt.agreed_latest_tag(self.derived.checkpoint_dir)
        self.resume_tag = None  # a universal copy is read once; later rollbacks use our own checkpoints
        if tag is not None:  # same model, same data (or a change the config allows), before loading
            # reads the manifests again (a rollback too): a file rewritten meanwhile stops every rank
            loaded = self.tokenizer.sha256 if self.tokenizer else None  # what this run reads, not the file now
            made_with = data_tokenizer_sha256(self.loader)
            self.data_record = on_every_rank(lambda: check_resume(self.cfg, self.derived.checkpoint_dir, tag,
                                                                  self.pstate.is_logging_rank, self.derived, loaded,
                                                                  made_with))
        self.engine = self._engine_for(tag)
        client_state = ckpt.load_checkpoint(self.engine, self.derived.checkpoint_dir, tag)
        if client_state is None:
            # a job of this run that died before its first checkpoint logged steps this one logs again
            self.metrics.continue_at(self.step)
            return False
        if "step" not in client_state:  # a universal copy may not carry our client state
            client_state = ckpt.read_meta(self.derived.checkpoint_dir, tag.removesuffix(ckpt.UNIVERSAL))
        self.step = int(client_state["step"])
        changed = apply_optimizer_config(self.engine.optimizer, self.cfg.optimizer)
        if changed and self.pstate.is_logging_rank:
            log.info("optimizer settings from the config, not the checkpoint: %s", ", ".join(changed))
        self.loader.load_state_dict(client_state["data"])
        if "guard" in client_state:
            self.guard.load_state_dict(client_state["guard"])
        if "rollback" in client_state:
            self.rollback_policy.load_state_dict(client_state["rollback"])
        self.skipped_steps = int(client_state.get("skipped_steps", self.engine.skipped_steps))
        self.rollbacks = int(client_state.get("rollbacks", 0))  # train/rollbacks goes on across restarts
        self.validation_due = self.step if client_state.get("validation_due") else None
        states = client_state.get("callbacks", {})
        for callback in self.callbacks:
            if getattr(callback, "state_key", None) in states:
                callback.load_state_dict(self, states[callback.state_key])
        self.metrics.continue_at(self.step)  # TensorBoard hides the steps after it logged before
        if self.pstate.is_logging_rank:
            log.info("resumed from %s at step %d", self.derived.checkpoint_dir / tag if tag else
                     self.derived.checkpoint_dir / ckpt.tag_for_step(self.step), self.step)
        self._call("on_load", tag or ckpt.tag_for_step(self.step))
        return True

    def checkpoint_meta(self, step: Optional[int] = None) -> dict:
        """What a converter needs to read this checkpoint without the run's YAML or launch, and the
        code that trained it (``code``: git commit, dirty flag, hash of the uncommitted changes; None
        values outside a git checkout). The tokenizer's sha256 (None without one) is its identity:
        exports and evaluations check the tokenizer and data they are given against it (a same-size
        tokenizer is not the same one)."""
        p = self.pstate
        return {
            "format": ckpt.FORMAT_VERSION, "step": self.step if step is None else step, "architecture": self.cfg.model.architecture,
            "world_size": p.world_size, "tensor_model_parallel_size": p.tp_size,
            "pipeline_model_parallel_size": p.pp_size, "data_parallel_size": p.dp_size,
            "zero_stage": self.cfg.parallel.zero_stage, "precision": self.cfg.train.precision,
            "vocab_size": self.cfg.model.vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None),
            "padded_vocab_size": self.derived.padded_vocab_size,
            "tokenizer_sha256": self.tokenizer.sha256 if self.tokenizer else None,
            "data_tokenizer_sha256": data_tokenizer_sha256(self.loader),  # checked on resume (resume_check)
            "data": self.loader.state_dict(), **self.data_record,
            "versions": package_versions(("ascender-dist", "megatron-core", "deepspeed", "torch")),
            "code": self.code_record,
        }

    def _callback_states(self) -> dict:
        """Collective: the checkpoint's state of each callback with a ``state_key`` (callbacks module)."""
        return {cb.state_key: cb.state_dict(self) for cb in self.callbacks if getattr(cb, "state_key", None)}

    def save(self, step: Optional[int] = None) -> str:
        """Checkpoint the run as of ``step`` (default: the current step; a benchmark saves the same
        weights under several steps' tags)."""
        import json

        step = self.step if step is None else step
        self.rollback_policy.saved(step)  # first: the checkpoint records the row as this save leaves it
        tag = ckpt.save_checkpoint(
            self.engine, self.derived.checkpoint_dir, step,
            client_state={"step": step, "data": self.loader.state_dict(), "config": to_dict(self.cfg),
                          "guard": self.guard.state_dict(), "rollback": self.rollback_policy.state_dict(),
                          "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks,
                          "validation_due": self.validation_due == step,
                          "callbacks": self._callback_states(),
                          "padded_vocab_size": self.derived.padded_vocab_size},
            keep_last=self.cfg.checkpoint.keep_last, protect=self.rollback_policy.protected_steps,
            extra_files={"config.yaml": dump_yaml(to_dict(self.cfg)),
                         "meta.json": json.dumps(self.checkpoint_meta(step), indent=1)},
        )
        if self.pstate.is_logging_rank:
            log.info("saved checkpoint %s", self.derived.checkpoint_dir / tag)
        self._call("on_save", tag)
        self.last_saved_tag = tag
        return tag

    # ---------------------------------------------------------------- steps
    def train_step(self, batches) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
        from megatron.core import parallel_state as mps

        set_training_step(self.engine.module, self.step)
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
                losses.append(loss.detach())
                # the step's fate is decided once, before its last backward, identically on all ranks,
                # from one host read of its micro-batch losses (not a device sync per micro-batch)
                last = micro == accumulation - 1
                if last:
                    bad = any([self.guard.is_bad(x) for x in torch.stack(losses).tolist()])
                self.engine.backward(poison(loss) if last and any_rank(bad) else loss)
                self.engine.step()
            step_loss = _mean_over(mps.get_data_parallel_group(), torch.stack(losses).mean())
        skipped = self.engine.skipped_steps > skipped_before
        self.skipped_steps += int(skipped)
        worst = self.guard.take_worst()  # judged on the ranks that compute the loss (the last stage under PP)
        grad_norm = self.engine.get_global_grad_norm()
        values = {"train/loss": step_loss, "train/lr": lr,
                  "train/grad_norm": float(grad_norm) if grad_norm is not None and not skipped else None,
                  "train/skipped_steps": float(self.skipped_steps), "train/step_skipped": float(skipped),
                  # the micro-batch loss that skipped the step (every rank agrees on skipped: one collective)
                  "train/worst_micro_batch_loss": max_over_ranks(worst) if skipped else None}
        return values

    def validate(self, iters: Optional[int] = None) -> float:
        """Mean loss over the validation split's first ``iters`` (default ``train.eval_iters``)
        micro-batches in all, dealt to the data-parallel ranks (validation_batches_per_rank): the
        same ones every time and for every layout; the validation callbacks run around it."""
        if self.val_loader is None:  # a run without train.eval_interval validates only when asked
            self.val_loader = build_loader(self.cfg, self.tokenizer, self.pstate, split="val")
        # the step the weights last trained at, as in a straight run (a due validation that a resumed
        # job runs before its first step would otherwise run ASCender's schedules at step 0)
        set_training_step(self.engine.module, last_training_step(self.step))
        self._call("on_validation_start")
        loss = self._validation_loss(self.cfg.train.eval_iters if iters is None else iters)
        self._call("on_validation_end", loss)
        return loss

    def validation_batches(self, iters: int) -> int:
        """The micro-batches this rank validates for ``iters`` in all (validation_batches_per_rank)."""
        return validation_batches_per_rank(iters, self.pstate.dp_size, len(self.val_loader))

    @torch.no_grad()
    def _validation_loss(self, iters: int) -> float:
        from megatron.core import parallel_state as mps

        require_validation_batches(self.cfg, self.val_loader)
        iters = self.validation_batches(iters)
        batches = iter(self.val_loader)
        if self.pipelined:
            return float(self.engine.eval_batch(pipeline_batches(batches), num_micro_batches=iters))
        self.engine.eval()
        losses = [self.engine(next(batches)["tokens"].to(self.pstate.device)) for _ in range(iters)]
        self.engine.train()
        return _mean_over(mps.get_data_parallel_group(), torch.stack(losses).mean())

    def _validate_if_due(self) -> None:
        """The validation that a stop skipped at the current step (``validation_due``), logged at
        that step on its own: the resumed job runs it before its first step, so the curve keeps
        every ``train.eval_interval`` point; not when the resumed config no longer validates there
        (``eval_interval`` changed or 0: its validation split may be gone)."""
        if self.validation_due != self.step:
            return
        self.validation_due = None
        every = self.cfg.train.eval_interval
        if every and self.step % every == 0:
            self._call("on_log", {"val/loss": self.validate()})

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
            worst, threshold = values["train/worst_micro_batch_loss"], self.guard.threshold
            if worst < math.inf and (threshold is None or worst <= threshold):  # no loss the guard flagged
                log.warning("step %d skipped on all ranks: non-finite gradients (every micro-batch loss finite, "
                            "at most %.4g); step mean %.4g", self.step, worst, values["train/loss"])
            else:
                bound = "" if threshold is None else f", or above {threshold:.4g}"
                log.warning("step %d skipped on all ranks: a micro-batch loss of %.4g (non-finite%s); step mean "
                            "%.4g", self.step, worst, bound, values["train/loss"])
        limit = t.max_consecutive_bad_steps
        if limit and self.consecutive_bad >= limit:
            return self.rollback(values["train/loss"])
        if not limit and self.consecutive_bad >= 10:
            raise DivergenceError(f"step {self.step}: {self.consecutive_bad} bad steps in a row (loss "
                                  f"{values['train/loss']:.4g}); set train.max_consecutive_bad_steps to roll back")
        return batches

    def _held_checkpoints(self) -> dict[int, str]:
        """{step: tag} of every complete checkpoint, as rank 0 sees them (every rank must load the same
        one): a complete ``step_N.replaced`` that a same-step save killed between its two renames left
        counts as step N's (the resume may have started from it) when ``step_N`` itself is missing."""
        directory = self.derived.checkpoint_dir

        def held() -> dict[int, str]:
            found: dict[int, str] = {}
            for tag in ckpt.held_tags(directory):  # by step, a step's own tag before its moved-aside copy
                found.setdefault(ckpt.step_of_tag(tag.removesuffix(ckpt.REPLACED)), tag)
            return found

        return ckpt.from_rank0(held)

    def rollback(self, loss: float):
        """Load an earlier checkpoint (weights, optimizer, step, guard) but keep the data position, so
        the batches that failed are not replayed; or stop the job when the run keeps diverging."""
        bad_step, bad_start = self.step, self.step - self.consecutive_bad + 1
        good_tags = {step: tag for step, tag in self._held_checkpoints().items() if step < bad_start}
        good = sorted(good_tags)
        target = self.rollback_policy.next_target(bad_step, good)
        if target is None:
            last_good = (f"last good checkpoint {self.derived.checkpoint_dir / good_tags[good[-1]]}"
                         if good else f"no checkpoint from before step {bad_start} to roll back to")
            raise DivergenceError(
                f"step {bad_step}: loss {loss:.4g}, {self.consecutive_bad} bad steps in a row after "
                f"{self.rollback_policy.in_a_row} rollbacks in a row (train.max_rollbacks: "
                f"{self.cfg.train.max_rollbacks}); {last_good}")
        data_state, row, skipped = self.loader.state_dict(), self.rollback_policy.state_dict(), self.skipped_steps
        rollbacks = self.rollbacks
        self.resume(good_tags[target])
        self.loader.load_state_dict(data_state)
        self.rollback_policy.load_state_dict(row)  # the row goes on, whatever row the target had recorded
        self.skipped_steps = skipped  # the skipped steps that led here stay counted
        self.rollbacks = rollbacks + 1  # and the rollbacks, this one included (the save below records it)
        # saved again at once (same weights, the data position past the failed batches) and made
        # `latest`: a job that dies before its next save resumes here, not at the checkpoint the
        # rollback passed over, and does not replay the failed batches
        self.save()
        self.consecutive_bad = 0
        if self.pstate.is_logging_rank:
            log.warning("rolled back from step %d to the checkpoint of step %d (rollback %d in a row of at most "
                        "%d); data continues where it was", bad_step, self.step, self.rollback_policy.in_a_row,
                        self.cfg.train.max_rollbacks)
        return self._batches()

    def _batches(self):
        batches = iter(self.loader)
        watchers = [cb for cb in self.callbacks if overrides(cb, "on_batch")]
        if watchers:
            batches = self._watched(batches, watchers)
        return pipeline_batches(batches) if self.pipelined else batches

    def _watched(self, batches, watchers):
        for item in batches:
            for callback in watchers:
                callback.on_batch(self, item)
            yield item

    def fit(self, stop_at: Optional[int] = None, final_save: bool = True) -> list[float]:
        """Train to ``train.train_steps`` (or stop early at ``stop_at``, e.g. an interrupted job), then
        save (unless ``final_save`` is False: a throughput measurement). Returns the step losses."""
        try:
            return self._fit(stop_at, final_save)
        except BaseException as error:
            self._call("on_exception", error)
            raise

    def _fit(self, stop_at: Optional[int], final_save: bool) -> list[float]:
        cfg, t = self.cfg, self.cfg.train
        last_step = min(t.train_steps, stop_at) if stop_at is not None else t.train_steps
        saved_at = self.step
        self.stop_reason = None
        batches = self._batches()
        if self.pstate.is_logging_rank:
            log.info("training %s (%s) from step %d to %d: world %d = tp %d x pp %d x dp %d, grad accum %d",
                     cfg.name, cfg.model.architecture, self.step, t.train_steps, self.pstate.world_size,
                     self.pstate.tp_size, self.pstate.pp_size, self.pstate.dp_size,
                     self.derived.gradient_accumulation_steps)
            for line in unreached_warmups(cfg):
                log.warning("%s", line)
        if self.step >= t.train_steps and self.pstate.is_logging_rank:  # e.g. a finished run's output_dir
            log.warning("%s is already at step %d >= train.train_steps %d: nothing to train (raise "
                        "train.train_steps to continue it, or set another output_dir for a new run)",
                        self.derived.output_dir, self.step, t.train_steps)
        self._call("on_train_start")
        while self.step < last_step:
            self._validate_if_due()  # after a resume, or a rollback, to a stop's checkpoint
            self._call("on_step_start")
            values = self.train_step(batches)
            self.step += 1
            self._call("on_step_end", values)
            self.losses.append(values["train/loss"])
            rollbacks = self.rollbacks
            batches = self._after_step(values, batches)
            if self.rollbacks != rollbacks:
                self._call("on_rollback")
                saved_at = self.step
                if self.stop_reason is not None:
                    break  # the checkpoint just loaded is the one to continue from
                continue  # the step went back to the checkpoint: nothing of this step to log or save
            if t.eval_interval and self.step % t.eval_interval == 0:
                # on the last step the run is complete: validated before its final save, which then
                # records nothing due (a re-run of the finished run would validate again)
                if self.stop_reason is None or self.step >= t.train_steps:
                    values["val/loss"] = self.validate()
                else:  # the save comes first; the checkpoint records the validation as due
                    self.validation_due = self.step
            self._call("on_log", values)
            # never in a row of skipped steps: the weights may be diverged, and the save could replace a
            # good checkpoint of the same step that a rollback would need
            interval = cfg.checkpoint.save_interval
            if interval and self.step % interval == 0 and not self.consecutive_bad:
                self.save()
                saved_at = self.step
            if self.stop_reason is not None and self.step < last_step:
                break
        if self.step >= t.train_steps:
            self.stop_reason = None  # a stop decided on the last step: the run is complete anyway
        if saved_at != self.step and final_save:
            if not self.consecutive_bad:  # the same rule as the interval saves above
                self.save()
            elif self.pstate.is_logging_rank:
                log.warning("no final save at step %d: its last %d steps were skipped, the newest checkpoint "
                            "stays the latest", self.step, self.consecutive_bad)
        if self.stop_reason is not None and self.pstate.is_logging_rank:
            log.warning("stopped at step %d of %d (%s); the newest checkpoint is %s: run the same command "
                        "again to continue", self.step, t.train_steps, self.stop_reason,
                        self.last_saved_tag or self.resume_tag or "the one resumed from")
        self._call("on_train_end")
        return self.losses
