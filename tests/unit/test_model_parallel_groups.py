"""Ending megatron's model-parallel groups frees them.

megatron-core's destroy_model_parallel only forgets its groups; torch keeps each registered, and
every gloo group keeps three threads that wake on their own. A process that builds many layouts
(the unit tests, a conversion) piled up thousands of them and spent its cores waking them.
"""

import os

import pytest

from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_destroy_model_parallel_ends_the_groups_an_init_made(single_rank_group):
    import torch.distributed as dist

    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel

    if dist.get_backend() != "gloo":
        pytest.skip("counts gloo's threads; this process group is NCCL (a GPU machine)")
    destroy_model_parallel()
    before = _threads()
    init_model_parallel(1, 1, seed=1)
    per_init = _threads() - before
    assert per_init >= 30, per_init  # megatron makes ~18 groups at 1 rank: the count sees them
    destroy_model_parallel()
    for _ in range(3):
        init_model_parallel(1, 1, seed=1)
        destroy_model_parallel()
    assert _threads() - before < per_init // 2, f"{_threads() - before} threads left after 4 inits"
    init_model_parallel(1, 1, seed=1)  # the default group still works and a new layout builds
    assert dist.get_world_size() == 1
    destroy_model_parallel()
