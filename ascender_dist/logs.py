"""One console logging format for every command line entry point (train, tools, research)."""

from __future__ import annotations

import logging


def setup_cli_logging(level: int = logging.INFO) -> None:
    """Timestamped ``HH:MM:SS LEVEL logger: message`` lines on stderr."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
