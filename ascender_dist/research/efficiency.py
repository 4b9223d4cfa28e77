"""Table 2 (efficiency): attention FLOPs, peak memory, training throughput and latency at equal settings.

    ascender-dist efficiency --out benchmarks/results/research/efficiency [--preset debug] [--batch 8]
                             [--rows gpt,ascender,ascender-dense,connection] [--set model.seq_length=256]
                             [--from-ablation benchmarks/results/research/bias/results.json]
    python -m ascender_dist.research.efficiency ...                     (the same)

Every row is the same backbone (``--preset``, the same batch, context, vocabulary and ``--set``
overrides) with a different mixing layer, measured in its own fresh process on one rank with
``--threads`` torch threads; ``--rounds`` rounds (>= 5) each measure every row once, in an order
rotated from round to round, so that a shared machine's drift reaches every row alike. The table gives
each row's median over the rounds (throughput also its minimum and maximum) and its throughput over
gpt's taken within each round (median, minimum, maximum):

* ``gpt``: megatron-core's softmax attention (local spec);
* ``ascender``: ASCender attention, the default path on this device (``impl="auto"``, see
  ``models/ascender/attention.py``);
* ``ascender-dense``: ASCender through the dense O(s^2) reference (the interpretable path);
* ``connection``: the Connection Transformer (``AC`` pattern).

Columns:

* **attention FLOPs/token**: forward FLOPs per token of all token-mixing blocks (QKV/output projections,
  scores and weighted values over the full s x s square as ``models/counting.py`` counts them, plus
  each layer kind's own extra terms from the registry), analytic; and the same counted by
  ``torch.utils.flop_counter.FlopCounterMode`` on one real forward (matmul-type ops only; elementwise
  work such as ASCender's kernels and normalisations is not counted by torch);
* **training FLOPs/token**: ``count_model`` (what MFU uses);
* **peak memory**: resident-memory high-water mark above the level before one training step (CPU,
  ``/proc/self/status`` VmHWM after resetting it) or ``torch.cuda.max_memory_allocated`` (GPU), MiB;
* **tokens/s**: training step (forward + backward + AdamW) on ``batch x seq`` tokens, median of
  ``--repeats`` steps after two warm-ups;
* **latency**: one forward of one sequence of ``seq`` tokens, no gradients, median of ``--repeats``.

``--from-ablation`` adds the throughput and peak RSS measured during the real training runs of an
ablation report (``ascender-dist ablate``), per variant. The paper asks for this table "at equal
quality"; at this scale no variant reaches a quality the others do not, so it is reported at equal
settings (same shape, batch and tokens) and the parameter counts are listed beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from statistics import median
from pathlib import Path
from typing import Optional, Sequence

from ascender_dist.config.errors import UserError
from ascender_dist.logs import setup_cli_logging
from ascender_dist.machine import machine_line, machine_record

log = logging.getLogger("ascender_dist")

ROWS = {
    "gpt": ({"model": {"architecture": "gpt"}}, None),
    "ascender": ({"model": {"architecture": "ascender"}}, None),
    "ascender-dense": ({"model": {"architecture": "ascender"}}, "reference"),
    "connection": ({"model": {"architecture": "connection"}}, None),
}


# ============================================================================ analytic

from ascender_dist.models.counting import mixing_flops_per_token as attention_flops_per_token  # noqa: E402,F401
from ascender_dist.research.ablate.launch import _status_kib  # noqa: E402
from ascender_dist.research.ablate.provenance import report_provenance  # noqa: E402
from ascender_dist.research.saved_json import FOREIGN_SHAPE, draw_saved, foreign_shape, read_saved_json  # noqa: E402


# ============================================================================ one measurement (child)



def _peak_mib(fn) -> Optional[float]:
    import torch

    if torch.cuda.is_available():
        from ascender_dist.training.metrics import cuda_peak_mib

        return cuda_peak_mib(fn)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        fn()
        return None
    before = _status_kib("VmRSS")
    fn()
    after = _status_kib("VmHWM")
    return (after - before) / 1024 if before is not None and after is not None else None


def _median_time(fn, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure_one(spec: dict) -> dict:
    """Build the row's model on this process (rank 0 of 1) and measure it."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ascender_dist.config.resolve import config_from_dict, derive
    from ascender_dist.models.build import lm_loss
    from ascender_dist.models.counting import count_model
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group
    from ascender_dist.training.engine import build_run_model

    glibc_trim()
    init_process_group()
    cfg = config_from_dict(spec["config"])
    init_model_parallel(1, 1, cfg.train.seed)
    derived = derive(cfg, 1)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = build_run_model(cfg, derived).to(device)
    if spec.get("impl"):
        for module in model.modules():
            if type(module).__name__ == "AscenderCoreAttention":
                module.impl = spec["impl"]
    impls = sorted({getattr(m, "impl", "") for m in model.modules() if type(m).__name__ == "AscenderCoreAttention"})
    b, s, vocab = spec["batch"], cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g).to(device)
    one = tokens[:1, :-1]
    positions = torch.arange(s, device=device).unsqueeze(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        loss = lm_loss(model, tokens, derived.vocab_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def forward_one():
        model(one, positions, None)

    model.train()
    for _ in range(2):
        train_step()
    step_peak = _peak_mib(train_step)
    step_time = _median_time(train_step, spec["repeats"])
    model.eval()
    forward_one()
    forward_peak = _peak_mib(forward_one)
    latency = _median_time(forward_one, spec["repeats"])
    with FlopCounterMode(display=False) as counter:
        forward_one()
    counts = counter.get_flop_counts()
    total_counted = counter.get_total_flops()
    mixing = 0
    for name, ops in counts.items():  # e.g. "GPTModel.decoder.layers.0.self_attention"
        if name.rsplit(".", 1)[-1] == "self_attention":
            mixing += sum(ops.values())
    counts_model = count_model(cfg.model, vocab, cfg.parallel.tensor_model_parallel_size)
    params = sum(p.numel() for p in model.parameters())
    return {
        "architecture": cfg.model.architecture, "impl": spec.get("impl") or (impls[0] if impls else None),
        "layer_pattern": cfg.model.layer_pattern, "params": int(params),
        "attention_flops_per_token": attention_flops_per_token(cfg.model),
        "attention_flops_per_token_counted": mixing / s,
        "forward_flops_per_token_counted": total_counted / s,
        "training_flops_per_token": float(counts_model.flops_per_token),
        "train_step_s": step_time, "tokens_per_s": b * s / step_time,
        "train_step_peak_mib": step_peak, "latency_ms": latency * 1e3, "forward_peak_mib": forward_peak,
        "batch": b, "seq_length": s, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _cpu_name() -> str:
    return machine_line(machine_record())


def glibc_trim() -> None:
    """Ask glibc to return large freed blocks to the OS, so RSS high-water marks measure the step."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB
    except OSError:
        pass


# ============================================================================ driver

def row_config(row: str, preset: str, batch: int, vocab: int, overrides: Sequence[str], seed: int = 1234) -> tuple[dict, Optional[str]]:
    from ascender_dist.config.loader import apply_override, deep_merge

    if row not in ROWS:
        from ascender_dist.config.errors import ConfigError

        raise ConfigError("--rows", f"unknown row {row!r}; known: {', '.join(ROWS)}")
    extra, impl = ROWS[row]
    raw = {"model": {"preset": preset, "vocab_size": vocab},
           "train": {"micro_batch_size": batch, "global_batch_size": batch, "seed": seed}}
    raw = deep_merge(raw, extra)
    for text in overrides:
        raw = apply_override(raw, text)
    return raw, impl


def _run_child(spec: dict, threads: int, timeout: float) -> dict:
    from ascender_dist.ports import free_port

    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
    env.setdefault("DS_ACCELERATOR", "cuda" if _cuda() else "cpu")
    proc = subprocess.run([sys.executable, "-m", "ascender_dist.research.efficiency", "--measure-one",
                           json.dumps(spec)], env=env, capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
    raise RuntimeError(f"measurement of {spec['row']} failed (exit {proc.returncode}): {tail[0][:300]}")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def summarize(per_round: dict[str, list[dict]]) -> list[dict]:
    """One row per measured row from its rounds (row -> one result per round, in round order): the
    first round's counts, the medians over the rounds of throughput, latency and peak memory
    (throughput also min / max), every round's result under ``rounds``, and ``vs_gpt``: the row's
    throughput over gpt's in the same round (median, min, max), when gpt is among the rows."""
    rows = []
    for name, results in per_round.items():
        row = dict(results[0])
        tokens = [r["tokens_per_s"] for r in results]
        row.update(tokens_per_s=median(tokens), tokens_per_s_min=min(tokens), tokens_per_s_max=max(tokens),
                   train_step_s=median([r["train_step_s"] for r in results]) if "train_step_s" in row else None,
                   latency_ms=median([r["latency_ms"] for r in results]),
                   train_step_peak_mib=_median_or_none([r.get("train_step_peak_mib") for r in results]),
                   rounds=results)
        if "gpt" in per_round:
            ratios = [r["tokens_per_s"] / g["tokens_per_s"] for r, g in zip(results, per_round["gpt"])]
            row["vs_gpt"] = {"median": median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Table 2's throughput as a figure: every round's tokens/s of each row, and (with gpt among the
    rows) its ratio to gpt's in the same round, the numbers the table gives the median and range of."""
    from ascender_dist.plotting import plot_round_ratios

    panels = [("tokens/s (train step)", [(r["row"], [x["tokens_per_s"] for x in r["rounds"]]) for r in rows], {})]
    gpt = next((r for r in rows if r["row"] == "gpt"), None)
    if gpt is not None:
        ratios = [(r["row"], [x["tokens_per_s"] / g["tokens_per_s"] for x, g in zip(r["rounds"], gpt["rounds"])])
                  for r in rows]  # fmt: skip
        panels.append(("tokens/s / gpt's, same round", ratios, {"gpt": 1.0}))
    plot_round_ratios(path, "Table 2: training throughput at equal settings", panels)


def _median_or_none(values: list) -> Optional[float]:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def _f(x, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _recorded_cpus(provenance: dict | None) -> str:
    """The measuring machine's logical CPUs as recorded (not the rendering machine's)."""
    cpus = ((provenance or {}).get("machine") or {}).get("logical_cpus")
    return f"{cpus} cores" if cpus else "an unrecorded number of cores"


def render(rows: list[dict], ablation: Optional[dict], settings: dict, provenance: Optional[dict] = None) -> str:
    lines = [
        "# Table 2: efficiency at equal settings", "",
        f"Generated by `ascender-dist efficiency` (`ascender_dist/research/efficiency.py`). Preset "
        f"`{settings['preset']}`, batch {settings['batch']} × context {rows[0]['seq_length'] if rows else '?'}, "
        f"vocabulary {settings['vocab']}, fp32, {settings['threads']} torch thread(s), device: "
        f"{rows[0]['device'] if rows else '?'}; each row measured in its own fresh process, every row once per "
        f"round in an order rotated from round to round, {settings.get('rounds', 1)} round(s); medians over the rounds.",
        "",
        "| model | params | attention FLOPs/token (fwd, analytic) | counted by torch (matmuls) "
        "| training FLOPs/token | peak memory, train step (MiB) | tokens/s (train): median [min-max] "
        "| tokens/s / gpt's, same round: median [min-max] | latency, 1 seq fwd (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        spread = (f"{r['tokens_per_s']:.0f} [{r.get('tokens_per_s_min', r['tokens_per_s']):.0f}-"
                  f"{r.get('tokens_per_s_max', r['tokens_per_s']):.0f}]")
        ratio = r.get("vs_gpt")
        ratio_text = f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]" if ratio else "n/a"
        lines.append(f"| {r['row']} | {r['params']:,} | {r['attention_flops_per_token']:.4g} | "
                     f"{r['attention_flops_per_token_counted']:.4g} | {r['training_flops_per_token']:.4g} | "
                     f"{_f(r['train_step_peak_mib'], '.1f')} | {spread} | {ratio_text} | {r['latency_ms']:.1f} |")
    loads = [one["load_average"][0] for r in rows for one in r.get("rounds", [r]) if one.get("load_average")]
    lines += ["", "Peak memory is the resident-set high-water mark above the level before one training step "
              "(weights, gradients and AdamW state created earlier are not in it); counted FLOPs include only "
              "matmul-type ops, so ASCender's elementwise kernels are missing from that column.",
              f"1-minute load average while measuring: {min(loads):.1f}-{max(loads):.1f} on "
              f"{_recorded_cpus(provenance)} (shared machine: absolute times are inflated and noisy)." if loads else ""]
    if provenance:
        dirty = " (uncommitted changes)" if provenance.get("git_dirty") else ""
        lines.append(f"Measured at commit {str(provenance.get('git_commit') or 'not recorded')[:12]}{dirty}.")
    if ablation:
        commits = ", ".join(c[:12] for c in ablation.get("commits", [])) or "not recorded"
        lines += ["", f"## Measured during the training runs of `{ablation['source']}` (commit {commits})", "",
                  "| variant | runs | tokens/s mean ± std | median step time (s) | peak RSS of the run (MiB) |",
                  "|---|---:|---:|---:|---:|"]
        for e in ablation["configs"]:
            lines.append(f"| {e['config']} | {e['n']} | {_f(e.get('tokens_per_s_mean'), '.0f')} ± "
                         f"{_f(e.get('tokens_per_s_std'), '.0f')} | {_f(e.get('median_step_time_s'), '.3f')} | "
                         f"{_f(e.get('peak_rss_mib_mean'), '.0f')} |")
        lines += ["", "Runs of an ablation may have run two at a time (`jobs`), so they competed for the cores."]
    return "\n".join(lines) + "\n"


def efficiency_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist efficiency``: Table 2 as markdown + JSON. Exit 2 on a user error."""
    p = argparse.ArgumentParser(prog="ascender-dist efficiency", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output directory (table2.md, table2.json)")
    p.add_argument("--preset", default="debug")
    p.add_argument("--rows", default="gpt,ascender,ascender-dense,connection")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per measurement (median)")
    p.add_argument("--rounds", type=int, default=5, help="fresh-process measurements of every row (>= 5)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--from-ablation", default=None, help="an ablation report's results.json")
    p.add_argument("--rewrite", action="store_true",
                   help="only draw table2.md and table2.png again from --out's table2.json (no measuring)")
    p.add_argument("--measure-one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from ascender_dist.logs import quiet_library_warnings

    quiet_library_warnings()
    if args.measure_one:
        print("RESULT " + json.dumps(measure_one(json.loads(args.measure_one))), flush=True)
        return 0
    if not args.out:
        print("error: --out is required", file=sys.stderr)
        return 2
    if args.rewrite:
        return _rewrite(Path(args.out))
    for flag, value, least in (("--batch", args.batch, 1), ("--vocab", args.vocab, 1), ("--repeats", args.repeats, 1),
                               ("--rounds", args.rounds, 5), ("--threads", args.threads, 1)):
        if value < least:
            print(f"error: {flag} must be >= {least} (got {value})", file=sys.stderr)
            return 2
    if not args.timeout > 0:
        print(f"error: --timeout must be > 0 seconds (got {args.timeout})", file=sys.stderr)
        return 2
    setup_cli_logging()
    from ascender_dist.config.loader import to_dict
    from ascender_dist.config.resolve import config_from_dict

    from ascender_dist.research.ablate.index import run_commits
    from ascender_dist.research.ablate.provenance import config_hash

    try:
        specs = []
        for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
            raw, impl = row_config(row, args.preset, args.batch, args.vocab, args.overrides)
            cfg = config_from_dict(raw)  # fail here, in one line, on a bad override
            specs.append({"row": row, "config": raw, "impl": impl, "batch": args.batch, "repeats": args.repeats,
                          "config_sha256": config_hash(to_dict(cfg))})
        ablation = None
        if args.from_ablation:
            path = Path(args.from_ablation)
            if not path.is_file():
                from ascender_dist.config.errors import ConfigError

                raise ConfigError("--from-ablation", f"{path}: not found (an `ascender-dist ablate` results.json)")
            report = read_saved_json(path, ("records", "tables"), "ascender-dist ablate")
            try:
                configs = report["tables"]["cost"]["configs"]
                commits = [c for c in run_commits(report) if c]
                if not isinstance(configs, dict):
                    raise TypeError(f"tables.cost.configs is a {type(configs).__name__}")
            except FOREIGN_SHAPE as exc:
                raise foreign_shape(path, "ascender-dist ablate", exc) from None
            ablation = {"source": str(path), "commits": commits, "configs": configs}
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    provenance = report_provenance()  # before anything is written: the outputs may lie inside the checkout
    per_round: dict[str, list[dict]] = {spec["row"]: [] for spec in specs}
    with tqdm(total=args.rounds * len(specs), desc="efficiency", unit="measurement") as bar:
        for round_index in range(args.rounds):
            shift = round_index % len(specs)
            for spec in specs[shift:] + specs[:shift]:  # rotated: no row always runs first or last
                try:
                    result = _run_child(spec, args.threads, args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"error: measuring {spec['row']} took longer than --timeout {args.timeout:g} s",
                          file=sys.stderr)
                    return 1
                except RuntimeError as exc:  # the child's own last line
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
                per_round[spec["row"]].append({"row": spec["row"], "config_sha256": spec["config_sha256"], **result})
                bar.update()
    rows = summarize(per_round)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"preset": args.preset, "batch": args.batch, "vocab": args.vocab, "repeats": args.repeats,
                "rounds": args.rounds, "threads": args.threads, "overrides": args.overrides}
    (out / "table2.md").write_text(render(rows, ablation, settings, provenance))
    (out / "table2.json").write_text(json.dumps({"settings": settings, "rows": rows, "ablation": ablation,
                                                 "python": platform.python_version(),
                                                 "provenance": provenance}, indent=1))
    plot(rows, out / "table2.png")
    print(f"wrote {out / 'table2.md'}, table2.json and table2.png")
    return 0


def _rewrite(out: Path) -> int:
    """table2.md and table2.png from an earlier run's table2.json (the measured numbers unchanged)."""
    path = out / "table2.json"
    if not path.is_file():
        print(f"error: --rewrite: {path} not found (written by an earlier `ascender-dist efficiency --out {out}`)",
              file=sys.stderr)
        return 2
    def draw(data: dict) -> str:
        table = render(data["rows"], data["ablation"], data["settings"], data.get("provenance"))
        plot(data["rows"], out / "table2.png")
        return table

    try:
        table = draw_saved(path, ("rows", "ablation", "settings"), "ascender-dist efficiency", draw)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (out / "table2.md").write_text(table)
    print(f"wrote {out / 'table2.md'} and table2.png from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(efficiency_main())
