"""Script the `deepspeed` launcher starts when a command re-launches itself on several ranks
(``ascender-dist consolidate`` / ``reshard``). The ``__main__`` guard matters: dist-checkpointing
starts a spawn-mode multiprocessing Manager that re-imports the main module."""

import sys

from ascender_dist.cli import main

if __name__ == "__main__":
    sys.exit(main())
