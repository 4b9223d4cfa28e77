"""``python -m ascender_dist.research.ablate``: the same as ``ascender-dist ablate``."""

import sys

from .main import ablate_main

sys.exit(ablate_main())
