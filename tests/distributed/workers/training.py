"""Training-loop checks on 2 real ranks (DP=2): exact resume under each ZeRO stage, checkpoint files."""

from pathlib import Path

import torch

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks


def _trainer(data, out: Path, callbacks=(), **sections):
    from ascender_dist.training.trainer import Trainer

    return Trainer(config_from_dict(tiny_run_config(data, out, **sections)), callbacks=callbacks)


def _hook_recorder():
    from ascender_dist.training.callbacks import Callback

    class Recorder(Callback):
        def __init__(self):
            self.calls = []

        def __getattribute__(self, name):
            if name.startswith("on_"):
                self.calls.append((name, object.__getattribute__(self, "_step")()))
            return object.__getattribute__(self, name)

        def _step(self):
            return self.trainer.step if hasattr(self, "trainer") else None

    return Recorder()


def resume_matches_straight_run(data, root: Path, zero_stage: int, n: int = 3) -> dict:
    """2N straight steps vs N steps + checkpoint + a fresh Trainer that auto-resumes + N steps."""
    sections = {"parallel": {"zero_stage": zero_stage}, "train": {"train_steps": 2 * n}}
    straight = _trainer(data, root / f"straight_z{zero_stage}", **sections).fit()
    interrupted = _trainer(data, root / f"resumed_z{zero_stage}", **sections)
    first_leg = interrupted.fit(stop_at=n)
    resumed = _trainer(data, root / f"resumed_z{zero_stage}", **sections)
    start_step = resumed.step
    second_leg = resumed.fit()
    return {"straight": straight, "first_leg": first_leg, "second_leg": second_leg, "start_step": start_step}


def dp2_leg(data, root: Path, zero_stage: int, n: int = 3) -> dict:
    """Straight 2N steps at DP=2, and an N-step run whose checkpoint a DP=1 job will resume."""
    sections = {"parallel": {"zero_stage": zero_stage}, "train": {"train_steps": 2 * n}}
    from ascender_dist.training.callbacks import Callback

    class AdvanceRng(Callback):  # no dropout here: draw once, so the saved RNG state differs from a fresh one
        def on_step_start(self, trainer):
            torch.rand(3)

    straight = _trainer(data, root / f"dpchange_straight_z{zero_stage}", **sections).fit()
    _trainer(data, root / f"dpchange_z{zero_stage}", callbacks=[AdvanceRng()], **sections).fit(stop_at=n)
    return {"straight": straight}


