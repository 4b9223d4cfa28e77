"""Running a grid: one training process per (variant, seed), resumable; the child that trains one run."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np
import yaml


from .collect import _load_record
from .grid import RESULT, AblationError, Grid, Variant, run_config, run_dir



# ============================================================================ one run (child process)

def _status_kib(name: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
        return True
    except OSError:
        return False


def _ascender_omegas(model) -> dict:
    """{layer number: [[omega_align, omega_sep, omega_coh] per head]} of every ASCender layer."""
    out = {}
    for module in model.modules():
        if type(module).__name__ == "AscenderCoreAttention":
            out[str(int(module.layer_number))] = module.params.omega.detach().float().cpu().tolist()
    return out


def run_one(config_path: Path, result_path: Path, eval_iters: Union[int, str, None] = None) -> dict:
    """Train one run (this process is rank 0 of 1) and write its result JSON atomically."""
    import resource

    import torch

    from ascender_dist.config import load_config
    from ascender_dist.models.counting import count_model
    from ascender_dist.training.trainer import Trainer, build_loader

    cfg = load_config(config_path)
    t_start = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t_start
    if trainer.step:
        raise AblationError(f"{cfg.output_dir}: resumed at step {trainer.step}; an ablation run must start fresh")
    step_times: list[float] = []
    original_step = trainer.train_step

    def timed_step(batches, log_layers=False):
        start = time.perf_counter()
        values = original_step(batches, log_layers=log_layers)
        step_times.append(time.perf_counter() - start)
        return values

    digest = hashlib.sha256()
    original_batches = trainer._batches

    def hashed_batches():
        def gen(it):
            for item in it:
                if isinstance(item, dict):
                    digest.update(item["tokens"].numpy().tobytes())
                yield item
        return gen(original_batches())

    trainer.train_step = timed_step
    trainer._batches = hashed_batches
    rss_before = _status_kib("VmRSS")
    peak_resettable = _reset_peak_rss()
    t_fit = time.perf_counter()
    losses = trainer.fit()
    fit_s = time.perf_counter() - t_fit
    train_peak = _status_kib("VmHWM")

    # final validation: Trainer.validate over eval_iters batches, per-sequence losses from a hook
    if trainer.val_loader is None:
        trainer.val_loader = build_loader(cfg, trainer.tokenizer, trainer.pstate, split="val")
    available = len(trainer.val_loader)
    iters = available if eval_iters == "all" else min(int(eval_iters or cfg.train.eval_iters), available)
    cfg.train.eval_iters = iters
    per_example: list[float] = []
    inner = trainer.engine.module.model
    hook = inner.register_forward_hook(
        lambda mod, args, out: per_example.extend(out.detach().float().mean(dim=1).cpu().tolist()))
    t_val = time.perf_counter()
    val_loss = trainer.validate()
    val_s = time.perf_counter() - t_val
    hook.remove()

    vocab = cfg.model.vocab_size or trainer.tokenizer.vocab_size
    counts = count_model(cfg, vocab)
    params = sum(p.numel() for p in {id(p): p for p in trainer.engine.module.parameters()}.values())
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    steady = step_times[2:] if len(step_times) > 3 else step_times
    median_step = float(np.median(steady)) if steady else float("nan")
    tail = max(1, len(losses) // 10)
    from ascender_dist.models.registry import expand_layer_pattern

    result = {
        "config": None, "seed": cfg.train.seed,  # filled by the parent (variant name)
        "name": cfg.name, "architecture": cfg.model.architecture, "layer_pattern": expand_layer_pattern(cfg),
        "val_loss": float(val_loss), "val_batches": iters, "val_sequences": len(per_example),
        "val_example_losses": per_example,
        "final_train_loss": float(np.mean(losses[-tail:])) if losses else None,
        "train_losses": [float(x) for x in losses],
        "steps": len(losses), "tokens": len(losses) * tokens_per_step,
        "step_time_s": step_times, "median_step_time_s": median_step,
        "tokens_per_s": tokens_per_step / median_step if steady else None,
        "tokens_per_s_mean": len(losses) * tokens_per_step / fit_s if fit_s > 0 else None,
        "params": int(params), "params_analytic": int(counts.total_params),
        "non_embedding_params": int(counts.non_embedding_params),
        "flops_per_token": float(counts.flops_per_token),
        "training_flops": float(counts.flops_per_token) * len(losses) * tokens_per_step,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_peak_rss_delta_mib": ((train_peak - rss_before) / 1024
                                     if peak_resettable and train_peak and rss_before else None),
        "omega": _ascender_omegas(trainer.engine.module),
        "data_sha256": digest.hexdigest(),
        "setup_s": setup_s, "fit_s": fit_s, "val_s": val_s,
        "torch_threads": torch.get_num_threads(),
        "checkpoint_dir": str(trainer.derived.checkpoint_dir),
    }
    result_path = Path(result_path)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(result_path)
    return result


# ============================================================================ running the grid (parent)

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env(threads: int) -> dict:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": str(threads)}
    env.setdefault("DS_ACCELERATOR", "cpu")
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _last_error_line(log_file: Path) -> str:
    if not log_file.exists():
        return "(no log)"
    lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^(\w+\.)*\w*(Error|Exception)\b|^error:", line):
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"


def launch_run(grid: Grid, variant: Variant, seed: int, threads: int, timeout: Optional[float] = None) -> dict:
    """Run one (variant, seed) in a fresh process unless its result exists; return its record."""
    directory = run_dir(grid, variant, seed)
    result_file = directory / RESULT
    if result_file.exists():
        return _load_record(result_file, variant.name)
    if directory.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    cfg = run_config(grid, variant, seed)
    from ascender_dist.config.loader import to_dict

    (directory / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    cmd = [sys.executable, "-m", "ascender_dist.research.ablate", "--run-one", str(directory / "config.yaml"),
           "--result", str(result_file)]
    if grid.eval_iters is not None:
        cmd += ["--eval-iters", str(grid.eval_iters)]
    log_file = directory / "run.log"
    with open(log_file, "w") as out:
        proc = subprocess.run(cmd, env=_child_env(threads), stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not result_file.exists():
        raise AblationError(f"{log_file}: run {variant.name} seed {seed} failed (exit {proc.returncode}): "
                            f"{_last_error_line(log_file)}")
    record = _load_record(result_file, variant.name)
    if not grid.keep_checkpoints:
        shutil.rmtree(record.get("checkpoint_dir") or directory / "checkpoints", ignore_errors=True)
    return record


def run_grid(grid: Grid, jobs: Optional[int] = None, threads: Optional[int] = None, progress: bool = True) -> list[dict]:
    """Every (variant, seed) not yet done, ``jobs`` at a time, with a progress bar. Returns all records."""
    from tqdm import tqdm

    jobs = max(1, jobs or grid.jobs)
    threads = max(1, threads or grid.threads)
    todo = [(v, s) for s in grid.seeds for v in grid.variants]  # seed-major: early seeds complete first
    done = [(v, s) for v, s in todo if (run_dir(grid, v, s) / RESULT).exists()]
    pending = [t for t in todo if t not in done]
    bar = tqdm(total=len(todo), initial=len(done), unit="run", desc=f"ablate {grid.name}", disable=not progress)
    records = []
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(launch_run, grid, v, s, threads): (v, s) for v, s in pending}
            for future in concurrent.futures.as_completed(futures):
                v, s = futures[future]
                record = future.result()  # AblationError propagates (other runs finish first)
                bar.update(1)
                bar.set_postfix_str(f"{v.name} seed {s}: {grid.metric} {record.get(grid.metric, float('nan')):.4f}")
    finally:
        bar.close()
    for v, s in todo:
        records.append(_load_record(run_dir(grid, v, s) / RESULT, v.name))
    return records
