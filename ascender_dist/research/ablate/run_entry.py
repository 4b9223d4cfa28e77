"""Script the ``deepspeed`` launcher starts on every rank of one ablation run:
``deepspeed ... ascender_dist/research/ablate/run_entry.py --run-one CONFIG --result FILE``."""

import sys

from ascender_dist.research.ablate.main import ablate_main

if __name__ == "__main__":
    sys.exit(ablate_main())
