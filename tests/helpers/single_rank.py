"""A one-rank gloo process group inside the pytest process, for tests that build megatron models."""

from __future__ import annotations

import os

import pytest

from tests.helpers.multiproc import free_port


@pytest.fixture(scope="session")
def single_rank_group():
    import torch.distributed as dist

    from ascender_dist.parallel.setup import init_process_group

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        init_process_group()
    yield
