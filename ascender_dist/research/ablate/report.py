"""The report of a grid: results.md, results.json and the figures."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Optional, Sequence

import numpy as np


from .collect import aggregate
from .grid import Grid



# ============================================================================ figures

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(records: Sequence[dict], out: Path, metric: str = "val_loss") -> list[dict]:
    """Fig. 2: quality (metric, lower better) vs cost: training FLOPs and seconds per 1k tokens."""
    from ..tables import pareto_front

    plt = _plt()
    order = list(dict.fromkeys(r["config"] for r in records))
    by_cfg = {c: [r for r in records if r["config"] == c] for c in order}
    panels = [("training_flops", "training FLOPs (analytic, 6N + attention)", lambda r: r["training_flops"]),
              ("s_per_1k_tokens", "seconds per 1k training tokens (measured, lower is better)",
               lambda r: 1000.0 / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    fronts = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, xlabel, cost_of) in zip(axes, panels):
        points = []
        for i, cfg in enumerate(order):
            rs = by_cfg[cfg]
            q = np.array([r[metric] for r in rs], dtype=np.float64)
            c = np.array([cost_of(r) for r in rs], dtype=np.float64)
            color = colors[i % len(colors)]
            ax.scatter(c, q, s=12, alpha=0.35, color=color)
            ax.errorbar(np.nanmean(c), q.mean(), yerr=q.std(ddof=1) if q.size > 1 else None,
                        xerr=np.nanstd(c, ddof=1) if c.size > 1 else None, fmt="o", color=color, capsize=3,
                        label=cfg)
            points.append((q.mean(), np.nanmean(c)))
            if math.isfinite(points[-1][1]):
                ax.annotate(cfg, (points[-1][1], points[-1][0]), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")
        finite = [i for i, p in enumerate(points) if all(math.isfinite(v) for v in p)]
        front = [finite[j] for j in pareto_front([points[i] for i in finite])] if finite else []
        if front:
            ax.plot([points[i][1] for i in front], [points[i][0] for i in front], "k--", lw=1, label="Pareto front")
        fronts.append({"cost": key, "front": [order[i] for i in front],
                       "points": {order[i]: {"quality": points[i][0], "cost": points[i][1]} for i in range(len(order))}})
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{metric} (mean ± std over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Quality vs cost (Fig. 2); faint dots: single seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return fronts


def plot_ablation(obj: dict, records: Sequence[dict], out: Path) -> None:
    """Fig. 3: differences vs each reference with the bootstrap CI, and relative throughput."""
    plt = _plt()
    tables = [(obj["baseline"], obj["main"])] + list(obj.get("vs", {}).items())
    fig, axes = plt.subplots(1, len(tables) + 1, figsize=(4.2 * (len(tables) + 1), 3.6), squeeze=False)
    for ax, (ref, table) in zip(axes[0], tables):
        names, mids, los, his = [], [], [], []
        for e in table["configs"]:
            c = e.get("comparison")
            if e["config"] == ref or not c or c.get("mean_diff") is None:
                continue
            names.append(e["config"])
            mids.append(c["mean_diff"])
            los.append(c["mean_diff"] - (c["ci_low"] if c["ci_low"] is not None else c["mean_diff"]))
            his.append((c["ci_high"] if c["ci_high"] is not None else c["mean_diff"]) - c["mean_diff"])
        y = np.arange(len(names))
        ax.errorbar(mids, y, xerr=[los, his], fmt="o", capsize=3)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.set_xlabel(f"Δ {obj['metric']} vs {ref} (95% CI)")
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    order = list(dict.fromkeys(r["config"] for r in records))
    base = [r["tokens_per_s"] for r in records if r["config"] == obj["baseline"] and r.get("tokens_per_s")]
    if base:
        ref_tps = float(np.mean(base))
        vals = [np.mean([r["tokens_per_s"] for r in records if r["config"] == c and r.get("tokens_per_s")] or [np.nan])
                / ref_tps for c in order]
        ax.barh(np.arange(len(order)), vals)
        ax.set_yticks(np.arange(len(order)))
        ax.set_yticklabels(order, fontsize=8)
        ax.axvline(1, color="k", lw=0.8)
        ax.set_xlabel(f"tokens/s relative to {obj['baseline']}")
    fig.suptitle("Ablation (Fig. 3): negative Δ loss = better than the reference")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_curves(records: Sequence[dict], out: Path, baseline: Optional[str] = None) -> None:
    """Unsmoothed training loss per step, mean over seeds (the checklist's learning curves), and each
    config's per-step difference to ``baseline`` paired by seed (the curves themselves overlap)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if baseline else 1, figsize=(13 if baseline else 7, 4), squeeze=False)
    ax = axes[0][0]
    configs = list(dict.fromkeys(r["config"] for r in records))
    for cfg in configs:
        curves = [r["train_losses"] for r in records if r["config"] == cfg and r.get("train_losses")]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        mean = np.mean([c[:n] for c in curves], axis=0)
        ax.plot(np.arange(1, n + 1), mean, lw=0.9, label=f"{cfg} (n={len(curves)})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over seeds, unsmoothed)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if baseline:
        ax = axes[0][1]
        base = {r["seed"]: r["train_losses"] for r in records if r["config"] == baseline and r.get("train_losses")}
        for cfg in configs:
            if cfg == baseline:
                continue
            diffs = [np.asarray(r["train_losses"][:len(base[r["seed"]])]) -
                     np.asarray(base[r["seed"]][:len(r["train_losses"])])
                     for r in records if r["config"] == cfg and r["seed"] in base and r.get("train_losses")]
            if not diffs:
                continue
            n = min(len(d) for d in diffs)
            ax.plot(np.arange(1, n + 1), np.mean([d[:n] for d in diffs], axis=0), lw=0.8,
                    label=f"{cfg} (n={len(diffs)})")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss − {baseline} (same seed, mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


# ============================================================================ report

def _environment() -> dict:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_at_report": list(load) if load else None}


def write_report(grid: Grid, records: Sequence[dict], *, n_resamples: int = 10_000,
                 n_permutations: int = 10_000) -> dict:
    """results.md, results.json, pareto.png, ablation.png and curves.png in ``grid.report_dir``."""
    out = Path(grid.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    present = {r["config"] for r in records}
    refs = [c for c in grid.compare_to if c in present]
    md, obj = aggregate(records, grid.baseline, refs, grid.metric, n_resamples=n_resamples,
                        n_permutations=n_permutations)
    fronts = plot_pareto(records, out / "pareto.png", grid.metric)
    plot_ablation(obj, records, out / "ablation.png")
    plot_curves(records, out / "curves.png", grid.baseline)
    missing = [f"{v.name} seed {s}" for s in grid.seeds for v in grid.variants
               if not any(r["config"] == v.name and r["seed"] == s for r in records)]
    pairing = obj["data_pairing"]
    unpaired = [s for s, p in pairing.items() if not p["identical"]]
    r0 = records[0]
    header = [
        f"# Ablation `{grid.name}`", "",
        grid.description, "",
        f"Generated by `ascender-dist ablate {grid.path}` (`ascender_dist/research/ablate.py`). "
        f"{len(records)} runs: {len(present)} variants × seeds {grid.seeds}; every run trained "
        f"{r0['steps']} steps ({r0['tokens']:,} tokens) on 1 CPU rank and was scored on "
        f"{r0['val_sequences']} validation sequences. Differences are config − reference (negative = lower loss).",
        "",
        f"With {len(obj['seeds'])} seeds the exact randomisation test cannot give p below "
        f"2/2^{len(obj['seeds'])} = {obj['exact_p_floor']:.3g}; the percentile bootstrap CI over so few seeds is "
        "too narrow (docs/research.md). The per-sequence table resamples validation sequences instead: it says "
        "whether a difference of these trained models would hold on another validation set like this one, "
        "not whether it would hold for another training seed.",
        "",
        "Training-data pairing: " + ("every variant of a seed read identical training tokens (sha256 of all "
                                     "consumed tokens)." if not unpaired else
                                     f"seeds {unpaired} did NOT see identical data across variants "
                                     f"(axes {grid.data_order_axes}): seed-paired tests are not data-paired there."),
        "",
    ]
    if missing:
        header += [f"Missing runs (not in the tables): {', '.join(missing)}", ""]
    figures = ["", "Figures: `pareto.png` (Fig. 2, quality vs cost), `ablation.png` (Fig. 3, differences with CIs), "
               "`curves.png` (train loss per step, and its per-step difference to the baseline).", ""]
    (out / "results.md").write_text("\n".join(header) + "\n" + md + "\n".join(figures))
    grid_info = {"name": grid.name, "path": grid.path, "seeds": grid.seeds, "baseline": grid.baseline,
                 "compare_to": grid.compare_to, "metric": grid.metric,
                 "variants": [{"name": v.name, "overrides": v.overrides} for v in grid.variants],
                 "base": grid.base, "eval_iters": grid.eval_iters}
    slim = [{k: v for k, v in r.items() if k not in ("val_example_losses", "step_time_s")} for r in records]
    full = {"grid": grid_info, "environment": _environment(), "tables": obj, "pareto": fronts,
            "missing_runs": missing, "records": slim}
    (out / "results.json").write_text(json.dumps(_json_safe(full), indent=1))
    return full


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x
