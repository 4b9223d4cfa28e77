"""Script the `deepspeed` launcher starts on every rank: `deepspeed ... launch/train.py --config X`.

The `__main__` guard matters: megatron's dist_checkpointing starts a spawn-mode multiprocessing
Manager, which re-imports this file; without the guard training would start again in it.
CPU ranks on a host with GPUs (the demo's DS_ACCELERATOR=cpu) hide the GPUs before torch is
imported: DeepSpeed's CPU accelerator still gives each rank a CUDA_VISIBLE_DEVICES.
"""

import sys

from ascender_dist.launch_entry import hide_gpus_for_cpu_ranks

if __name__ == "__main__":
    hide_gpus_for_cpu_ranks()
    from ascender_dist.cli import train_main

    sys.exit(train_main())
