"""Script the `deepspeed` launcher starts when a command re-launches itself on several ranks
(``ascender-dist consolidate`` / ``reshard``). The ``__main__`` guard matters: dist-checkpointing
starts a spawn-mode multiprocessing Manager that re-imports the main module."""

import os
import sys


def hide_gpus_for_cpu_ranks(environ=os.environ) -> None:
    """The re-launched ranks convert on CPU (DS_ACCELERATOR=cpu: as many ranks as the source run
    had, whatever GPUs this host has). DeepSpeed's CPU accelerator still sets CUDA_VISIBLE_DEVICES
    to 0..N-1 for every rank, and torch would then pick NCCL and one GPU per rank (failing past the
    host's GPU count): hide the GPUs before torch is imported."""
    if environ.get("DS_ACCELERATOR") == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""


if __name__ == "__main__":
    hide_gpus_for_cpu_ranks()
    from ascender_dist.cli import main

    sys.exit(main())
