"""How many decoded shards the streaming loader keeps: bounded by the shards one shuffle block can
span, whatever the shard sizes (a writer's short tail shard must not inflate it)."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.loader import shards_one_block_spans


def _most_shards_a_window_touches(counts: np.ndarray, block: int, orders) -> int:
    """Brute force: every window of ``block`` consecutive samples in each shard order."""
    most = 0
    for order in orders:
        owner = np.repeat(np.arange(len(counts)), counts[order])  # [samples]: the shard of each
        for start in range(max(1, len(owner) - block + 1)):
            most = max(most, len(np.unique(owner[start : start + block])))
    return most


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_holds_for_every_window_and_order_and_is_reached(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 9, size=int(rng.integers(2, 7)))
    block = int(rng.integers(1, 25))
    orders = [rng.permutation(len(counts)) for _ in range(20)] + [np.argsort(counts)]
    bound = shards_one_block_spans(counts, block)
    assert _most_shards_a_window_touches(counts, block, orders) <= bound
    # reached: the smallest shards in a row, the window starting on the last sample of another
    order = np.argsort(counts)
    first = order[-1] if len(counts) > 1 else order[0]
    rest = [k for k in order if k != first]
    assert _most_shards_a_window_touches(counts, block, [np.array([first, *rest])]) >= min(bound, len(counts)) - 1


def test_a_short_tail_shard_does_not_inflate_the_cache():
    counts = np.array([13_106] * 99 + [10])  # 64 MiB shards at seq 2048 and the writer's tail
    # a window can hold the tail and touch a big shard on each side: 3, not ceil(8192 / 10) + 1 = 821
    assert shards_one_block_spans(counts, 8192) == 3
    assert shards_one_block_spans(np.array([4] * 100 + [1]), 40) == 12
