"""Train tiny models in given layouts (2 ranks) so conversion tests have real checkpoints."""

from pathlib import Path

from ascender_dist.config.resolve import config_from_dict
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks

LLAMA_LIKE = {"normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False, "num_query_groups": 2}
# a RoPE base other than the default: an export that drops it still loads, with other logits
GPT_TP2 = {"model": {"rotary_base": 500000}, "parallel": {"tensor_model_parallel_size": 2}}


def _train(args, name: str, steps: int, **sections):
    from ascender_dist.training.trainer import Trainer

    cfg = config_from_dict(tiny_run_config(args["data"], Path(args["root"]) / name, train={"train_steps": steps},
                                           **sections))
    return Trainer(cfg).fit()


def train_sources(args):
    return run_checks({
        "gpt_tp2": lambda: _train(args, "gpt_tp2", 3, **GPT_TP2),
        "llama_pp2": lambda: _train(args, "llama_pp2", 3, model=LLAMA_LIKE,
                                    parallel={"pipeline_model_parallel_size": 2}),
    })


def continue_resharded(args):
    """Resume the resharded checkpoint (TP=1, PP=2 now) for 2 more steps."""
    from ascender_dist.training.trainer import Trainer

    cfg = config_from_dict(tiny_run_config(
        args["data"], Path(args["root"]) / "resharded_run", train={"train_steps": 5}, model=GPT_TP2["model"],
        parallel={"pipeline_model_parallel_size": 2}, checkpoint={"dir": args["resharded"]}))

    def run(cfg):
        from tests.distributed.workers.lr_schedule import _record_lrs

        trainer = Trainer(cfg)
        start, used = trainer.step, _record_lrs(trainer)
        losses = trainer.fit()
        return {"start": start, "losses": losses, "lrs": sorted({(step, lrs[0]) for step, lrs in used})}

    def run_original():
        """The source run (TP=2) resumed from a copy of its own checkpoint: its first loss is that of
        the same weights on the same batch, the number the resharded run's first loss must equal."""
        import shutil

        import torch.distributed as dist

        copy = Path(args["root"]) / "gpt_tp2_continued"
        if dist.get_rank() == 0:
            shutil.copytree(Path(args["root"]) / "gpt_tp2" / "checkpoints", copy / "checkpoints")
        dist.barrier()
        return run(config_from_dict(tiny_run_config(args["data"], copy, train={"train_steps": 5}, **GPT_TP2)))

    return run_checks({"resume_resharded": lambda: run(cfg), "resume_original": run_original})


def train_connection(args):
    return run_checks({"connection": lambda: _train(
        args, "connection", 2, model={"architecture": "connection", "num_layers": 4,
                                      "connection": {"num_slots": 4, "rank": 4, "max_steps": 3,
                                                     "causal_chunk_size": 8}})})
