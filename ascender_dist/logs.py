"""One console logging format for every command line entry point (train, tools, research)."""

from __future__ import annotations

import logging
import warnings


def setup_cli_logging(level: int = logging.INFO) -> None:
    """Timestamped ``HH:MM:SS LEVEL logger: message`` lines on stderr."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def quiet_library_warnings() -> None:
    """Warnings a user can do nothing about: megatron-core's about missing Apex/Transformer Engine on
    every import (expected here), and torch's FutureWarning that DeepSpeed's ZeRO still calls the
    deprecated ``all_gather_into_tensor`` (printed by every rank of every run)."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated.*", category=FutureWarning)
