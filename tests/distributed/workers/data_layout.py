"""4 ranks, TP=2 x DP=2: what each rank's data loader yields, as the trainer builds it."""

import torch
import torch.distributed as dist

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks

STEPS = 3


def loader_config(args):
    return config_from_dict(tiny_run_config(args["data"], args["root"], parallel={"tensor_model_parallel_size": 2}))


def _batches(args) -> dict:
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group
    from ascender_dist.training.run import build_loader, load_tokenizer

    init_process_group()
    cfg = loader_config(args)
    pstate = init_model_parallel(2, 1, seed=1)
    it = iter(build_loader(cfg, load_tokenizer(cfg), pstate))
    per_step = cfg.train.global_batch_size // (cfg.train.micro_batch_size * pstate.dp_size)
    mine = torch.cat([next(it)["tokens"] for _ in range(STEPS * per_step)])  # [STEPS * G / dp, s+1]
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {"tp_rank": pstate.tp_rank, "dp_rank": pstate.dp_rank, "samples": [t.tolist() for t in everyone]}


def main(args):
    return run_checks({"tp2_dp2_batches": lambda: _batches(args)})
