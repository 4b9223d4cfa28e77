"""Training-loop checks on 2 real ranks (DP=2): exact resume under each ZeRO stage, checkpoint files."""

from pathlib import Path

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks


def _trainer(data, out: Path, **sections):
    from ascender_dist.training.trainer import Trainer

    return Trainer(config_from_dict(tiny_run_config(data, out, **sections)))


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
    straight = _trainer(data, root / f"dpchange_straight_z{zero_stage}", **sections).fit()
    _trainer(data, root / f"dpchange_z{zero_stage}", **sections).fit(stop_at=n)
    return {"straight": straight}


DP_CHANGE_STAGES = (1, 2)


def main(args):
    data, root = args["data"], Path(args["root"])
    checks = {f"resume_zero{stage}": (lambda stage=stage: resume_matches_straight_run(data, root, stage))
              for stage in (0, 1, 2, 3)}
    checks.update({f"dp2_leg_zero{stage}": (lambda stage=stage: dp2_leg(data, root, stage))
                   for stage in DP_CHANGE_STAGES})
    return run_checks(checks)


def resume_at_dp1(args):
    """World size 1: resume the DP=2 checkpoints and finish the run."""
    data, root = args["data"], Path(args["root"])

    def leg(stage):
        trainer = _trainer(data, root / f"dpchange_z{stage}", parallel={"zero_stage": stage},
                           train={"train_steps": 6})
        start = trainer.step
        return {"start": start, "losses": trainer.fit()}

    return run_checks({f"resume_dp1_zero{stage}": (lambda stage=stage: leg(stage)) for stage in DP_CHANGE_STAGES})
