"""Script the `deepspeed` launcher starts on every rank: `deepspeed ... launch/train.py --config X`.

The `__main__` guard matters: megatron's dist_checkpointing starts a spawn-mode multiprocessing
Manager, which re-imports this file; without the guard training would start again in it.
"""

import sys

from ascender_dist.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
