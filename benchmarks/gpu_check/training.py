"""Sections ``training`` (one rank: tokens/s and MFU per architecture) and ``nccl`` (two ranks, data parallel).

Both train through the real trainer with ``benchmarks/scaling.py``'s worker (``Trainer(cfg).fit()`` on the
project's tiny dataset, the model from a preset, one launch per section through ``tests.helpers.multiproc``,
which sets the variables the ``deepspeed`` launcher sets). Tokens/s: global batch x sequence length over
the median step time after the warm-up steps (``scaling.summarise_point``). MFU: the trainer's FLOPs per
token (``models/counting.py``) through ``training/metrics.py``'s ``throughput`` and datasheet peak; on
CPU there is no peak, so no MFU.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from benchmarks.gpu_check.plan import Budget, Plan
from benchmarks.scaling import ARCHS, launch, summarise_point, throughput_jobs

log = logging.getLogger("gpu_check")
WORKER = "benchmarks.gpu_check.training:rank_worker"


def rank_worker(args: dict) -> dict:
    """``scaling.throughput_worker`` plus what this rank ran on: backend, world size, device, peak memory."""
    import torch
    import torch.distributed as dist

    from benchmarks.scaling import throughput_worker

    jobs = throughput_worker(args)
    cuda = torch.cuda.is_available()
    return {"jobs": jobs, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def _env(plan: Plan) -> dict:
    # run_ranks defaults DS_ACCELERATOR to cpu; the dry run hides any GPU so that it claims none
    return {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if plan.dry_run else {"DS_ACCELERATOR": "cuda"}


def _dataset(plan: Plan, work: Path, seq: int) -> dict:
    from tests.helpers.data import make_tiny_dataset

    return make_tiny_dataset(work / f"data{seq}", seq_length=seq, corpus_bytes=plan.corpus_bytes)


def _jobs(plan: Plan, preset: str, archs, layout: str, world: int, steps: int, micro: int, global_batch: int,
          seq: int) -> list[dict]:
    model = {"seq_length": seq, **({"vocab_size": plan.vocab_size} if plan.vocab_size else {})}
    jobs = throughput_jobs(preset, archs, [layout], steps, micro, global_batch, seq, model)[world]
    for job in jobs:
        job["sections"] = {"train": {"precision": plan.precision}}
    return jobs


def summarise(res: list[dict], jobs: list[dict], warmup: int, plan: Plan) -> list[dict]:
    """Per job: tokens/s (slowest rank per step, median after warm-up), TFLOP/s per device and MFU."""
    from ascender_dist.training.metrics import peak_tflops_per_device, throughput

    peak = peak_tflops_per_device(None) if plan.device == "cuda" else None
    rows = []
    for job in jobs:
        runs = [r["jobs"][job["key"]] for r in res]
        point = summarise_point(runs, warmup, job["seq"], job["global"])
        world = res[0]["world_size"]
        flops = runs[0]["flops_per_token"]
        tput = throughput(flops, point["tokens_per_s"], world, peak)
        losses = runs[-1]["losses"]
        rows.append({"arch": job["arch"], "preset": job["preset"], "layout": job["layout"], "world": world,
                     "seq_length": job["seq"], "global_batch": job["global"], "micro_batch": job["micro"],
                     "precision": plan.precision, "vocab_size": runs[0]["padded_vocab_size"],
                     "steps": len(point["step_s_all"]),
                     "measured_steps": point["measured_steps"], "step_s": point["step_s"],
                     "step_s_p25": point["step_s_p25"], "step_s_p75": point["step_s_p75"],
                     "tokens_per_s": point["tokens_per_s"], "params": point["params_rank0"],
                     "flops_per_token": flops, "tflops_per_device": tput["train/tflops_per_device"],
                     "mfu": tput.get("train/mfu"), "peak_tflops": peak, "loss_first": losses[0] if losses else None,
                     "loss_last": losses[-1] if losses else None,
                     "losses_finite": bool(losses) and all(math.isfinite(x) for x in losses)})
    return rows


def _train(plan: Plan, work: Path, budget: Budget, name: str, jobs: list[dict], world: int, seq: int,
           warmup: int) -> dict:
    data = {str(seq): _dataset(plan, work, seq)}
    log.info("[%s] dataset ready (%.0f s); launching %d rank(s): %s", name, budget.used(), world,
             ", ".join(j["key"] for j in jobs))
    res, info = launch(WORKER, world, {"jobs": jobs, "data": data, "root": str(work / f"runs_{name}")},
                       env=_env(plan), timeout=max(budget.left(), 1))
    rows = summarise(res, jobs, warmup, plan)
    for r in rows:
        log.info("[%s] %s %s: %.0f tokens/s, %.3g TFLOP/s per device, MFU %s, loss %.3f -> %.3f", name, r["arch"],
                 r["layout"], r["tokens_per_s"], r["tflops_per_device"],
                 "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}", r["loss_first"], r["loss_last"])
    bad = [r["arch"] for r in rows if not r["losses_finite"]]
    return {"status": f"failed: non-finite loss ({', '.join(bad)})" if bad else "ok", "rows": rows,
            "backend": res[0]["backend"], "devices": [r["device"] for r in res],
            "max_memory_allocated_mib": [r["max_memory_allocated_mib"] for r in res],
            "launch_seconds": info["seconds"]}


def run_training(plan: Plan, work: Path, budget: Budget) -> dict:
    jobs = _jobs(plan, plan.train_preset, ARCHS, "1 rank", 1, plan.train_steps, plan.micro_batch,
                 plan.global_batch, plan.train_seq)
    return _train(plan, work, budget, "training", jobs, 1, plan.train_seq, plan.train_warmup)


def run_nccl(plan: Plan, work: Path, budget: Budget) -> dict:
    """Two ranks, data parallel (ZeRO-1), gpt and ascender; on a GPU host only when two GPUs exist."""
    if not plan.dry_run:
        import torch

        if torch.cuda.device_count() < 2:
            return {"status": f"skipped: 2-rank NCCL run needs 2 GPUs, this machine has {torch.cuda.device_count()}"}
    jobs = _jobs(plan, plan.nccl_preset, ("gpt", "ascender"), "DP2", 2, plan.nccl_steps, 1, 2 * 2, plan.nccl_seq)
    result = _train(plan, work, budget, "nccl", jobs, 2, plan.nccl_seq, 1)
    expected = "gloo" if plan.dry_run else "nccl"
    if result["status"] == "ok" and result["backend"] != expected:
        result["status"] = f"failed: process group backend is {result['backend']}, expected {expected}"
    return result


def markdown(result: dict) -> list[str]:
    if "rows" not in result:
        return []
    r0 = result["rows"][0]
    peak = r0["peak_tflops"]
    against = f"{peak:g} TFLOP/s (dense bf16 datasheet peak)" if peak else "no peak (CPU: no MFU)"
    lines = [f"Trainer runs on {r0['world']} rank(s) ({result['backend']}; {', '.join(result['devices'])}), "
             f"{r0['precision']}, ZeRO-1, {r0['global_batch']} x {r0['seq_length']} tokens per step (micro batch "
             f"{r0['micro_batch']}), vocabulary {r0['vocab_size']} (padded), median step time after the warm-up "
             f"steps (p25-p75 in brackets). FLOPs/token: `models/counting.py`; MFU against {against}.", "",
             "| architecture | preset | layout | params | measured steps | step s | tokens/s | FLOPs/token "
             "| TFLOP/s per device | MFU | loss first -> last |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['arch']} | {r['preset']} | {r['layout']} | {r['params'] / 1e6:.1f} M | "
                     f"{r['measured_steps']} | {r['step_s']:.4f} ({r['step_s_p25']:.4f}-{r['step_s_p75']:.4f}) | "
                     f"{r['tokens_per_s']:,.0f} | {r['flops_per_token']:.3g} | {r['tflops_per_device']:.3g} | {mfu} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    mem = [m for m in result.get("max_memory_allocated_mib", []) if m is not None]
    if mem:
        per_rank = ", ".join(f"{m:,.0f}" for m in mem)
        lines += ["", f"Peak CUDA memory allocated per rank over the launch: {per_rank} MiB."]
    return lines
