"""bf16 runs (2 ranks, DP2): whole-model weights leave and enter through the ZeRO optimizer's fp32
master copies, not through the bf16-rounded parameters."""

from pathlib import Path

import torch
import torch.distributed as dist

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks
from tests.helpers.numeric import nan_max


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
        out["gathered_vs_masters"] = nan_max((state[k] - v).abs().max().item() for k, v in masters.items())
        out["off_grid"] = _off_bf16_grid(state)
    loaded = _trainer(args, f"loaded_z{zero_stage}", zero_stage, checkpoint={"init_from": str(path)})
    file = read_weights_file(path)
    after = _masters(loaded)
    out["loaded_masters_vs_file"] = nan_max((after[k] - file[k].float()).abs().max().item() for k in file)
    out["params_are_bf16"] = all(p.dtype == torch.bfloat16 for p in loaded.engine.module.parameters())
    return out


def reduction_error(zero_stage: int, reduce_dtype: str, accumulation: int = 4) -> float:
    """The data-parallel gradient of a bf16 run, accumulated over micro-batches and reduced over the
    ranks with the DeepSpeed config this package writes, against the float64 mean of the same bf16
    per-micro-batch gradients: the largest relative error. The optimizer is SGD with lr 1 so the
    fp32 masters move by exactly the reduced gradient (the only place it is readable at every stage);
    input magnitudes grow over the micro-batches, so a bf16 rounding of the sums shows."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from ascender_dist.config.resolve import derive
    from ascender_dist.parallel.setup import init_process_group
    from ascender_dist.training.deepspeed_config import to_deepspeed_config

    init_process_group()  # a no-op after a Trainer made it
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config_from_dict({"model": {"vocab_size": 128}, "parallel": {"zero_stage": zero_stage},
                            "train": {"precision": "bf16", "grad_reduce_dtype": reduce_dtype, "micro_batch_size": 1,
                                      "global_batch_size": accumulation * world}})
    ds = to_deepspeed_config(cfg, derive(cfg, world_size=world))
    ds.update(optimizer={"type": "SGD", "params": {"lr": 1.0}}, gradient_clipping=0.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 1, bias=False)
    reference_model = torch.nn.Linear(256, 1, bias=False).to(torch.bfloat16)
    reference_model.load_state_dict(model.state_dict())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds,
                                      dist_init_required=False)
    weight = next(engine.module.parameters())
    before = safe_get_full_fp32_param(weight).double().clone()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(world, 1, 256, generator=g).to(torch.bfloat16) * (1 + 10 * k) for k in range(accumulation)]
    want = torch.zeros(256, dtype=torch.float64)
    for x in inputs:
        engine.backward(engine(x[rank]).float().sum())
        engine.step()
        for r in range(world):  # every rank's micro-batch gradient, in bf16 as the model computes it
            reference_model.zero_grad()
            reference_model(x[r]).float().sum().backward()
            want += reference_model.weight.grad.double().view(-1)
    want /= accumulation * world
    got = (before - safe_get_full_fp32_param(weight).double()).view(-1)
    return ((got - want).abs().max() / want.abs().max()).item()


def main(args):
    checks = {f"zero{z}": (lambda z=z: save_then_load(args, z)) for z in (1, 2, 3)}
    for z in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            checks[f"reduce_z{z}_{dtype}"] = lambda z=z, dtype=dtype: reduction_error(z, dtype)
    return run_checks(checks)



