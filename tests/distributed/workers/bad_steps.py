"""Bad steps on 2 real ranks: a NaN or a spike on ONE rank skips the step on both; K bad steps in a
row roll back to the last checkpoint without replaying the data."""

from pathlib import Path

import torch

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks
from tests.helpers.tensorboard import read_scalars


def _trainer(args, name: str, callbacks=(), **sections):
    from ascender_dist.training.trainer import Trainer

    cfg = config_from_dict(tiny_run_config(args["data"], Path(args["root"]) / name, **sections))
    return Trainer(cfg, callbacks=callbacks)


def _inject(trainer, steps, ranks: set, how: str, after_rollbacks: bool = False) -> None:
    """Corrupt the loss of this rank at the given (0-based) steps: 'nan' or 'spike' (x 100); only
    before the first rollback unless ``after_rollbacks``."""
    import torch.distributed as dist

    module = trainer.engine.module
    forward = module.forward

    def corrupted(*a, **k):
        loss = forward(*a, **k)
        if trainer.step in steps and dist.get_rank() in ranks and (after_rollbacks or trainer.rollbacks == 0):
            return loss * float("nan") if how == "nan" else loss * 100.0
        return loss

    module.forward = corrupted


def _params(trainer) -> list:
    """Every parameter in full, on every rank (ZeRO-3 holds only a shard of each: gathered)."""
    params = list(trainer.engine.module.parameters())
    if trainer.cfg.parallel.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def _skip_check(args, name: str, how: str, **sections) -> dict:
    from ascender_dist.training.callbacks import Callback

    class Worst(Callback):  # what each step reports as the micro-batch loss that skipped it
        def __init__(self):
            self.seen = []

        def on_step_end(self, trainer, values):
            self.seen.append(values["train/worst_micro_batch_loss"])

    worst = Worst()
    trainer = _trainer(args, name, callbacks=[worst], train={"train_steps": 6, "loss_spike_factor": 3.0}, **sections)
    _inject(trainer, steps={3}, ranks={1}, how=how)
    trainer.fit(stop_at=3)
    before = _params(trainer)
    trainer.fit(stop_at=4)  # the corrupted step
    after_bad = _params(trainer)
    trainer.fit()
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(before, after_bad)),
            "zero_stage": trainer.engine.zero_optimization_stage(), "params": sum(p.numel() for p in before),
            "skipped": trainer.engine.skipped_steps, "losses": trainer.losses, "worst": worst.seen,
            "moved_later": not all(torch.equal(a, b) for a, b in zip(after_bad, _params(trainer)))}


def _rollback_check(args, name: str = "rollback", **sections) -> dict:
    """Steps 5 and 6 bad: the run rolls back to step 4's checkpoint. The skipped steps changed no
    weight, so the weights right after the rollback must be exactly the ones step 4 saved: the load
    restores them (under ZeRO-3 each rank its own shard of the parameters and optimizer state)."""
    trainer = _trainer(args, name, train={"train_steps": 8, "max_consecutive_bad_steps": 2},
                       checkpoint={"save_interval": 2}, **sections)
    _inject(trainer, steps={4, 5}, ranks={0}, how="nan")
    saves, save, rollback = [], trainer.save, trainer.rollback
    weights = {}

    def recording(step=None):
        tag = save(step)
        saves.append((tag, trainer.loader.state_dict()["consumed_samples"]))
        weights.setdefault(tag, _params(trainer))  # step 4's first save, not the rollback's re-save
        return tag

    def restoring(loss):
        batches = rollback(loss)
        weights["after_rollback"] = _params(trainer)
        return batches

    trainer.save, trainer.rollback = recording, restoring
    trainer.fit()
    restored, saved, step_2 = weights["after_rollback"], weights["step_00000004"], weights["step_00000002"]
    scalars = read_scalars(trainer.derived.tensorboard_dir) if trainer.pstate.is_logging_rank else {}
    return {"restored_equal": len(restored) == len(saved) and all(torch.equal(a, b) for a, b in zip(restored, saved)),
            "restored_differs_from_step_2": not all(torch.equal(a, b) for a, b in zip(restored, step_2)),
            "zero_stage": trainer.engine.zero_optimization_stage(), "params": sum(p.numel() for p in saved),
            "rollbacks": trainer.rollbacks, "step": trainer.step, "losses": trainer.losses,
            "skipped_steps": trainer.skipped_steps, "engine_skipped_steps": trainer.engine.skipped_steps,
            "consumed": trainer.loader.state_dict()["consumed_samples"], "saves": saves,
            "global_batch": trainer.cfg.train.global_batch_size,
            # what TensorBoard shows (the logging rank's event files, read as TensorBoard reads them)
            "tensorboard": {tag: scalars.get(tag) for tag in ("train/loss", "train/step_skipped", "rollback/train/loss",
                                                              "rollback/train/step_skipped", "train/rollbacks")}}


