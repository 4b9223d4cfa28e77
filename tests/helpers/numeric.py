"""Reductions for test results that keep a NaN: Python's ``max`` compares with ``>``, which is False
for NaN, so ``max([0.0, nan])`` is 0.0 and a NaN anywhere but first would pass a ``< tolerance`` or
``== 0.0`` check."""

from __future__ import annotations

import math
from typing import Iterable


def nan_max(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is NaN (ValueError when empty, as ``max``)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("nan_max() of an empty sequence")
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def worst_key(diffs: dict) -> str:
    """The key of the largest value of ``diffs``, a NaN one first."""
    return max(diffs, key=lambda k: (math.isnan(diffs[k]), diffs[k] if not math.isnan(diffs[k]) else 0.0))
