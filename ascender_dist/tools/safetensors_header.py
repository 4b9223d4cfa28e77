"""What a safetensors file holds, read from its header alone: the check every reader of an export or a
consolidated directory runs before a library loads the weights, so a truncated or corrupt file is one
line naming it, not a SafetensorError traceback from deep inside transformers."""

from __future__ import annotations

import math
from pathlib import Path


class UnreadableWeights(ValueError):
    """A safetensors file whose header cannot be read; ``str(e)`` is one line naming the file."""


def stored_parameters(weights: Path) -> int:
    """The number of values the tensors of ``weights`` hold, from its header."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except (SafetensorError, OSError) as exc:
        raise UnreadableWeights(f"{weights}: unreadable safetensors file, truncated or corrupt "
                                f"({' '.join(str(exc).split())})") from None


def export_parameters(export: Path) -> int:
    """The values every ``*.safetensors`` file of the directory ``export`` holds (each header checked)."""
    return sum(stored_parameters(weights) for weights in sorted(Path(export).glob("*.safetensors")))
