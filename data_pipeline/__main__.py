"""``python -m data_pipeline ...`` runs the ``data-pipeline`` command line."""

import sys

from .cli import main

sys.exit(main())