def _bad_row_at_the_end_check(args) -> dict:
    """The run ends inside a row of skipped steps (5, 6; the limit of 3 is not reached): no final
    save, so the newest good checkpoint (step 4) stays the latest one."""
    from ascender_dist.training import checkpoint as ckpt

    trainer = _trainer(args, "bad_row_at_end", train={"train_steps": 6, "max_consecutive_bad_steps": 3},
                       checkpoint={"save_interval": 2})
    _inject(trainer, steps={4, 5}, ranks={1}, how="nan")
    trainer.fit()
    directory = trainer.derived.checkpoint_dir
    return {"step": trainer.step, "bad": trainer.consecutive_bad, "latest": ckpt.latest_tag(directory),
            "tags": ckpt.complete_tags(directory)}


def _diverging_check(args) -> dict:
    """Every step from 7 on is bad, however often the run rolls back: the rollbacks go to older
    checkpoints, then the run stops with one line."""
    trainer = _trainer(args, "diverging", train={"train_steps": 12, "max_consecutive_bad_steps": 2,
                                                 "max_rollbacks": 2},
                       checkpoint={"save_interval": 2, "keep_last": 10})
    error, resumed = _diverge(trainer)
    return {"error": error, "resumed": resumed, "step": trainer.step, "rollbacks": trainer.rollbacks,
            "checkpoint_dir": str(trainer.derived.checkpoint_dir)}


def _diverge(trainer) -> tuple:
    """Every step from 7 on bad on rank 1; train until the run gives up. Returns (the
    DivergenceError's text or None, the tags its rollbacks resumed from)."""
    from ascender_dist.training.rollback import DivergenceError

    _inject(trainer, steps=range(6, 100), ranks={1}, how="nan", after_rollbacks=True)
    resumed, resume = [], trainer.resume

    def recording(tag=None):
        resumed.append(tag)
        return resume(tag)

    trainer.resume = recording
    try:
        trainer.fit()
    except DivergenceError as exc:
        return str(exc), resumed
    return None, resumed


class _Crash(Exception):
    """The job dies (preemption, a node lost) right after a rollback."""


def _diverging_restart_check(args) -> dict:
    """As _diverging_check, but the job dies right after its first rollback and a new job resumes:
    the rollback row it resumes inside goes on (the next rollback is a repeat, to an older
    checkpoint, and the bound counts the first job's rollback), instead of starting afresh."""
    sections = dict(train={"train_steps": 12, "max_consecutive_bad_steps": 2, "max_rollbacks": 2},
                    checkpoint={"save_interval": 2, "keep_last": 10})
    first = _trainer(args, "diverging_restart", **sections)
    _inject(first, steps=range(6, 100), ranks={1}, how="nan", after_rollbacks=True)
    rollback = first.rollback

    def crash_after(loss):
        rollback(loss)
        raise _Crash()

    first.rollback = crash_after
    try:
        first.fit()
    except _Crash:
        pass
    second = _trainer(args, "diverging_restart", **sections)  # auto-resumes from the re-saved target
    resumed_at, rollbacks_at_resume = second.step, second.rollbacks
    error, resumed = _diverge(second)
    return {"error": error, "resumed_at": resumed_at, "resumed": resumed, "step": second.step,
            "rollbacks_at_resume": rollbacks_at_resume, "rollbacks": second.rollbacks}


def main(args):
    return run_checks({
        "nan_zero0": lambda: _skip_check(args, "nan0", "nan", parallel={"zero_stage": 0}),
        "nan_zero1": lambda: _skip_check(args, "nan1", "nan", parallel={"zero_stage": 1}),
        "spike_zero2": lambda: _skip_check(args, "spike2", "spike", parallel={"zero_stage": 2}),
        "nan_zero3": lambda: _skip_check(args, "nan3", "nan", parallel={"zero_stage": 3}),
        "nan_pp2": lambda: _skip_check(args, "nanpp", "nan", parallel={"pipeline_model_parallel_size": 2}),
        # rank 1 is the last stage, where the pipeline computes (and the guard judges) the loss
        "spike_pp2": lambda: _skip_check(args, "spikepp", "spike", parallel={"pipeline_model_parallel_size": 2}),
        "rollback": lambda: _rollback_check(args),
        "rollback_zero3": lambda: _rollback_check(args, "rollback3", parallel={"zero_stage": 3}),
        "bad_row_at_end": lambda: _bad_row_at_the_end_check(args),
        "diverging": lambda: _diverging_check(args),
        "diverging_restart": lambda: _diverging_restart_check(args),
    })
