"""One error line per job on 2 real ranks: an error only rank 1 sees while rank 0 waits in a
collective, and an unexpected exception on rank 0 while rank 1 waits; each rank's stderr goes to
``<root>/<case>.rank<R>.err`` for the test to read."""

import os
import sys
from pathlib import Path

import torch.distributed as dist


def _stderr_to(path: Path) -> None:
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def user_error_on_rank1(args):
    from ascender_dist.cli import _run
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.parallel.setup import init_process_group

    rank = int(os.environ["RANK"])
    _stderr_to(Path(args["root"]) / f"user.rank{rank}.err")

    def body():
        init_process_group(1)
        if rank == 1:
            raise ConfigError("data.manifest", "only rank 1 reads this")
        dist.barrier()  # rank 0 waits for a peer that has failed

    return {"status": _run(body)}


def bug_on_rank0(args):
    from ascender_dist.cli import _run
    from ascender_dist.parallel.setup import init_process_group

    rank = int(os.environ["RANK"])
    _stderr_to(Path(args["root"]) / f"bug.rank{rank}.err")

    def body():
        init_process_group(1)
        if rank == 0:
            raise ZeroDivisionError("a bug, not a user error")
        dist.barrier()

    return {"status": _run(body)}


def read_a_hanging_pipe() -> None:
    """Stands for a shard read that never returns (a pipe: URL's command that hangs)."""
    import time

    time.sleep(600)


def stall_on_rank1(args):
    """Rank 1 blocks outside any collective after step 2 while rank 0 goes on into step 3's
    collectives and waits there: rank 1's stall watchdog (train.stall_timeout_minutes) ends the job."""
    from ascender_dist.cli import _run
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.training.callbacks import Callback
    from ascender_dist.training.trainer import Trainer
    from tests.helpers.data import tiny_run_config

    rank = int(os.environ["RANK"])
    root = Path(args["root"])
    _stderr_to(root / f"stall.rank{rank}.err")

    class HangingRead(Callback):
        def on_step_end(self, trainer, values):
            if rank == 1 and trainer.step == 2:
                read_a_hanging_pipe()

    def body():
        train = {"train_steps": 50, "stall_timeout_minutes": args["stall_timeout_minutes"]}
        Trainer(config_from_dict(tiny_run_config(args["data"], root / "stall", train=train)),
                callbacks=[HangingRead()]).fit()

    return {"status": _run(body)}
