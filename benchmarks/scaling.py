"""Training throughput of the parallel layouts (1 rank, DP2, TP2, PP2) and checkpoint save/load time, on CPU.

Every layout trains through the real training loop, ``Trainer(cfg).fit()`` (megatron-core layers in
DeepSpeed's engine; DeepSpeed's pipeline engine for PP2), fp32 over gloo, on real processes started
by ``tests.helpers.multiproc.run_ranks`` (one process per rank, ``OMP_NUM_THREADS=1``, the same
environment variables the ``deepspeed`` launcher sets). One launch per world size runs every
(architecture, layout) of that world size one after another, so the 10-20 s import cost is paid
once per launch, not per point.

Throughput: the step time of a step is the slowest rank's (every layout synchronises each step);
the first ``--warmup`` steps are discarded, the median of the rest is reported as tokens/s =
global batch x seq length / step time. The global batch (sequences x length) is the same for every
layout; ratios are against the 1-rank run of the same invocation. ``--rounds`` alternates the
1-rank and 2-rank launches so slow drifts of the shared machine's load hit both alike. Each rank also
records its CPU seconds per step: the CPU cost of a layout (all ranks) over the 1-rank run's does not
depend on the share of the cores the machine's other jobs left, so it shows a layout's overhead
(communication, duplicated work) where the wall-clock ratio mostly shows the load.

gpt ``small`` (the preset's seq_length, 2048) runs only if a DP2 step, after its warm-up, costs < ``--small-max-step-s``
CPU seconds on every rank (and < twice that in wall time); otherwise it is reported as too slow.

Checkpoints: DP2 x ZeRO-1, one AdamW step (so the optimizer moments exist), then ``Trainer.save()``
and ``checkpoint.load_checkpoint(engine, ...)`` timed ``--ckpt-reps`` (>= 5) times each (median and minimum).

``--rounds`` and ``--ckpt-reps`` below 5 are refused (except by ``--quick``, which writes nothing).
scaling.json records the git commit and whether the tree was dirty (``provenance.git_state``), the
package versions, and the sha256 of every run config the benchmark built (``provenance.config_hash``,
with the temporary dataset paths replaced by the dataset they name) beside the datasets' manifest hashes.

    .venv/bin/python benchmarks/scaling.py            # ~11 min on 2 shared cores (5 if gpt small fails its gate)
    .venv/bin/python benchmarks/scaling.py --quick    # smoke run (gpt debug, few steps), nothing written
    .venv/bin/python benchmarks/scaling.py --render   # rewrite scaling.md/.png from scaling.json

Writes benchmarks/results/scaling.{md,json,png}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/scaling.py` from anywhere
    sys.path.insert(0, str(ROOT))

from ascender_dist.config.presets import MODEL_PRESETS  # noqa: E402
from ascender_dist.machine import cpu_model  # noqa: E402
from benchmarks.report import RESULTS, commit_text, publish  # noqa: E402

MIN_REPEATS = 5  # the project's floor for interleaved rounds and repeated timings

ARCHS = ("gpt", "ascender", "connection")
# layout name -> (world size, parallel section). ZeRO-1 everywhere (the project default and what the
# scaling configs use); with 2 ranks TP2 and PP2 have data-parallel size 1.
LAYOUTS = {
    "1 rank": (1, {"zero_stage": 1}),
    "DP2": (2, {"zero_stage": 1}),
    "TP2": (2, {"zero_stage": 1, "tensor_model_parallel_size": 2}),
    "PP2": (2, {"zero_stage": 1, "pipeline_model_parallel_size": 2}),
}
REFERENCE = "1 rank"


# ----------------------------------------------------------------------------- rank side


def make_config(job: dict, data: dict, out_dir: Path):
    """The run config of one point: the project's tiny test run with the model section replaced by a preset."""
    from ascender_dist.config.resolve import config_from_dict
    from tests.helpers.data import tiny_run_config

    raw = tiny_run_config(
        data, out_dir,
        parallel=job["parallel"],
        optimizer={"warmup_steps": min(2, job["steps"])},
        train={"micro_batch_size": job["micro"], "global_batch_size": job["global"], "train_steps": job["steps"],
               "seed": 1},
        checkpoint={"save_interval": 0, "keep_last": 100, "auto_resume": False},
        logging={"log_interval": 10**6, "tensorboard": False},  # no per-layer statistics, no event files
    )
    # tiny_run_config pins a 2-layer width-32 model; a preset's fields must not be overridden by it
    raw["model"] = {"architecture": job["arch"], "preset": job["preset"], **job.get("model", {})}
    for section, fields in job.get("sections", {}).items():  # e.g. {"train": {"precision": "bf16"}}
        raw[section] = {**raw.get(section, {}), **fields}
    return config_from_dict(raw)


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def throughput_worker(args: dict) -> dict:
    """Train every job of ``args['jobs']`` in turn; per job, per step: wall seconds and CPU seconds of this rank."""
    import torch.distributed as dist

    from ascender_dist.training.callbacks import Callback, Throughput
    from ascender_dist.training.trainer import Trainer

    class StepMarks(Callback):
        """Per logged step: its wall seconds, and this process's CPU and wall clocks when it was logged."""

        def __init__(self):
            self.marks = []

        def on_log(self, trainer, values):
            self.marks.append({"step_s": values["train/step_time_s"], "cpu": time.process_time(),
                               "wall": time.perf_counter(), "loss": values["train/loss"],
                               "skipped": values.get("train/step_skipped")})

    results = {}
    too_slow_groups = set()
    for job in args["jobs"]:
        if job.get("group") in too_slow_groups:
            results[job["key"]] = {"skipped": "group too slow"}
            continue
        cfg = make_config(job, args["data"][str(job["seq"])], Path(args["root"]) / job["key"].replace(" ", "_"))
        step_marks = StepMarks()
        trainer = Trainer(cfg, callbacks=[step_marks])
        marks = step_marks.marks
        dist.barrier()
        load_before = os.getloadavg()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        out = {"load_before": load_before}
        if job.get("max_step_s"):
            # gate, after the warm-up steps: a step must cost < max_step_s CPU seconds on every rank (what it
            # would take with the cores to ourselves; the wall clock depends on the other jobs of the moment)
            # and take < 2 x max_step_s of wall clock (so a very loaded machine cannot overrun the run's budget)
            trainer.fit(stop_at=job["gate_steps"], final_save=False)  # the save is measured separately
            slowest = _max_over_ranks(max(m["step_s"] for m in marks[1:]))
            cpu = _max_over_ranks(max(b["cpu"] - a["cpu"] for a, b in zip(marks, marks[1:])))
            out["gate_step_s"], out["gate_cpu_s"] = slowest, cpu
            if cpu > job["max_step_s"] or slowest > 2 * job["max_step_s"]:
                too_slow_groups.add(job.get("group"))
                out["too_slow"] = True
        if not out.get("too_slow"):
            trainer.fit(final_save=False)
        out.update({
            "step_s": [m["step_s"] for m in marks],
            # CPU seconds this process used during each step (all its threads), from consecutive marks
            "cpu_s": [b["cpu"] - a["cpu"] for a, b in zip([{"cpu": cpu0}] + marks[:-1], marks)],
            "wall_s": [b["wall"] - a["wall"] for a, b in zip([{"wall": wall0}] + marks[:-1], marks)],
            "losses": [m["loss"] for m in marks],
            "skipped_steps": sum(bool(m["skipped"]) for m in marks),
            "load_after": os.getloadavg(),
            "params_this_rank": sum(p.numel() for p in trainer.engine.module.parameters()),
            # models/counting.py, what the trainer's MFU uses (its Throughput callback holds it)
            "flops_per_token": next(c.flops_per_token for c in trainer.callbacks if isinstance(c, Throughput)),
            "padded_vocab_size": trainer.derived.padded_vocab_size,
            "grad_accum": trainer.derived.gradient_accumulation_steps,
        })
        results[job["key"]] = out
        del trainer, step_marks
        gc.collect()
        dist.barrier()
    return results


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def checkpoint_worker(args: dict) -> dict:
    """Per model: one training step at DP2 x ZeRO-1, then time Trainer.save() and load_checkpoint()."""
    import torch.distributed as dist

    from ascender_dist.training.checkpoint import load_checkpoint
    from ascender_dist.training.trainer import Trainer

    results = {}
    for job in args["jobs"]:
        cfg = make_config(job, args["data"][str(job["seq"])], Path(args["root"]) / f"ckpt_{job['key']}")
        trainer = Trainer(cfg)
        trainer.fit()  # one AdamW step (creates the moments), then fit's own save: an untimed warm-up save
        ckdir = trainer.derived.checkpoint_dir
        params = sum(p.numel() for p in trainer.engine.module.parameters())  # DP2: every rank holds all of them
        saves, loads = [], []
        tag = None
        for rep in range(args["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            tag = trainer.save(step=trainer.step + 1 + rep)  # a new tag each time (keep_last is high: no pruning)
            dist.barrier()
            saves.append(time.perf_counter() - t0)
        nbytes = _dir_bytes(ckdir / tag)
        for _ in range(args["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            load_checkpoint(trainer.engine, ckdir, tag)
            dist.barrier()
            loads.append(time.perf_counter() - t0)
        results[job["key"]] = {"params": params, "bytes": nbytes, "save_s": saves, "load_s": loads,
                               "files": sorted(str(p.relative_to(ckdir / tag)) for p in (ckdir / tag).rglob("*")
                                               if p.is_file()),
                               "load": os.getloadavg()}
        del trainer
        gc.collect()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckdir, ignore_errors=True)
        dist.barrier()
    return results


# ----------------------------------------------------------------------------- driver side


def _machine() -> dict:
    """CPU, cores, memory and library versions (benchmarks/gpu_check/machine.py records the same; the git
    state is added by the caller: ``provenance.git_state()`` here, the copier's word on a GPU host)."""
    import torch

    cpu = cpu_model()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    from ascender_dist.versions import package_versions

    return {"cpu_model": cpu, "cores": os.cpu_count(), "mem_gib": round(mem, 1), "torch": torch.__version__,
            "python": platform.python_version(),
            "versions": package_versions(("deepspeed", "megatron-core")),
            "gpu": torch.cuda.is_available()}


def config_hashes(jobs: list[dict], data: dict, datasets: dict | None = None) -> dict:
    """``{job key: config_hash}`` of the run config each job trains (``make_config``, as the ranks build it).
    The dataset paths (a fresh temporary directory per invocation) are replaced by ``datasets[seq]``, a
    name of the dataset they hold, so two invocations of the same settings hash alike."""
    from ascender_dist.config.loader import to_dict
    from ascender_dist.research.ablate.provenance import config_hash

    out = {}
    for job in jobs:
        cfg = to_dict(make_config(job, data[str(job["seq"])], Path("<work dir>") / job["key"].replace(" ", "_")))
        label = (datasets or {}).get(str(job["seq"]), f"tiny dataset, seq {job['seq']}")
        cfg["data"] = {**cfg["data"], "manifest": f"<{label}: manifest>", "tokenizer": f"<{label}: tokenizer>"}
        out[job["key"]] = config_hash(cfg)
    return out


def check_repeats(p: argparse.ArgumentParser, args) -> None:
    """p.error for fewer than MIN_REPEATS rounds or checkpoint repetitions, except in a --quick run (which
    writes nothing) and in the modes that measure nothing (--render, --summarise)."""
    if args.quick or args.render or args.summarise:
        return
    if args.rounds < MIN_REPEATS:
        p.error(f"--rounds must be >= {MIN_REPEATS} (median and minimum of at least {MIN_REPEATS} interleaved "
                "rounds); --quick for a smoke run")
    if args.ckpt_reps < MIN_REPEATS:
        p.error(f"--ckpt-reps must be >= {MIN_REPEATS} (median and minimum of at least {MIN_REPEATS} saves and "
                "loads); --quick for a smoke run")


def launch(target: str, world: int, args: dict, env: dict | None = None, timeout: float = 900.0) -> tuple[list, dict]:
    from tests.helpers.multiproc import run_ranks

    before = os.getloadavg()
    t0 = time.perf_counter()
    res = run_ranks(target, world_size=world, timeout=timeout, args=args, env=env)
    info = {"world": world, "seconds": time.perf_counter() - t0, "load_before": before, "load_after": os.getloadavg(),
            "env": env or {}}
    print(f"  launch {target.split(':')[1]} x{world} ({env or ''}): {info['seconds']:.0f} s, "
          f"load {before[0]:.2f} -> {info['load_after'][0]:.2f}", flush=True)
    return res, info


def throughput_jobs(preset: str, archs, layouts, steps: int, micro: int, global_batch: int, seq: int,
                    model: dict | None = None) -> dict[int, list]:
    """{world size: [job, ...]} for one preset."""
    by_world: dict[int, list] = {}
    for layout in layouts:
        world, parallel = LAYOUTS[layout]
        for arch in archs:
            job = {"key": f"{preset}/{arch}/{layout}", "preset": preset, "arch": arch, "layout": layout,
                   "parallel": parallel, "steps": steps, "micro": micro, "global": global_batch, "seq": seq,
                   "model": model or {}}
            by_world.setdefault(world, []).append(job)
    return by_world


def summarise_point(runs: list[dict], warmup: int, seq: int, global_batch: int) -> dict:
    """``runs``: one point's result on each rank. Step time = slowest rank per step; median after ``warmup``."""
    if any("skipped" in r for r in runs):
        return {"skipped": runs[0]["skipped"]}
    n = min(len(r["step_s"]) for r in runs)
    step = [max(r["step_s"][i] for r in runs) for i in range(n)]
    kept = step[warmup:]
    span = range(warmup, n) if n > warmup else range(n)  # a gated (too slow) point may have only warm-up steps
    cpu = [sum(r["cpu_s"][i] for i in span) / sum(r["wall_s"][i] for i in span)
           for r in runs]  # per rank: CPU seconds per wall second over the measured steps
    med = statistics.median(kept) if kept else None
    q = statistics.quantiles(kept, n=4) if len(kept) >= 2 else [med, med, med]
    return {"step_s_all": step, "measured_steps": len(kept), "step_s": med, "step_s_p25": q[0], "step_s_p75": q[2],
            "tokens_per_s": global_batch * seq / med if med else None, "cpu_per_wall": cpu,
            "too_slow": any(r.get("too_slow") for r in runs), "gate_step_s": runs[0].get("gate_step_s"),
            "gate_cpu_s": runs[0].get("gate_cpu_s"),
            "cpu_s_per_rank": [r["cpu_s"] for r in runs],
            # CPU seconds of all ranks together per step: the layout's work, whatever share of the cores it got
            "cpu_total_s": [sum(r["cpu_s"][i] for r in runs) for i in range(n)],
            "load_before": runs[0]["load_before"][0], "load_after": runs[0]["load_after"][0],
            "params_rank0": runs[0]["params_this_rank"], "grad_accum": runs[0]["grad_accum"],
            "loss_first": runs[-1]["losses"][0] if runs[-1]["losses"] else None,
            "loss_last": runs[-1]["losses"][-1] if runs[-1]["losses"] else None}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--steps", type=int, default=16, help="steps per debug point per round (incl. warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="steps discarded at the start of each point")
    p.add_argument("--rounds", type=int, default=5,
                   help="alternate the 1-rank and 2-rank launches this many times (>= 5; --quick: 1)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step (debug: x 128 tokens)")
    p.add_argument("--two-threads", action=argparse.BooleanOptionalAction, default=False,
                   help="also run the 1-rank reference with 2 intra-op threads (the same 2 cores, one process); "
                        "off by default: on a loaded machine 2 OpenMP threads per process stall (minutes per point)")
    p.add_argument("--small", action=argparse.BooleanOptionalAction, default=True,
                   help="gpt small (the preset's seq_length), if a DP2 step takes < --small-max-step-s")
    p.add_argument("--small-max-step-s", type=float, default=20.0)
    p.add_argument("--small-steps", type=int, default=4)
    p.add_argument("--small-warmup", type=int, default=2)
    p.add_argument("--small-global-batch", type=int, default=2,
                   help="sequences of the small preset's length per step (2: the least that gives each DP2 "
                        "rank one)")
    p.add_argument("--small-seq", type=int, default=MODEL_PRESETS["small"]["seq_length"],
                   help="small's sequence length: the preset's (a dataset of another length is refused)")
    p.add_argument("--ckpt-reps", type=int, default=5,
                   help="timed saves and loads per checkpoint model (>= 5: median and minimum; --quick: 1)")
    p.add_argument("--ckpt-models", nargs="+", default=["debug", "debug-w4", "debug-w16", "small"])
    p.add_argument("--quick", action="store_true", help="gpt debug only, few steps, no small, results not written")
    p.add_argument("--render", action="store_true", help="rewrite scaling.md/.png from scaling.json, no runs")
    p.add_argument("--summarise", metavar="RAW_JSON",
                   help="summarise and write the raw.json a run kept in its work dir (when its summary failed)")
    args = p.parse_args()
    check_repeats(p, args)
    if args.summarise:
        report(summarise(json.loads(Path(args.summarise).read_text())), write=True)
        return
    if args.render:
        saved = json.loads((RESULTS / "scaling.json").read_text())
        report(saved, write=True)
        return
    if args.quick:
        args.archs, args.steps, args.warmup, args.rounds, args.small = ["gpt"], 6, 2, 1, False
        args.two_threads, args.ckpt_reps, args.ckpt_models = False, 1, ["debug"]

    from ascender_dist.research.ablate.provenance import file_sha256, git_state  # research extra, only when run

    state = git_state()  # the code that runs: taken before measuring
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="scaling_"))
    print(f"work dir {tmp}", flush=True)
    from tests.helpers.data import make_tiny_dataset

    data = {"128": make_tiny_dataset(tmp / "data128", seq_length=128)}
    if args.small or "small" in args.ckpt_models:
        # small's samples: a larger corpus so that the train and val splits have several batches
        data[str(args.small_seq)] = make_tiny_dataset(tmp / f"data{args.small_seq}", seq_length=args.small_seq,
                                                      corpus_bytes=1_500_000 * args.small_seq // 1024)
    print(f"data ready ({time.time() - t_start:.0f} s)", flush=True)

    # every job's run config, built and hashed before the first launch (a config that does not build fails here)
    dbg = throughput_jobs("debug", args.archs, LAYOUTS, args.steps, args.micro_batch, args.global_batch, 128)
    two_thread_jobs = [{**j, "key": j["key"].replace(REFERENCE, "1 rank, 2 threads"), "layout": "1 rank, 2 threads"}
                       for j in dbg[1]]
    # gpt small: the gate is DP2's: after its warm-up steps, stop the whole group if a step took > --small-max-step-s;
    # the layouts after it are not gated themselves (a set with holes would compare nothing)
    sm = throughput_jobs("small", ["gpt"], ["DP2", "TP2", "PP2", REFERENCE], args.small_steps, 1,
                         args.small_global_batch, args.small_seq) if args.small else {1: [], 2: []}
    for job in sm[2]:
        job["group"] = "small"
        if job["layout"] == "DP2":
            job.update(max_step_s=args.small_max_step_s, gate_steps=args.small_warmup)
    sm[2].sort(key=lambda j: j["layout"] != "DP2")
    ck_jobs = [{"key": name, "preset": CKPT_MODELS[name][0], "arch": "gpt", "model": CKPT_MODELS[name][1],
                "parallel": {"zero_stage": 1}, "steps": 1, "micro": 1, "global": 2, "seq": 128}
               for name in args.ckpt_models]
    manifests = {seq: file_sha256(d["manifest"]) for seq, d in data.items()}
    hashes = config_hashes([*dbg[1], *dbg[2], *(two_thread_jobs if args.two_threads else []), *sm[1], *sm[2], *ck_jobs],
                           data, {seq: f"make_tiny_dataset seq {seq}, manifest sha256 {(h or '?')[:16]}"
                                  for seq, h in manifests.items()})

    launches = []
    raw: dict[str, list] = {}  # key -> per-round list of per-rank results

    def collect(res, info):
        launches.append(info)
        for key in res[0]:
            raw.setdefault(key, []).append([r[key] for r in res])

    # ---- debug preset, every architecture, alternating 1-rank / 2-rank launches
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: debug", flush=True)
        for world in (1, 2):
            collect(*launch("benchmarks.scaling:throughput_worker", world,
                            {"jobs": dbg[world], "data": data, "root": str(tmp / f"runs_r{r}")}))
        if args.two_threads:
            collect(*launch("benchmarks.scaling:throughput_worker", 1,
                            {"jobs": two_thread_jobs, "data": data, "root": str(tmp / f"runs2t_r{r}")},
                            env={"OMP_NUM_THREADS": "2"}))

    # ---- gpt small: DP2 first, as the gate
    small_gate = None
    if args.small:
        print("gpt small", flush=True)
        res, info = launch("benchmarks.scaling:throughput_worker", 2,
                           {"jobs": sm[2], "data": data, "root": str(tmp / "runs_small")}, timeout=1500)
        collect(res, info)
        small_gate = res[0]["small/gpt/DP2"].get("gate_step_s")
        if not res[0]["small/gpt/DP2"].get("too_slow"):
            collect(*launch("benchmarks.scaling:throughput_worker", 1,
                            {"jobs": sm[1], "data": data, "root": str(tmp / "runs_small")}, timeout=1200))

    # ---- checkpoints at DP2 x ZeRO-1
    print("checkpoints", flush=True)
    ck_res, info = launch("benchmarks.scaling:checkpoint_worker", 2,
                          {"jobs": ck_jobs, "data": data, "root": str(tmp / "ckpt"), "reps": args.ckpt_reps},
                          timeout=1200)
    launches.append(info)

    measured = {"args": {k: v for k, v in vars(args).items() if k not in ("render", "summarise")},
                "launches": launches, "raw": raw, "checkpoints": ck_res[0], "small_gate_step_s": small_gate,
                "wall_seconds": time.time() - t_start, "uptime_end": Path("/proc/loadavg").read_text().split()[:3],
                "machine": {**_machine(), **state},
                "config_sha256": hashes, "data_manifest_sha256": manifests}
    # kept until the summary is written: a failing summary can be redone with --summarise <this file>
    (tmp / "raw.json").write_text(json.dumps(measured))
    print(f"raw results in {tmp / 'raw.json'}", flush=True)
    saved = summarise(measured)
    report(saved, write=not args.quick)
    shutil.rmtree(tmp, ignore_errors=True)


CKPT_MODELS = {"debug": ("debug", {}), "debug-w4": ("debug", {"hidden_size": 256, "ffn_hidden_size": 1024}),
               "debug-w16": ("debug", {"hidden_size": 1024, "ffn_hidden_size": 4096}),
               "small": ("small", {"seq_length": 128})}  # parameters do not depend on seq_length (rope)


def small_seq(args: dict) -> int:
    """The small preset's sequence length a run used (runs recorded before it was an argument: 1024)."""
    return args.get("small_seq", 1024)


def summarise(measured: dict) -> dict:
    """Raw per-rank step times -> per-point medians, ratios to the 1-rank run; checkpoint medians."""
    args = argparse.Namespace(**measured["args"])
    raw = measured["raw"]
    points = []
    for key, rounds in raw.items():
        preset, arch, layout = key.split("/")
        seq = small_seq(measured["args"]) if preset == "small" else 128
        gb = args.small_global_batch if preset == "small" else args.global_batch
        warm = args.small_warmup if preset == "small" else args.warmup
        per_round = [summarise_point(runs, warm, seq, gb) for runs in rounds]
        ok = [s for s in per_round if "skipped" not in s and not s["too_slow"]]
        pt = {"preset": preset, "arch": arch, "layout": layout, "seq_length": seq, "global_batch": gb,
              "world": 1 if layout.startswith("1 rank") else 2, "rounds": per_round}
        if ok:
            kept = [t for s in ok for t in s["step_s_all"][warm:]]
            med = statistics.median(kept)
            p25 = statistics.quantiles(kept, n=4)[0] if len(kept) >= 2 else med
            cpu_kept = [t for s in ok for t in s["cpu_total_s"][warm:]]
            pt.update({"step_s": med, "tokens_per_s": gb * seq / med, "measured_steps": len(kept),
                       "cpu_s_per_step": statistics.median(cpu_kept),
                       "step_s_p25": p25, "tokens_per_s_p25": gb * seq / p25,
                       "step_s_p75": statistics.quantiles(kept, n=4)[2] if len(kept) >= 2 else med,
                       "round_tokens_per_s": [s["tokens_per_s"] for s in ok],
                       # by round index (None: that round failed), to pair a layout's round with the reference's
                       "tokens_per_s_by_round": [s["tokens_per_s"] if s in ok else None for s in per_round],
                       "cpu_per_wall": [statistics.fmean(c) for c in zip(*[s["cpu_per_wall"] for s in ok])],
                       "params_rank0": ok[0]["params_rank0"], "grad_accum": ok[0]["grad_accum"]})
        else:
            pt["not_measured"] = per_round[0].get("skipped") or "too slow"
        points.append(pt)
    for pt in points:
        ref = next((q for q in points if q["preset"] == pt["preset"] and q["arch"] == pt["arch"]
                    and q["layout"] == REFERENCE and "tokens_per_s" in q), None)
        if ref and "tokens_per_s" in pt:
            pt["ratio"] = pt["tokens_per_s"] / ref["tokens_per_s"]
            # round by round: the 1-rank and 2-rank launches of one round ran back to back
            pairs = zip(pt.get("tokens_per_s_by_round", []), ref.get("tokens_per_s_by_round", []))
            pt["round_ratios"] = [a / b for a, b in pairs if a is not None and b is not None]
            pt["ratio_p25"] = pt["tokens_per_s_p25"] / ref["tokens_per_s_p25"]
            pt["cpu_cost_ratio"] = pt["cpu_s_per_step"] / ref["cpu_s_per_step"]
    ckpts = []
    for name in measured["checkpoints"]:
        r0 = measured["checkpoints"][name]
        ckpts.append({"model": name, "preset": CKPT_MODELS[name][0], "overrides": CKPT_MODELS[name][1],
                      "params": r0["params"], "bytes": r0["bytes"], "save_s": statistics.median(r0["save_s"]),
                      "load_s": statistics.median(r0["load_s"]), "save_s_min": min(r0["save_s"]),
                      "load_s_min": min(r0["load_s"]), "save_s_all": r0["save_s"],
                      "load_s_all": r0["load_s"], "files": r0["files"]})
    meta = {**measured["machine"], **{k: measured[k] for k in ("wall_seconds", "launches", "uptime_end", "args",
                                                                  "small_gate_step_s")},
            **{k: measured[k] for k in ("config_sha256", "data_manifest_sha256") if k in measured}}
    gate = next((q["rounds"][0] for q in points if q["preset"] == "small" and q["layout"] == "DP2"), None)
    if gate and gate.get("gate_cpu_s") is not None:  # CPU seconds of the busier rank in the gate step
        meta["small_gate_cpu_s"] = gate["gate_cpu_s"]
    return {"meta": meta, "points": points, "checkpoints": ckpts}


# ----------------------------------------------------------------------------- report


def _fmt_int(x) -> str:
    return f"{x:,.0f}"


def ckpt_min(c: dict, what: str) -> float:
    """The fastest of a checkpoint's timed saves or loads (records before the minimum was kept: from the
    recorded repetitions)."""
    return c.get(f"{what}_s_min", min(c[f"{what}_s_all"]))


def code_line(meta: dict) -> str:
    """The commit measured and whether the tree was dirty (``git_state``); records made before that name the
    commit and the tracked files that differed."""
    if "git_commit" in meta:
        return commit_text(meta).replace("Commit", "commit", 1)
    return f"commit {meta.get('commit', '?')}" + (
        f", with other engineers' uncommitted edits in {', '.join(meta['uncommitted'])}" if meta.get("uncommitted")
        else "")


def report(saved: dict, write: bool):
    meta, points, ckpts = saved["meta"], saved["points"], saved["checkpoints"]
    a = meta["args"]
    loads = [l["load_before"][0] for l in meta["launches"]] + [l["load_after"][0] for l in meta["launches"]]
    order = {name: i for i, name in enumerate(list(LAYOUTS) + ["1 rank, 2 threads"])}
    points = sorted(points, key=lambda q: (q["preset"] != "debug", ARCHS.index(q["arch"]), order[q["layout"]]))
    small_params = next((c["params"] for c in ckpts if c["model"] == "small"), None) or next(
        (q["params_rank0"] for q in points if q["preset"] == "small" and q["layout"] == REFERENCE
         and "params_rank0" in q), float("nan"))
    lines = [
        "# Training throughput of the parallel layouts, and checkpoint cost (CPU)",
        "",
        f"Machine: {meta['cpu_model']}, {meta['cores']} cores shared with other engineers' jobs, {meta['mem_gib']} GiB RAM, "
        f"no GPU; torch {meta['torch']}, DeepSpeed {meta['versions']['deepspeed']}, megatron-core "
        f"{meta['versions']['megatron-core']}, Python {meta['python']}. fp32, gloo. "
        f"Run by `benchmarks/scaling.py` in {meta['wall_seconds'] / 60:.1f} min. "
        f"1-minute load average seen around the launches: {min(loads):.2f} to {max(loads):.2f} "
        f"(our own ranks count: one busy rank adds ~1). Code: {code_line(meta)}.",
        "",
        "Each layout trains through `Trainer(cfg).fit()` (megatron-core layers in DeepSpeed's engine; its "
        "pipeline engine for PP2) on ranks started by `tests.helpers.multiproc.run_ranks` (one process per "
        "rank, `OMP_NUM_THREADS=1`, the variables the `deepspeed` launcher sets; chosen over the launcher itself so "
        "that one launch, 10-20 s of imports, runs every point of a world size), ZeRO-1 in every layout. "
        "A step's time is the slowest rank's; the first "
        f"{a['warmup']} steps of each point are dropped and the median of the rest is reported "
        f"({a['rounds']} round(s) of {a['steps']} steps, the 1-rank and 2-rank launches alternating"
        f"{'' if a['rounds'] >= MIN_REPEATS else f'; FEWER than the {MIN_REPEATS} rounds this project requires of a committed table: re-run it'}"
        "). Same global "
        f"batch in every layout: debug {a['global_batch']} x 128 tokens (micro-batch {a['micro_batch']}: 1 rank and "
        f"TP2/PP2 accumulate/pipeline {a['global_batch'] // a['micro_batch']} micro-batches, DP2 "
        f"{a['global_batch'] // a['micro_batch'] // 2} per rank); small {a['small_global_batch']} x {small_seq(a)} "
        f"(micro-batch 1; one 2-rank launch with DP2 first as the gate, then one 1-rank launch; {a['small_steps']} "
        f"steps, the first {a['small_warmup']} dropped). Vocabulary: the 512-token test tokenizer (`make_tiny_dataset`), so `small` has "
        f"{small_params / 1e6:.1f} M parameters here instead of GPT-3 Small's 125 M (its embedding is 512 x 768, "
        "not 50k x 768).",
        "",
        "| preset | arch | layout | ranks | tokens/s | tokens/s per round | step s: median (p25-p75) "
        "| ratio vs 1 rank | ratio, p25 steps | CPU s / wall s per rank | CPU s per step, all ranks | CPU cost vs 1 rank |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for q in points:
        if "tokens_per_s" not in q:
            lines.append(f"| {q['preset']} | {q['arch']} | {q['layout']} | {q['world']} | not measured "
                         f"({q['not_measured']}) | | | | | | | |")
            continue
        rounds = ", ".join(f"{t:,.0f}" for t in q.get("round_tokens_per_s", []))
        ratio = f"**{q['ratio']:.2f}**" if "ratio" in q else "-"
        if len(q.get("round_ratios", [])) > 1:  # the same ratio round by round: median (min)
            ratio += f" ({statistics.median(q['round_ratios']):.2f}, min {min(q['round_ratios']):.2f})"
        ratio25 = f"{q['ratio_p25']:.2f}" if "ratio_p25" in q else "-"
        cost = f"{q['cpu_cost_ratio']:.2f}" if "cpu_cost_ratio" in q else "-"
        lines.append(f"| {q['preset']} | {q['arch']} | {q['layout']} | {q['world']} | {q['tokens_per_s']:,.0f} | {rounds} | "
                     f"{q['step_s']:.3f} ({q['step_s_p25']:.3f}-{q['step_s_p75']:.3f}) | {ratio} | {ratio25} | "
                     f"{', '.join(f'{c:.2f}' for c in q['cpu_per_wall'])} | {q['cpu_s_per_step']:.3f} | {cost} |")
    small_pts = [q for q in points if q["preset"] == "small"]
    if not small_pts:
        lines += ["", "gpt `small` throughput: not run in this invocation."]
    elif all("tokens_per_s" not in q for q in small_pts):
        lines += ["", f"gpt `small` throughput: **too slow here** - a DP2 step ({a['small_global_batch']} x {small_seq(a)} tokens) "
                      f"cost {meta.get('small_gate_cpu_s') or float('nan'):.1f} CPU s on the busier rank and took "
                      f"{meta.get('small_gate_step_s') or float('nan'):.1f} s wall, against a budget of "
                      f"{a['small_max_step_s']:.0f} CPU s (and {2 * a['small_max_step_s']:.0f} s wall), so the other "
                      "layouts were not run."]
    elif meta.get("small_gate_step_s"):
        lines += ["", f"gpt `small` gate: a DP2 step ({a['small_global_batch']} x {small_seq(a)} tokens) cost "
                      f"{meta.get('small_gate_cpu_s') or float('nan'):.1f} CPU s on the busier rank "
                      f"({meta['small_gate_step_s']:.1f} s wall), under the budget of {a['small_max_step_s']:.0f} CPU s "
                      f"(and {2 * a['small_max_step_s']:.0f} s wall) for one step on 2 ranks, so every layout was run."]
    lines += [
        "",
        "tokens/s: global batch tokens / median step time over all kept steps of all rounds; per round: the same "
        "from each round alone; ratio vs 1 rank: over all rounds, in brackets the median and minimum of the "
        "round-by-round ratios (the 1-rank and 2-rank launches of a round ran back to back). p25-p75: quartiles of the kept step times. Ratio, p25 steps: the same ratio "
        "from each point's fastest-quartile step time, which other jobs' bursts disturb least. CPU s / wall s: CPU time each rank's process "
        "used (all its threads) per wall second over the measured steps; below 1 means the rank waited "
        "(on a peer, on gloo, or for a core the other jobs held). CPU s per step, all ranks: median over the kept "
        "steps of the CPU seconds the ranks used together; CPU cost vs 1 rank: that over the 1-rank run's, "
        "ideal 1.0 for any layout (the same arithmetic, split), so the excess is the layout's overhead "
        "(communication, duplicated work, bookkeeping). Unlike the wall-clock ratio it does not depend on what "
        "share of the cores the other jobs left us.",
        "",
        "## Checkpoint save and load (DP2 x ZeRO-1, gpt)",
        "",
        "One AdamW step (so the moments exist), then `Trainer.save()` and "
        "`ascender_dist.training.checkpoint.load_checkpoint(engine, dir, tag)`, each timed "
        f"{a['ckpt_reps']} times between barriers"
        + (f" (FEWER than the {MIN_REPEATS} this project requires: re-run it)" if a["ckpt_reps"] < MIN_REPEATS else "")
        + "; median and minimum shown (all runs in scaling.json). Bytes: the "
        "whole tag directory (model states from DP rank 0, one ZeRO optimizer partition per rank, RNG states, "
        "meta/config). Files were just written, so loads read from the page cache; saves end when the data "
        "is in the page cache (DeepSpeed does not fsync). This is serialisation cost, not disk bandwidth.",
        "",
        "| model | shape | params | bytes on disk | bytes / param | save s: median (min) | load s: median (min) "
        "| repetitions |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    shapes = {"debug": "2 x 64 (debug)", "debug-w4": "2 x 256, ffn 1024", "debug-w16": "2 x 1024, ffn 4096",
              "small": "12 x 768 (small)"}
    for c in ckpts:
        lines.append(f"| {c['model']} | {shapes.get(c['model'], '')} | {_fmt_int(c['params'])} | "
                     f"{c['bytes'] / 2**20:,.1f} MiB | {c['bytes'] / c['params']:.1f} | "
                     f"{c['save_s']:.2f} ({ckpt_min(c, 'save'):.2f}) | {c['load_s']:.2f} ({ckpt_min(c, 'load'):.2f}) | "
                     f"{len(c['save_s_all'])} |")
    if meta.get("config_sha256"):
        lines += ["", f"Run configs: the sha256 of each of the {len(meta['config_sha256'])} configs built "
                      "(`provenance.config_hash`, temporary dataset paths replaced by the dataset's name and manifest "
                      "hash) is in scaling.json (`meta.config_sha256`)."]
    lines += ["", "## Reading", ""]
    lines += reading(saved, points)
    lines += [
        "",
        "**Not measured here:** MFU on GPU for the `medium` preset (and any GPU number) - this machine has no "
        "GPU. The trainer logs `train/mfu` and `train/tflops_per_device` when it runs on one; the README's times "
        "for the scaling configs are at 40 % MFU and at the MFU measured on one H200 "
        "(`benchmarks/results/gpu/summary.md`), not measured here.",
        "",
        "![throughput ratios and checkpoint time](scaling.png)",
        "",
    ]
    if publish("scaling", lines, saved, write):
        plot(points, ckpts, meta.get("cores"))


def reading(saved: dict, points: list) -> list[str]:
    """The reading: fixed prose around numbers computed from the results."""
    meta = saved["meta"]

    def field(preset, layout, name):
        return [q[name] for arch in ARCHS for q in points
                if (q["preset"], q["arch"], q["layout"]) == (preset, arch, layout) and name in q]

    def rng(layout, name="ratio", preset="debug"):
        vals = field(preset, layout, name)
        return (f"{min(vals):.2f}-{max(vals):.2f}" if len(vals) > 1 else f"{vals[0]:.2f}") if vals else "n/a"

    debug = [q for q in points if q["preset"] == "debug" and "cpu_per_wall" in q]
    share1 = [c for q in debug if q["world"] == 1 for c in q["cpu_per_wall"]]
    share2 = [c for q in debug if q["world"] == 2 for c in q["cpu_per_wall"]]
    out = [
        f"* **What 2 ranks can do here.** The machine has {meta.get('cores', '?')} cores, shared with other engineers' jobs. The 1-rank "
        "reference is one process with one intra-op thread, so a 2-rank layout has at most twice its CPU: the "
        "ideal ratio of every layout is 2.0, reachable only if the second core is free. TP2 and PP2 split one "
        "model replica (each rank does half the arithmetic) and pay for it in per-layer all-reduces (TP) or "
        "activation sends and a pipeline bubble (PP); DP2 splits the batch and pays one gradient all-reduce "
        "(reduce-scatter/all-gather under ZeRO-1) per step. With 2 ranks on shared cores no layout can more than double the "
        "1-rank run, and only while nobody else wants the second core.",
    ]
    if share1 and share2:
        out.append(
            f"* **Wall clock (tokens/s, ratio columns).** debug preset: DP2 {rng('DP2')}, TP2 {rng('TP2')}, PP2 "
            f"{rng('PP2')} x the 1-rank run (fastest-quartile steps: DP2 {rng('DP2', 'ratio_p25')}, TP2 "
            f"{rng('TP2', 'ratio_p25')}, PP2 {rng('PP2', 'ratio_p25')}). These are as much a measurement of the "
            f"machine's load as of the layouts: a 1-rank process got {statistics.fmean(share1):.2f} CPU s per wall "
            f"s on average, each rank of a 2-rank layout {statistics.fmean(share2):.2f} (waiting on its peer "
            "included), with the 1-minute load between "
            f"{min(min(l['load_before'][0], l['load_after'][0]) for l in meta['launches']):.0f} and "
            f"{max(max(l['load_before'][0], l['load_after'][0]) for l in meta['launches']):.0f} during the run.")
    pairs = []  # (architecture, 1-rank CPU s per step, TP2 CPU cost) on the debug preset
    for arch in ARCHS:
        one = next((q for q in points if (q["preset"], q["arch"], q["layout"]) == ("debug", arch, REFERENCE)), {})
        tp = next((q for q in points if (q["preset"], q["arch"], q["layout"]) == ("debug", arch, "TP2")), {})
        if "cpu_s_per_step" in one and "cpu_cost_ratio" in tp:
            pairs.append((arch, one["cpu_s_per_step"], tp["cpu_cost_ratio"]))
    tp_trend = ""
    if len(pairs) > 1:
        listed = ", ".join(f"{a} {c:.2f} ({w:.2f} CPU s per 1-rank step)" for a, w, c in pairs)
        heavy = max(pairs, key=lambda t: t[1])
        holds = min(pairs, key=lambda t: t[2]) is heavy
        tp_trend = (f" Per architecture, TP2's CPU cost: {listed}"
                    + (f"; {heavy[0]}, with the most arithmetic per step, pays the least for TP, as expected if "
                       "the overhead is per call and not per FLOP." if holds else
                       "; no clean link between a step's arithmetic and TP2's overhead shows at this noise level."))
    out.append(
        f"* **CPU cost (the load-robust view).** CPU seconds per step summed over ranks, relative to 1 rank: DP2 "
        f"{rng('DP2', 'cpu_cost_ratio')}, TP2 {rng('TP2', 'cpu_cost_ratio')}, PP2 {rng('PP2', 'cpu_cost_ratio')}. "
        "DP2 does the same arithmetic as 1 rank plus one gradient collective per step, so it stays near 1. TP2 "
        "costs the most: at least 2 all-reduces per layer in the forward and 2 in the backward (plus the "
        "vocabulary-parallel embedding and loss) for every micro-batch, and, most likely, at width 64 each "
        "half-width matmul is so small that per-call overhead (Python, megatron/autograd dispatch, gloo round trips) does not halve "
        "with the arithmetic. PP2 sits between: per-micro-batch activation/gradient sends and DeepSpeed's pipeline "
        "schedule, and its bubble ((p-1)/(m+p-1) = 1/(m+1) of the time with m micro-batches) shows in wall time, "
        "not in CPU. The debug preset (2 layers x 64) makes a step milliseconds of arithmetic, so these are "
        "framework and communication overheads at their worst relative size." + tp_trend)
    gate_s, gate_cpu = meta.get("small_gate_step_s"), meta.get("small_gate_cpu_s")
    small = [q for q in points if q["preset"] == "small" and "ratio" in q]
    if small:
        def one(layout, name):
            v = field("small", layout, name)
            return f"{v[0]:.2f}" if v else "not measured"

        dbg_tp = field("debug", "TP2", "cpu_cost_ratio")[:1]  # gpt is the first architecture
        walls = [v for l in ("DP2", "TP2", "PP2") for v in field("small", l, "ratio")]
        share = [c for q in small if q["world"] == 2 for c in q["cpu_per_wall"]]
        kept = min((q["measured_steps"] for q in small), default=0)
        text = (f"* **gpt small** (12 x 768, seq {small_seq(meta['args'])}, {meta['args']['small_global_batch']} sequences per step): wall "
                f"ratios DP2 {one('DP2', 'ratio')}, TP2 {one('TP2', 'ratio')}, PP2 {one('PP2', 'ratio')}; CPU cost "
                f"DP2 {one('DP2', 'cpu_cost_ratio')}, TP2 {one('TP2', 'cpu_cost_ratio')}, PP2 "
                f"{one('PP2', 'cpu_cost_ratio')}. A step here is ~10^12 FLOPs of matmuls and the overhead no longer "
                "dominates")
        tp_small = field("small", "TP2", "cpu_cost_ratio")
        if dbg_tp and tp_small:
            text += f": TP2's CPU cost is {tp_small[0]:.2f} here against {dbg_tp[0]:.2f} on gpt debug (ideal 1.0)"
        if walls and min(walls) > 1:
            text += f", and every layout beats the 1-rank run on wall clock ({min(walls):.2f}-{max(walls):.2f}x)"
        if share:
            text += (f"; none gets near 2.0 because each rank of a 2-rank layout got {statistics.fmean(share):.2f} "
                     "CPU s per wall s (the other jobs)")
        text += (f". Each small number rests on {kept} kept steps of one round (a step is ~20 s): the step-time "
                 "quartiles are the only error estimate, and the order of the three layouts is not established "
                 "by this run.")
        out.append(text)
    elif gate_s:
        out.append(f"* **gpt small was too slow here.** One DP2 step of {meta['args']['small_global_batch']} x {small_seq(meta['args'])} "
                   f"tokens (one sequence per rank) cost {gate_cpu or float('nan'):.1f} CPU s on the busier rank and "
                   f"took {gate_s:.1f} s wall, over the budget of {meta['args']['small_max_step_s']:.0f} CPU s (or "
                   f"{2 * meta['args']['small_max_step_s']:.0f} s wall), so no other small layout was run. TP/PP "
                   "ratios for a compute-bound model are therefore not measured on this machine.")
    spreads = [max(q["round_tokens_per_s"]) / min(q["round_tokens_per_s"]) for q in points
               if len(q.get("round_tokens_per_s", [])) > 1]
    if spreads:
        cpu_spreads = []
        for q in points:
            warm = meta["args"]["small_warmup"] if q["preset"] == "small" else meta["args"]["warmup"]
            per = [statistics.median(r["cpu_total_s"][warm:]) for r in q["rounds"]
                   if "cpu_total_s" in r and not r.get("too_slow")]
            if len(per) > 1:
                cpu_spreads.append(max(per) / min(per))
        out.append(f"* **Noise.** The same point measured in two rounds a few minutes apart differed by up to "
                   f"{max(spreads):.1f}x in tokens/s (median {statistics.median(spreads):.2f}x): single wall-clock "
                   "ratios here are good to tens of percent, not to a few"
                   + (f"; its CPU s per step differed by up to {max(cpu_spreads):.2f}x (median "
                      f"{statistics.median(cpu_spreads):.2f}x), so the CPU-cost column carries the layout comparison"
                      if cpu_spreads else "") + ".")
    ck = saved["checkpoints"]
    if len(ck) >= 2:
        big = ck[-1]
        out.append(f"* **Checkpoints** grow with bytes: {big['bytes'] / big['params']:.1f} bytes per parameter on "
                   "disk (fp32 weights 4, plus ZeRO-1's fp32 flat copy of the partition 4 and the two Adam moments "
                   f"8); the largest model here ({_fmt_int(big['params'])} params, {big['bytes'] / 2**20:,.0f} MiB) "
                   f"saves in {big['save_s']:.1f} s and loads in {big['load_s']:.1f} s (median of "
                   f"{len(big['save_s_all'])}; minimum {ckpt_min(big, 'save'):.1f} / {ckpt_min(big, 'load'):.1f} s). Below a few MiB the time is the fixed cost of the protocol "
                   "(barriers, RNG files, COMPLETE marker and atomic `latest`, DeepSpeed's bookkeeping).")
    return out


def plot(points, ckpts, cores=None):
    from ascender_dist.plotting import pyplot

    plt = pyplot()  # one line naming the research extra when matplotlib is missing

    groups = []
    for q in points:
        g = (q["preset"], q["arch"])
        if g not in groups and any("ratio" in r for r in points if (r["preset"], r["arch"]) == g):
            groups.append(g)
    layouts = [l for l in list(LAYOUTS) + ["1 rank, 2 threads"] if l != REFERENCE
               and any(q["layout"] == l for q in points)]
    fig, (ax, axc, ac) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [2, 2, 1.3]})
    width = 0.8 / max(1, len(layouts))
    for axis, name, title, ylabel, ideal in (
            (ax, "ratio", "wall-clock tokens/s vs 1 rank", "tokens/s relative to 1 rank (1 thread)", 2.0),
            (axc, "cpu_cost_ratio", "CPU seconds per step (all ranks) vs 1 rank", "CPU cost relative to 1 rank", 1.0)):
        for i, layout in enumerate(layouts):
            vals = [next((q.get(name, float("nan")) for q in points
                          if (q["preset"], q["arch"], q["layout"]) == (*g, layout)), float("nan")) for g in groups]
            xs = [j + (i - (len(layouts) - 1) / 2) * width for j in range(len(groups))]
            bars = axis.bar(xs, [0 if v != v else v for v in vals], width, label=layout)
            axis.bar_label(bars, labels=["n/m" if v != v else f"{v:.2f}" for v in vals], fontsize=7)
        axis.axhline(1.0, color="k", lw=0.8, ls="--")
        if ideal != 1.0:
            axis.axhline(ideal, color="grey", lw=0.6, ls=":")
        axis.set_xticks(range(len(groups)), [f"{a}\n{p}" for p, a in groups])
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.legend(fontsize=8)
    ax.text(0.01, 0.97, "ideal 2.0 (dotted) with both cores free; n/m: not measured", transform=ax.transAxes,
            fontsize=7, va="top")
    axc.text(0.01, 0.97, "ideal 1.0: the same arithmetic split over 2 ranks", transform=axc.transAxes, fontsize=7,
             va="top")
    if ckpts:
        mib = [c["bytes"] / 2**20 for c in ckpts]
        ac.loglog(mib, [c["save_s"] for c in ckpts], "o-", label="save")
        ac.loglog(mib, [c["load_s"] for c in ckpts], "s-", label="load")
        for c, m in zip(ckpts, mib):
            ac.annotate(c["model"], (m, c["save_s"]), fontsize=7, textcoords="offset points", xytext=(3, 4))
        ac.set_xlabel("checkpoint MiB on disk")
        ac.set_ylabel("seconds (median)")
        ac.set_title("checkpoint, DP2 x ZeRO-1")
        ac.grid(True, which="both", alpha=0.3)
        ac.legend()
    fig.suptitle(f"{cores or '?'} shared CPU cores, fp32, gloo", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling.png", dpi=110)


if __name__ == "__main__":
    main()