def layer_stats_over_replicas() -> dict:
    """Each replica's layer saw other tokens: the logged statistics are their mean (``*_max``: max)
    over the data-parallel group, the same on every rank, not the logging rank's own."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ascender_dist.training.layer_stats import gather_layer_stats

    rank = dist.get_rank()
    layer = nn.Linear(1, 1)
    layer.layer_number, layer.stats_prefix, layer.stats_per_head, layer.collect_stats = 2, "connection", False, True
    layer.last_stats = {"steps_mean": torch.tensor(1.0 + rank), "steps_max": torch.tensor(2.0 + 3 * rank)}
    return gather_layer_stats(layer, dp_group=dist.group.WORLD)


def layer_stats_per_head_over_tensor_parallel() -> dict:
    """Per-head statistics of a layer whose heads are split over TP ranks (here the two ranks as one
    TP group, rank r holding global heads 2r, 2r + 1): gathered in rank order into global head
    numbers; a 0-d statistic (an aux loss over the rank's heads) is the mean over the ranks."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ascender_dist.training.layer_stats import gather_layer_stats

    rank = dist.get_rank()
    layer = nn.Linear(1, 1)
    layer.layer_number, layer.stats_prefix, layer.stats_per_head, layer.collect_stats = 3, "ascender", True, True
    layer.last_stats = {"gate_coh_mean": torch.tensor([10.0 * rank, 10.0 * rank + 1]),
                        "aux_compactness": torch.tensor(1.0 + 2 * rank)}
    return gather_layer_stats(layer, tp_group=dist.group.WORLD)


def resume_takes_the_configs_optimizer_settings(data, root: Path, zero_stage: int) -> dict:
    """Saved with one weight decay / betas / eps / clip, resumed with others: the optimizer steps
    with the resumed config's (loading restores the checkpoint's param groups and clip value)."""
    def sections(**opt):
        return {"parallel": {"zero_stage": zero_stage}, "train": {"train_steps": 4},
                "optimizer": {"weight_decay": 0.1, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0, **opt}}

    out = root / f"opt_settings_z{zero_stage}"
    _trainer(data, out, **sections()).fit(stop_at=2)
    resumed = _trainer(data, out, **sections(weight_decay=0.05, beta2=0.999, eps=1e-6, grad_clip=0.5))
    resumed.fit()
    opt = resumed.engine.optimizer
    return {"step_at_resume_end": resumed.step,
            "groups": [[g["weight_decay"], list(g["betas"]), g["eps"]] for g in opt.param_groups],
            "clip": getattr(opt, "clip_grad", getattr(opt, "max_norm", None))}


def separation_schedule(data, root: Path) -> dict:
    """Separation joins at ``separation_start_step`` through the step the trainer hands the layers
    (set_training_step): per optimizer step, the training_step every ASCender layer ran with, and
    the largest |gradient| that delta and kappa (read by Separation alone) received."""
    from ascender_dist.models.specs.ascender import AscenderCoreAttention
    from ascender_dist.training.callbacks import Callback

    seen: dict = {}

    class Watch(Callback):
        def on_train_start(self, trainer):
            cores = [m for m in trainer.engine.module.modules() if isinstance(m, AscenderCoreAttention)]
            assert cores

            def record(key, value):
                entry = seen.setdefault(trainer.step, {"layer_steps": set(), "delta": 0.0, "kappa": 0.0})
                if key == "layer_steps":
                    entry[key].add(value)
                else:
                    entry[key] = max(entry[key], value)

            for core in cores:
                core.register_forward_pre_hook(lambda module, args: record("layer_steps", module.training_step))
                for name in ("delta", "kappa"):
                    getattr(core.params, name).register_hook(
                        lambda grad, name=name: record(name, float(grad.abs().max())))

    model = {"architecture": "ascender", "ascender": {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "chunk_size": 8,
                                                       "omega_init": 0.5, "separation_start_step": 2,
                                                       "trainable_delta_kappa_temp": True}}
    _trainer(data, root / "separation_schedule", callbacks=[Watch()], model=model,
             train={"train_steps": 4, "eval_interval": 0}).fit()
    return [{"step": step, **entry, "layer_steps": sorted(entry["layer_steps"])} for step, entry in sorted(seen.items())]


def stop_on_a_validation_step(data, root: Path) -> dict:
    """A stop decided on a step that validates saves first and skips the validation; the checkpoint
    records it as due, and the resumed job runs it before its first step: the validation curve and
    TensorBoard have every eval_interval point, with the straight run's losses. A stop on the last
    step (which validates too) validates before its final save, so a re-run of the finished run
    validates nothing again; a resume whose config no longer validates skips what was due.
    ASCender with Separation from step 1: the due validation must run it as the straight run's
    validation at step 2 did (the resumed job's layers still said step 0 before its first step)."""
    from ascender_dist.training.callbacks import Callback
    from tests.helpers.tensorboard import read_scalars

    class Record(Callback):
        def __init__(self, stop_at=None):
            self.stop_at, self.curve, self.logged = stop_at, [], []

        def on_step_end(self, trainer, values):
            if trainer.step == self.stop_at:
                trainer.request_stop("a test's request")

        def on_validation_end(self, trainer, loss):
            self.curve.append((trainer.step, loss))

        def on_log(self, trainer, values):
            self.logged.append((trainer.step, sorted(values)))

    model = {"architecture": "ascender", "ascender": {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "chunk_size": 8,
                                                       "omega_init": 0.5, "separation_start_step": 1}}
    sections = {"train": {"train_steps": 4, "eval_interval": 2, "eval_iters": 2}, "model": model}
    straight = Record()
    _trainer(data, root / "val_straight", callbacks=[straight], **sections).fit()
    stopped, resumed, last = Record(stop_at=2), Record(), Record(stop_at=4)
    first = _trainer(data, root / "val_stopped", callbacks=[stopped], **sections)
    first.fit()
    second = _trainer(data, root / "val_stopped", callbacks=[resumed], **sections)
    start = second.step
    second.fit()
    _trainer(data, root / "val_last", callbacks=[last], **sections).fit()
    rerun = Record()  # the same command again on the finished run: nothing to train, nothing due
    _trainer(data, root / "val_last", callbacks=[rerun], **sections).fit()
    # stopped on a validating step, resumed with validation turned off: nothing due is run
    _trainer(data, root / "val_off", callbacks=[Record(stop_at=2)], **sections).fit()
    off = Record()
    _trainer(data, root / "val_off", callbacks=[off], train={"train_steps": 4, "eval_interval": 0}, model=model).fit()

    def val_steps(run: str) -> list:
        board = read_scalars(root / run / "tensorboard") if second.pstate.is_logging_rank else {}
        return [step for step, _ in board.get("val/loss", [])]

    return {"straight": straight.curve, "stopped": stopped.curve, "stopped_at": first.step,
            "start": start, "resumed": resumed.curve, "resumed_logged": resumed.logged[:2], "last": last.curve,
            "rerun": rerun.curve, "off": off.curve, "board_val_steps": val_steps("val_stopped"),
            "board_last_val_steps": val_steps("val_last")}


def skipped_shards_pooled_and_kept(data, root: Path) -> dict:
    """DP=2, ``on_corrupt: skip``: rank 1 alone meets a corrupt training shard in its first step. The
    logged ``data/skipped_shards`` (console lines every 2 steps) counts it on rank 0 too, which never
    read it, and a resumed job that never meets it again still counts it."""
    import torch.distributed as dist
    from unittest import mock

    from ascender_dist.training.callbacks import Callback
    from data_pipeline import loader as loader_mod

    class Logged(Callback):
        def __init__(self):
            self.values = {}

        def on_log(self, trainer, values):
            self.values[trainer.step] = values.get("data/skipped_shards")

    real, met = loader_mod._Dataset._read, []

    def read(dataset, idx, rows, got=None):
        url = dataset.specs[idx].url
        if dist.get_rank() == 1 and not met and "train" in url.rsplit("/", 1)[-1]:
            met.append(url)
            raise loader_mod._CorruptShard(url, "bad bytes (test)")
        return real(dataset, idx, rows, got)

    from ascender_dist.training.trainer import Trainer

    raw = tiny_run_config(data, root / "skipped_shards", train={"train_steps": 4}, logging={"log_interval": 2},
                          checkpoint={"save_interval": 2})
    raw["data"]["on_corrupt"] = "skip"
    first, second = Logged(), Logged()
    with mock.patch.object(loader_mod._Dataset, "_read", read):
        trainer = Trainer(config_from_dict(raw), callbacks=[first])
        trainer.fit(stop_at=2)
    own = trainer.loader.skipped_shards
    resumed = Trainer(config_from_dict(raw), callbacks=[second])
    resumed.fit()
    return {"met": met, "own": own, "first": first.values, "second": second.values,
            "resumed_own": resumed.loader.skipped_shards}


DP_CHANGE_STAGES = (0, 1, 2, 3)


def main(args):
    data, root = args["data"], Path(args["root"])
    checks = {f"resume_zero{stage}": (lambda stage=stage: resume_matches_straight_run(data, root, stage))
              for stage in (0, 1, 2, 3)}
    checks.update({f"dp2_leg_zero{stage}": (lambda stage=stage: dp2_leg(data, root, stage))
                   for stage in DP_CHANGE_STAGES})
    checks["layer_stats_over_replicas"] = layer_stats_over_replicas
    checks["layer_stats_per_head_over_tensor_parallel"] = layer_stats_per_head_over_tensor_parallel
    checks.update({f"optimizer_settings_zero{stage}":
                   (lambda stage=stage: resume_takes_the_configs_optimizer_settings(data, root, stage))
                   for stage in (0, 1)})
    checks["separation_schedule"] = lambda: separation_schedule(data, root)
    checks["stop_on_a_validation_step"] = lambda: stop_on_a_validation_step(data, root)
    checks["skipped_shards"] = lambda: skipped_shards_pooled_and_kept(data, root)
    return run_checks(checks)


def resume_at_dp1(args):
    """World size 1: resume the DP=2 checkpoints and finish the run."""
    data, root = args["data"], Path(args["root"])

    def leg(stage):
        from ascender_dist.training.callbacks import PerSequenceValidationLosses, ValidationCurve

        recorder, per_sequence, curve = _hook_recorder(), PerSequenceValidationLosses(), ValidationCurve(2)
        trainer = _trainer(data, root / f"dpchange_z{stage}", parallel={"zero_stage": stage},
                           train={"train_steps": 6}, callbacks=[recorder, per_sequence, curve])
        recorder.trainer = trainer
        start = trainer.step
        # the resume restored the RNG streams of the saved rank at this rank's position (dp 0, mp 0), also
        # through a universal copy (which holds no RNG files of its own)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        saved_rng = torch.load(trainer.derived.checkpoint_dir / "step_00000003" / "rng" / "rank_00000.pt",
                               weights_only=False)
        rng_restored = (torch.equal(torch.get_rng_state(), saved_rng["torch"])
                        and all(torch.equal(get_cuda_rng_tracker().get_states()[name], state)
                                for name, state in saved_rng["tracker"].items()))
        weight_decay_by_group = [group["weight_decay"] for group in trainer.engine.optimizer.param_groups]
        losses = trainer.fit()
        fit_calls = list(recorder.calls)
        # a later load of our own checkpoint (what a rollback does) goes through an engine that reads
        # native checkpoints: the one fit just saved gives back the same weights
        from ascender_dist.training.checkpoint import tag_for_step

        before = trainer.validate(2)
        read_universal = trainer.engine.load_universal_checkpoint()
        reloaded = trainer.resume(tag_for_step(6))
        value = {"start": start, "losses": losses, "read_universal": read_universal, "reloaded": reloaded,
                 "reads_universal_after": trainer.engine.load_universal_checkpoint(), "step_after": trainer.step,
                 "val_before": before, "val_after": trainer.validate(2), "fit_calls": fit_calls,
                 "curve": curve.curve, "per_sequence": per_sequence.losses,
                 "weight_decay_by_group": weight_decay_by_group, "rng_restored": rng_restored}
        # a rollback to the checkpoint saved at DP=2 reads it through its universal copy again; made
        # anew here (the copy removed), its conversion reports progress to the callbacks (a stall
        # watchdog's sign that it advances), from a heartbeat every 0.05 s
        import shutil
        from unittest import mock

        from ascender_dist.training import checkpoint as ckpt

        shutil.rmtree(trainer.derived.checkpoint_dir / f"{tag_for_step(3)}{ckpt.UNIVERSAL}", ignore_errors=True)
        recorder.calls.clear()
        with mock.patch.object(ckpt, "UNIVERSAL_HEARTBEAT_S", 0.05):
            value["rolled_back"] = trainer.resume(tag_for_step(3))
        value["rollback_progress"] = sum(1 for name, _step in recorder.calls if name == "on_progress")
        value["rolled_back_step"] = trainer.step
        value["rolled_back_reads_universal"] = trainer.engine.load_universal_checkpoint()
        return value

    def refused(stage):
        from ascender_dist.config.errors import ConfigError

        try:
            _trainer(data, root / f"dpchange_z{stage}", parallel={"zero_stage": stage}, train={"train_steps": 6})
        except ConfigError as exc:
            return str(exc)
        return None

    checks = {f"resume_dp1_zero{stage}": (lambda stage=stage: leg(stage)) for stage in DP_CHANGE_STAGES if stage != 3}
    checks["resume_dp1_zero3_refused"] = lambda: refused(3)
    return run_checks(checks)


