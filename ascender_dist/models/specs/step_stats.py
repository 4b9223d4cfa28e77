"""Per-layer statistics over all forwards of one optimizer step (every micro-batch, and a
recomputed forward again), for the protocol of :mod:`ascender_dist.training.layer_stats`."""

from __future__ import annotations

import torch


def is_max_stat(name: str) -> bool:
    """Statistics named ``*_max`` combine by maximum; every other one by mean."""
    return name.endswith("_max")


def accumulate_stats(previous: dict, new: dict, forwards: int) -> dict:
    """``previous`` (over ``forwards`` forwards) combined with one more forward's ``new``: a running
    mean per entry, or the maximum for ``*_max`` statistics. Every micro-batch holds the same number
    of tokens, so the mean over forwards is the mean over the step's tokens."""
    if not previous:
        return {key: value.detach().clone() for key, value in new.items()}
    out = {}
    for key, value in new.items():
        old = previous[key]
        out[key] = torch.maximum(old, value.detach()) if is_max_stat(key) else old + (value.detach() - old) / (forwards + 1)
    return out
