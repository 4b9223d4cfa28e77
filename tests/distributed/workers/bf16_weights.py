"""bf16 runs (2 ranks, DP2): whole-model weights leave and enter through the ZeRO optimizer's fp32
master copies, not through the bf16-rounded parameters."""

from pathlib import Path

import torch
import torch.distributed as dist

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks


def _trainer(args, name: str, zero_stage: int, **sections):
    from ascender_dist.training.trainer import Trainer

    cfg = config_from_dict(tiny_run_config(args["data"], Path(args["root"]) / name, parallel={"zero_stage": zero_stage},
                                           train={"train_steps": 3, "precision": "bf16"}, **sections))
    return Trainer(cfg)


def _masters(trainer) -> dict:
    """Canonical name -> the optimizer's fp32 master (full, TP=1). Collective over DP."""
    from deepspeed.utils import safe_get_full_fp32_param

    from ascender_dist.training.weights import _gathered, canonical_parameters

    named = list(canonical_parameters(trainer.engine.module, trainer.cfg))
    with _gathered([p for _, p in named], trainer.cfg.parallel.zero_stage):
        return {name: safe_get_full_fp32_param(p).float().clone() for name, p in named}


def _off_bf16_grid(state: dict) -> int:
    """How many values of ``state`` bf16 cannot represent (0 would make the checks vacuous)."""
    return sum(int((v != v.bfloat16().float()).sum()) for v in state.values())


def save_then_load(args, zero_stage: int) -> dict:
    """Train 3 bf16 steps; gather the weights (rank 0) and compare them with the masters; start a
    second run from them (checkpoint.init_from) and compare its masters with the file."""
    from ascender_dist.training.weights import gather_canonical_state, read_weights_file, write_weights_file

    trainer = _trainer(args, f"source_z{zero_stage}", zero_stage)
    trainer.fit()
    state = gather_canonical_state(trainer.engine.module, trainer.cfg)
    masters = _masters(trainer)
    path = Path(args["root"]) / f"weights_z{zero_stage}.safetensors"
    if dist.get_rank() == 0:
        write_weights_file(state, path)
    dist.barrier()
    out = {}
    if dist.get_rank() == 0:
        out["gathered_vs_masters"] = max((state[k] - v).abs().max().item() for k, v in masters.items())
        out["off_grid"] = _off_bf16_grid(state)
    loaded = _trainer(args, f"loaded_z{zero_stage}", zero_stage, checkpoint={"init_from": str(path)})
    file = read_weights_file(path)
    after = _masters(loaded)
    out["loaded_masters_vs_file"] = max((after[k] - file[k].float()).abs().max().item() for k in file)
    out["params_are_bf16"] = all(p.dtype == torch.bfloat16 for p in loaded.engine.module.parameters())
    return out


def main(args):
    return run_checks({f"zero{z}": (lambda z=z: save_then_load(args, z)) for z in (1, 2)})
