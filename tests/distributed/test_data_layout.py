"""Data sharding by DATA-parallel rank on 4 real ranks (TP=2 x DP=2)."""

import pytest
import torch

from tests.distributed.workers.data_layout import STEPS, loader_config
from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    args = {"data": make_tiny_dataset(tmp_path_factory.mktemp("data")), "root": str(tmp_path_factory.mktemp("run"))}
    return args, run_ranks("tests.distributed.workers.data_layout:main", world_size=4, timeout=300, args=args)


def test_tensor_parallel_peers_get_identical_batches_and_dp_ranks_split_the_global_batch(setup):
    from data_pipeline.loader import StreamingLoader

    args, results = setup
    values = assert_check(results, "tp2_dp2_batches")
    layout = [(v["tp_rank"], v["dp_rank"]) for v in values]
    assert layout == [(0, 0), (1, 0), (0, 1), (1, 1)]  # megatron's order: tensor-parallel fastest
    samples = [torch.tensor(s) for s in values[0]["samples"]]  # rank r's batches, gathered
    assert torch.equal(samples[0], samples[1]) and torch.equal(samples[2], samples[3])
    assert not torch.equal(samples[0], samples[2])

    # the two data-parallel slices of each step, concatenated, are the single-rank global batch
    cfg = loader_config(args)
    single = StreamingLoader(cfg.data.manifest, seq_length=cfg.model.seq_length,
                             micro_batch_size=cfg.train.micro_batch_size,
                             global_batch_size=cfg.train.global_batch_size, dp_rank=0, dp_size=1,
                             seed=cfg.train.seed)
    it = iter(single)
    half = cfg.train.global_batch_size // 2
    for step in range(STEPS):
        expected = torch.cat([next(it)["tokens"] for _ in range(cfg.train.global_batch_size // cfg.train.micro_batch_size)])
        got = torch.cat([samples[0][step * half:(step + 1) * half], samples[2][step * half:(step + 1) * half]])
        assert torch.equal(got, expected), f"step {step}"
