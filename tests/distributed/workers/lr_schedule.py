"""The LR each optimizer step really used, recorded inside the optimizer that applies the update,
for several layouts and a resume that lengthens the run (2 ranks)."""

from pathlib import Path

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks


def _record_lrs(trainer) -> list:
    """Wrap the torch optimizer DeepSpeed steps (under ZeRO, inside its wrapper): each call appends
    [trainer step (1-based), lr of every param group]."""
    optimizer = trainer.engine.basic_optimizer
    step, used = optimizer.step, []

    def recording(*args, **kwargs):
        used.append([trainer.step + 1, [group["lr"] for group in optimizer.param_groups]])
        return step(*args, **kwargs)

    optimizer.step = recording
    return used


def _run(args, name: str, steps: int, **sections) -> dict:
    from ascender_dist.training.trainer import Trainer

    cfg = config_from_dict(tiny_run_config(args["data"], Path(args["root"]) / name,
                                           train={"train_steps": steps}, **sections))
    trainer = Trainer(cfg)
    start, used = trainer.step, _record_lrs(trainer)
    trainer.fit()
    return {"start": start, "used": used, "tensorboard": str(trainer.derived.tensorboard_dir)}


def main(args):
    cosine = {"optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "lr_schedule": "cosine"}}
    return run_checks({
        # global batch 16 = micro 4 x dp 2 x accumulation 2: the rate holds over the accumulation
        "cosine_6": lambda: _run(args, "cosine", 6, **cosine),
        "cosine_resumed_to_8": lambda: _run(args, "cosine", 8, **cosine),
        "zero_warmup_pp2": lambda: _run(args, "pp2", 3, parallel={"pipeline_model_parallel_size": 2},
                                        optimizer={"warmup_steps": 0, "lr_schedule": "cosine"}),
        "linear_zero3": lambda: _run(args, "zero3", 3, parallel={"zero_stage": 3},
                                     optimizer={"warmup_steps": 1, "lr_schedule": "linear"}),
        "constant_zero0": lambda: _run(args, "zero0", 3, parallel={"zero_stage": 0},
                                       optimizer={"warmup_steps": 2, "lr_schedule": "constant"}),
        "wsd_sqrt": lambda: _run(args, "wsd", 6, optimizer={"warmup_steps": 1, "lr_schedule": "wsd",
                                                            "wsd_decay_steps": 3, "wsd_decay_shape": "sqrt"}),
    })