# resumed at another data-parallel size under tensor parallelism: DeepSpeed's universal conversion of
# TP-sharded optimizer state (training/run.py allows it; only ZeRO-3 and pipelines are refused)
TP_DP_CHANGE = {"gpt_zero1": ({}, 1), "gpt_zero2": ({}, 2),
                "ascender_zero1": ({"architecture": "ascender", "add_bias_linear": False,
                                    "ascender": {"d_z": 4, "d_a": 4, "k": 8, "window": 8, "num_global": 0,
                                                 "chunk_size": 8, "omega_init": 0.5}}, 1)}


def _tp_dp_sections(name: str) -> dict:
    model, stage = TP_DP_CHANGE[name]
    return {"model": model, "parallel": {"tensor_model_parallel_size": 2, "zero_stage": stage},
            "train": {"train_steps": 6}}


def tp2_dp2_legs(args):
    """World 4 (TP2 x DP2): per case, a straight 6-step run and a 3-step run a TP2 x DP1 job resumes."""
    data, root = args["data"], Path(args["root"])

    def leg(name):
        straight = _trainer(data, root / f"tpdp_straight_{name}", **_tp_dp_sections(name)).fit()
        _trainer(data, root / f"tpdp_{name}", **_tp_dp_sections(name)).fit(stop_at=3)
        return {"straight": straight}

    return run_checks({name: (lambda name=name: leg(name)) for name in TP_DP_CHANGE})


def resume_at_tp2_dp1(args):
    """World 2 (TP2 x DP1): resume the TP2 x DP2 checkpoints and finish the runs."""
    data, root = args["data"], Path(args["root"])

    def leg(name):
        trainer = _trainer(data, root / f"tpdp_{name}", **_tp_dp_sections(name))
        start = trainer.step
        return {"start": start, "universal": trainer.engine.load_universal_checkpoint(), "losses": trainer.fit()}

    return run_checks({name: (lambda name=name: leg(name)) for name in TP_DP_CHANGE})
