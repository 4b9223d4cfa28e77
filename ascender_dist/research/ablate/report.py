"""The report of a grid: results.md, results.json, per_sequence.npz and the figures.

Everything in ``results.md`` is rendered from the object written to ``results.json`` (plus the
per-sequence losses of ``per_sequence.npz``), so ``ascender-dist tables DIR`` rebuilds the same report
from the committed files without training (:func:`rebuild`)."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ascender_dist.machine import machine_line

from .collect import aggregate
from .grid import AblationError, Grid
from .provenance import (config_hash, file_sha256, mixed_commit_line, mixed_inputs_line, mixed_version_line,
                         report_provenance, versions_of)

PER_SEQUENCE = "per_sequence.npz"
PER_SEQUENCE_KEYS = ("val_example_losses", "val_example_index", "val_example_documents")
FIGURES = ("pareto.png", "ablation.png", "curves.png")


# ============================================================================ figures

def variant_colors(order: Sequence[str]) -> dict:
    """One colour per variant, the same in every figure of a report (tab10, then tab20 beyond 10)."""
    from ascender_dist.plotting import pyplot

    plt = pyplot()
    cmap = plt.get_cmap("tab10" if len(order) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(order)}


def plot_pareto(records: Sequence[dict], out: Path, metric: str = "val_loss",
                colors: Optional[dict] = None) -> list[dict]:
    """Fig. 2: quality (metric, lower better) vs cost: training FLOPs and seconds per 1k tokens.
    Both panels share the quality axis; variants are named in one legend (no labels on the points)."""
    from ascender_dist.plotting import pyplot

    from ..tables import pareto_front

    plt = pyplot()
    order = list(dict.fromkeys(r["config"] for r in records))
    colors = colors or variant_colors(order)
    by_cfg = {c: [r for r in records if r["config"] == c] for c in order}
    panels = [("training_flops", "training FLOPs (analytic, 6N + attention)", lambda r: r["training_flops"]),
              ("s_per_1k_tokens", "seconds per 1k training tokens (measured)",
               lambda r: 1000.0 / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True, layout="constrained")
    fronts = []
    for ax, (key, xlabel, cost_of) in zip(axes, panels):
        points = []
        for cfg in order:
            rs = by_cfg[cfg]
            q = np.array([r[metric] for r in rs], dtype=np.float64)  # a diverged run: NaN (None in JSON)
            c = np.array([cost_of(r) for r in rs], dtype=np.float64)
            ax.scatter(c, q, s=14, alpha=0.35, color=colors[cfg])
            q = q[np.isfinite(q)]  # diverged runs are left out of the mean, as in the tables
            quality = float(q.mean()) if q.size else math.nan
            ax.errorbar(np.nanmean(c), quality, yerr=q.std(ddof=1) if q.size > 1 else None,
                        xerr=np.nanstd(c, ddof=1) if c.size > 1 else None, fmt="o", color=colors[cfg], capsize=3,
                        label=cfg)
            points.append((quality, np.nanmean(c)))
        finite = [i for i, p in enumerate(points) if all(math.isfinite(v) for v in p)]
        front = [finite[j] for j in pareto_front([points[i] for i in finite])] if finite else []
        if front:
            ax.plot([points[i][1] for i in front], [points[i][0] for i in front], "k--", lw=1, label="Pareto front")
        fronts.append({"cost": key, "front": [order[i] for i in front],
                       "points": {order[i]: {"quality": points[i][0], "cost": points[i][1]} for i in range(len(order))}})
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{metric} (mean ± std over seeds)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.suptitle("Quality vs cost (Fig. 2); faint dots: single seeds")
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return fronts


def plot_ablation(obj: dict, records: Sequence[dict], out: Path, colors: Optional[dict] = None) -> None:
    """Fig. 3: differences vs each reference with their paired t intervals (one shared x-scale), and
    throughput relative to the baseline."""
    from ascender_dist.plotting import pyplot

    plt = pyplot()
    order = list(dict.fromkeys(r["config"] for r in records))
    colors = colors or variant_colors(order)
    tables = [(obj["baseline"], obj["main"])] + list(obj.get("vs", {}).items())
    height = max(3.0, 0.35 * len(order) + 1.5)
    fig, axes = plt.subplots(1, len(tables) + 1, figsize=(4.6 * (len(tables) + 1), height), squeeze=False,
                             layout="constrained")
    diff_axes = list(axes[0][:-1])
    for ax in diff_axes[1:]:
        ax.sharex(diff_axes[0])
    for ax, (ref, table) in zip(diff_axes, tables):
        rows = [e for e in table["configs"] if e["config"] != ref and e.get("comparison")
                and e["comparison"].get("mean_diff") is not None]
        for y, e in enumerate(rows):
            c = e["comparison"]
            lo = c["ci_low"] if c["ci_low"] is not None else c["mean_diff"]
            hi = c["ci_high"] if c["ci_high"] is not None else c["mean_diff"]
            ax.errorbar([c["mean_diff"]], [y], xerr=[[c["mean_diff"] - lo], [hi - c["mean_diff"]]], fmt="o",
                        capsize=3, color=colors.get(e["config"], "k"))
            seeds = list((e.get("per_seed_difference") or {}).values())
            ax.scatter(seeds, [y] * len(seeds), s=10, alpha=0.5, color=colors.get(e["config"], "k"))
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yticks(range(len(rows)), [e["config"] for e in rows], fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_xlabel(f"Δ {obj['metric']} vs {ref}\n(95% paired t interval; dots: seeds)", fontsize=9)
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    base = [r["tokens_per_s"] for r in records if r["config"] == obj["baseline"] and r.get("tokens_per_s")]
    if base:
        ref_tps = float(np.mean(base))
        vals = [np.mean([r["tokens_per_s"] for r in records if r["config"] == c and r.get("tokens_per_s")] or [np.nan])
                / ref_tps for c in order]
        ax.barh(np.arange(len(order)), vals, color=[colors[c] for c in order])
        ax.set_yticks(np.arange(len(order)), order, fontsize=8)
        ax.axvline(1, color="k", lw=0.8)
        ax.set_xlabel(f"tokens/s relative to {obj['baseline']}", fontsize=9)
    fig.suptitle("Ablation (Fig. 3): negative Δ loss = better than the reference")
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _mean_curve(curves: list) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the mean over runs of their common length (a diverged run's NaN, null in results.json,
    reads as NaN and shows as a gap, not an error)."""
    n = min(len(c) for c in curves)
    return np.arange(1, n + 1), np.mean(np.array([c[:n] for c in curves], dtype=np.float64), axis=0)


def curve_sequences(records: Sequence[dict], grid: Optional[dict] = None) -> list[int]:
    """Distinct numbers of validation sequences the runs' validation curves scored (the first
    ``train.eval_iters`` batches, not the final validation's ``eval_iters`` ones): recorded per run
    (``val_curve_sequences``), or for older records ``train.eval_iters`` of the grid's base config
    (``grid``: results.json's "grid") times the final validation's sequences per batch."""
    from ascender_dist.config.schema import TrainConfig

    grid = grid or {}
    iters = ((grid.get("base") or {}).get("train") or {}).get("eval_iters", TrainConfig.eval_iters)
    out = set()
    for r in records:
        if not r.get("val_curve"):
            continue
        if r.get("val_curve_sequences"):
            out.add(int(r["val_curve_sequences"]))
        elif r.get("val_batches") and r.get("val_sequences"):
            batches = min(iters, r["val_batches"]) if grid.get("eval_iters") == "all" else iters  # whole split
            out.add(r["val_sequences"] // r["val_batches"] * batches)
    return sorted(out)


def plot_curves(records: Sequence[dict], out: Path, baseline: Optional[str] = None,
                colors: Optional[dict] = None, grid: Optional[dict] = None) -> None:
    """Train loss per step and validation loss every ``eval_interval`` steps (mean over seeds, one
    shared y-scale; the validation panel says how many sequences it scored, :func:`curve_sequences`), and
    each config's per-step train-loss difference to ``baseline`` paired by seed."""
    from ascender_dist.plotting import pyplot

    plt = pyplot()
    configs = list(dict.fromkeys(r["config"] for r in records))
    colors = colors or variant_colors(configs)
    fig, axes = plt.subplots(1, 3 if baseline else 2, figsize=(17 if baseline else 12, 4.4), squeeze=False,
                             layout="constrained")
    ax_train, ax_val = axes[0][0], axes[0][1]
    ax_val.sharey(ax_train)
    for cfg in configs:
        curves = [r["train_losses"] for r in records if r["config"] == cfg and r.get("train_losses")]
        if curves:
            x, y = _mean_curve(curves)
            ax_train.plot(x, y, lw=0.9, color=colors[cfg], label=f"{cfg} (n={len(curves)})")
        vals = [r["val_curve"] for r in records if r["config"] == cfg and r.get("val_curve")]
        if vals:
            n = min(len(v) for v in vals)
            steps = [p[0] for p in vals[0][:n]]
            ax_val.plot(steps, np.mean(np.array([[p[1] for p in v[:n]] for v in vals], dtype=np.float64), axis=0),
                        "o-", ms=3, lw=1,
                        color=colors[cfg], label=f"{cfg} (n={len(vals)})")
    ax_train.set_ylabel("loss (mean over seeds)")
    ax_train.set_title("train loss per step (unsmoothed)", fontsize=10)
    n_seq = curve_sequences(records, grid)
    final = sorted({int(r["val_sequences"]) for r in records if r.get("val_curve") and r.get("val_sequences")})
    ax_val.set_title("validation loss every eval_interval steps" + (
        f"\non the first {'/'.join(map(str, n_seq))} validation sequences"
        + (f" (val loss in the tables: {'/'.join(map(str, final))})" if final else "") if n_seq else ""),
        fontsize=10)
    if not any(r.get("val_curve") for r in records):
        ax_val.text(0.5, 0.5, "no validation curve recorded\n(train.eval_interval: 0)", ha="center",
                    va="center", transform=ax_val.transAxes)
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if baseline:
        ax = axes[0][2]
        base = {r["seed"]: r["train_losses"] for r in records if r["config"] == baseline and r.get("train_losses")}
        for cfg in configs:
            if cfg == baseline:
                continue
            diffs = [np.asarray(r["train_losses"][:len(base[r["seed"]])], dtype=np.float64) -
                     np.asarray(base[r["seed"]][:len(r["train_losses"])], dtype=np.float64)
                     for r in records if r["config"] == cfg and r["seed"] in base and r.get("train_losses")]
            if diffs:
                x, y = _mean_curve(diffs)
                ax.plot(x, y, lw=0.8, color=colors[cfg])
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("step")
        ax.set_title(f"train loss − {baseline} (same seed, mean over seeds)", fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = ax_train.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def connection_summary(records: Sequence[dict]) -> dict:
    """Per Connection variant: reasoning-step histogram (fraction of reasoning states per number of
    steps taken, over layers and seeds), mean steps, and the slot-load shares sorted within each run
    and layer (slot 1 = the most loaded; slot identities are not comparable across runs)."""
    out: dict = {}
    for r in records:
        for layer in (r.get("connection") or {}).values():
            e = out.setdefault(r["config"], {"hist": np.zeros(0), "sorted_loads": [], "max_steps": 0})
            h = np.asarray(layer["steps_hist"], dtype=np.float64)
            if h.size > e["hist"].size:
                e["hist"] = np.pad(e["hist"], (0, h.size - e["hist"].size))
            e["hist"][:h.size] += h
            e["max_steps"] = max(e["max_steps"], layer["max_steps"])
            load = np.sort(np.asarray(layer["slot_load"], dtype=np.float64))[::-1]
            e["sorted_loads"].append(load / load.sum() if load.sum() > 0 else load)
    summary = {}
    for cfg, e in out.items():
        frac = e["hist"] / e["hist"].sum() if e["hist"].sum() else e["hist"]
        n = min(len(x) for x in e["sorted_loads"])
        summary[cfg] = {"steps_fraction": frac.tolist(), "mean_steps": float((frac * np.arange(frac.size)).sum()),
                        "max_steps": e["max_steps"],
                        "slot_share_sorted": np.mean([x[:n] for x in e["sorted_loads"]], axis=0).tolist()}
    return summary


def plot_connection(summary: dict, out: Path, colors: dict) -> None:
    """Histogram of reasoning steps taken and slot usage (sorted load shares) per Connection variant."""
    from ascender_dist.plotting import pyplot

    plt = pyplot()
    fig, (ax_h, ax_s) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    names = list(summary)
    width = 0.8 / max(len(names), 1)
    for i, cfg in enumerate(names):
        frac = summary[cfg]["steps_fraction"]
        ax_h.bar(np.arange(len(frac)) + (i - (len(names) - 1) / 2) * width, frac, width, color=colors.get(cfg),
                 label=f"{cfg} (mean {summary[cfg]['mean_steps']:.2f})")
        share = summary[cfg]["slot_share_sorted"]
        ax_s.plot(np.arange(1, len(share) + 1), share, "o-", ms=3, color=colors.get(cfg), label=cfg)
    longest = max((len(summary[c]["steps_fraction"]) for c in names), default=1)
    ax_h.set_xticks(range(longest))
    ax_s.xaxis.get_major_locator().set_params(integer=True)
    ax_h.set_xlabel("reasoning steps taken")
    ax_h.set_ylabel("fraction of reasoning states (validation)")
    ax_h.set_title("reasoning steps per state", fontsize=10)
    ax_s.set_xlabel("slot, most to least loaded (sorted within each run and layer)")
    ax_s.set_ylabel("share of token load")
    ax_s.set_yscale("log")
    ax_s.set_title("slot usage", fontsize=10)
    for ax in (ax_h, ax_s):
        ax.grid(alpha=0.3)
    handles, labels = ax_h.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.savefig(out, dpi=130)
    plt.close(fig)


# ============================================================================ report

def _environment() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_at_report": list(load) if load else None}


def grid_info(grid: Grid, records: Sequence[dict]) -> dict:
    """The grid as results.json records it: variants with their overrides and config hash."""
    hashes = {}
    for r in records:
        h = (r.get("provenance") or {}).get("config_sha256")
        if h:
            hashes.setdefault(r["config"], set()).add(h)
    manifest = (grid.base.get("data") or {}).get("manifest")
    return {"name": grid.name, "path": grid.path, "description": grid.description, "seeds": grid.seeds,
            "baseline": grid.baseline, "compare_to": grid.compare_to, "metric": grid.metric,
            "variants": [{"name": v.name, "overrides": v.overrides,
                          "config_sha256": sorted(hashes.get(v.name, ())) or None} for v in grid.variants],
            "base": grid.base, "base_sha256": config_hash(grid.base), "eval_iters": grid.eval_iters,
            "data_manifest_sha256": file_sha256(manifest) if manifest else None,
            "data_order_axes": grid.data_order_axes, "budget": grid.budget}


def write_report(grid: Grid, records: Sequence[dict], *, n_resamples: int = 10_000,
                 n_permutations: int = 10_000, command: Optional[Sequence[str]] = None) -> dict:
    """results.md, results.json, per_sequence.npz and the figures in ``grid.report_dir``."""
    present = {r["config"] for r in records}
    missing = [f"{v.name} seed {s}" for s in grid.seeds for v in grid.variants
               if not any(r["config"] == v.name and r["seed"] == s for r in records)]
    provenance = report_provenance()
    if command is not None:
        provenance["command"] = list(command)
    full = {"grid": grid_info(grid, records), "environment": _environment(), "report_provenance": provenance,
            "missing_runs": missing,
            "compare_to": [c for c in grid.compare_to if c in present]}
    out = Path(grid.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_per_sequence(out / PER_SEQUENCE, records)
    return render(out, full, records, n_resamples=n_resamples, n_permutations=n_permutations)


def render(out: Path, full: dict, records: Sequence[dict], *, n_resamples: int = 10_000,
           n_permutations: int = 10_000) -> dict:
    """Tables, figures, results.md and results.json from ``full`` (grid, provenance) and the records."""
    g = full["grid"]
    md, obj = aggregate(records, g["baseline"], full["compare_to"], g["metric"], n_resamples=n_resamples,
                        n_permutations=n_permutations)
    order = [v["name"] for v in g["variants"] if any(r["config"] == v["name"] for r in records)]
    order += [c for c in dict.fromkeys(r["config"] for r in records) if c not in order]
    colors = variant_colors(order)
    ordered = sorted(records, key=lambda r: (order.index(r["config"]), r["seed"]))
    full["pareto"] = plot_pareto(ordered, out / "pareto.png", g["metric"], colors)
    plot_ablation(obj, ordered, out / "ablation.png", colors)
    plot_curves(ordered, out / "curves.png", g["baseline"], colors, g)
    full["connection"] = connection_summary(ordered) or None
    if full["connection"]:
        plot_connection(full["connection"], out / "connection.png", colors)
    full["tables"] = obj
    full["records"] = [{k: v for k, v in r.items() if k not in PER_SEQUENCE_KEYS and k != "step_time_s"}
                       for r in ordered]
    full["mixed_commits"] = " ".join(x for x in (mixed_commit_line(records), mixed_version_line(records),
                                                 mixed_inputs_line(records)) if x) or None
    (out / "results.md").write_text(markdown(full, md))
    (out / "results.json").write_text(json.dumps(_json_safe(full), indent=1))
    return full


def markdown(full: dict, tables_md: str) -> str:
    """results.md: every sentence from ``full`` (the results.json object)."""
    g, obj, recs = full["grid"], full["tables"], full["records"]
    r0 = recs[0]
    prov = full.get("report_provenance") or {}
    commits = sorted({(r.get("provenance") or {}).get("git_commit") or "unrecorded" for r in recs})
    lines = []
    if full.get("mixed_commits"):
        lines += [full["mixed_commits"], ""]
    lines += [f"# Ablation `{g['name']}`", "", f"Compared at {g.get('budget') or 'equal training tokens'}.", ""]
    if g.get("description"):
        lines += [g["description"], ""]
    ranks = sorted({r.get("world_size", 1) for r in recs})
    devices = sorted({str(r.get("device", "cpu")).split(":")[0] for r in recs})
    lines += [
        f"Generated by `ascender-dist ablate {g['path']}`; rebuilt by `ascender-dist tables <this directory>`. "
        f"{len(recs)} runs: {len({r['config'] for r in recs})} variants × seeds {obj['seeds']}; "
        + (f"every run trained {r0['steps']} steps ({r0['tokens']:,} tokens)"
           if len({r['steps'] for r in recs}) == 1 else
           f"runs trained {min(r['steps'] for r in recs)}-{max(r['steps'] for r in recs)} steps")
        + f" on {'/'.join(map(str, ranks))} {'/'.join(devices)} rank(s) and was scored on {r0['val_sequences']} validation sequences. Differences are config − reference "
        "(negative = lower loss).", "",
        _provenance_sentence(commits, prov, g, recs), "",
        f"Over seeds: paired t interval and paired t-test over the {len(obj['seeds'])} seeds (at any number of "
        "seeds); p-values Holm-adjusted, per test, over the distinct comparisons of the report (a − b and "
        "b − a counted once; the final-train-loss table on its own). The exact randomisation test over "
        f"{len(obj['seeds'])} seeds cannot give p below 2/2^{len(obj['seeds'])} = {obj['exact_p_floor']:.3g} "
        "(its p is in results.json as p_randomization). The per-sequence tables say whether a difference of these "
        "trained models would hold on another validation set like this one, not for another training seed.", "",
    ]
    if "per_example" not in obj:
        lines += ["No per-sequence validation losses are stored with these records: no per-sequence tables.", ""]
    unpaired = [s for s, p in obj["data_pairing"].items() if p["identical"] is False]
    unknown = [s for s, p in obj["data_pairing"].items() if p["identical"] is None]
    lines += ["Training-data pairing: " + (
        f"seeds {unpaired} did NOT see identical data across variants (axes {g.get('data_order_axes')}): "
        "seed-paired tests are not data-paired there." if unpaired else
        f"not known for seeds {unknown}: some of their runs recorded no hash of the tokens they read." if unknown
        else "every variant of a seed read identical training tokens (sha256 of all consumed tokens)."), ""]
    if full.get("missing_runs"):
        lines += [f"Missing runs (not in the tables): {', '.join(full['missing_runs'])}", ""]
    if full.get("connection"):
        lines += ["### Connection reasoning (validation pass; `connection.png`)", "",
                  "| config | max steps | mean steps taken | steps histogram (fraction at 0, 1, ...) | "
                  "share of the most loaded slot |", "|---|---:|---:|---|---:|"]
        for cfg, c in full["connection"].items():
            hist = " / ".join(f"{x:.2f}" for x in c["steps_fraction"])
            lines.append(f"| {cfg} | {c['max_steps']} | {c['mean_steps']:.2f} | {hist} | "
                         f"{c['slot_share_sorted'][0]:.3f} |")
        lines.append("")
    lines += [tables_md, "", "Figures: `pareto.png` (Fig. 2, quality vs cost), `ablation.png` (Fig. 3, differences "
              "with paired t intervals and per-seed differences), `curves.png` (train loss per step, validation "
              "loss every eval_interval steps, and the per-step train-loss difference to the baseline).", ""]
    return "\n".join(lines)


def _provenance_sentence(commits: list, prov: dict, g: dict, records: Sequence[dict]) -> str:
    runs = ("no git commit recorded in the runs" if commits == ["unrecorded"]
            else "run commit(s) " + ", ".join(c[:12] for c in commits))
    report = (f"report written at commit {prov['git_commit'][:12]}{' (dirty)' if prov.get('git_dirty') else ''}"
              if prov.get("git_commit") else "report commit not recorded")
    run_versions = versions_of(records)  # the runs' own; the report's when the runs recorded none
    vers = (", ".join(f"{k} {' / '.join(v)}" for k, v in run_versions.items()) if run_versions else
            ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items()))
    data = g.get("data_manifest_sha256")
    machines = sorted({machine_line(m) for m in ((r.get("provenance") or {}).get("machine") for r in records) if m})
    where = ("; runs on " + " and ".join(machines)) if machines else "; CPU of the runs not recorded"
    return (f"Provenance: {runs}; {report}" + (f"; versions {vers}" if vers else "") + where
            + (f"; data manifest sha256 {data[:16]}" if data else "") + ".")


def write_per_sequence(path: Path, records: Sequence[dict]) -> None:
    """Per-sequence validation losses, indices and document ids of every run (compressed)."""
    arrays = {}
    for r in records:
        for key in PER_SEQUENCE_KEYS:
            if r.get(key) is not None:
                arrays[f"{r['config']}|{r['seed']}|{key}"] = np.asarray(r[key])
    np.savez_compressed(path, **arrays)


def read_per_sequence(path: Path) -> dict:
    """``{(config, seed): {key: list}}`` from :func:`write_per_sequence`'s file."""
    import zipfile

    out: dict = {}
    try:
        with np.load(path) as data:
            for name in data.files:
                cfg, seed, key = name.rsplit("|", 2)
                out.setdefault((cfg, seed), {})[key] = data[name].tolist()
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # truncated, corrupt, not an npz
        raise AblationError(f"{path}: unreadable ({exc}); nothing was rewritten") from None
    return out


def rebuild(directory: Path, *, n_resamples: int = 10_000, n_permutations: int = 10_000) -> dict:
    """``ascender-dist tables DIR``: results.md, results.json and figures again from DIR's results.json
    and per_sequence.npz (no training)."""
    directory = Path(directory)
    full = json.loads((directory / "results.json").read_text())
    records = [dict(r) for r in full["records"]]
    per_seq_path = directory / PER_SEQUENCE
    if per_seq_path.exists():
        per_seq = read_per_sequence(per_seq_path)
    elif (full.get("tables") or {}).get("per_example"):  # rebuilding without it would drop those tables for good
        raise AblationError(f"{per_seq_path}: missing, but {directory / 'results.json'} holds per-sequence results; "
                            "restore it (nothing was rewritten)")
    else:
        per_seq = {}
    for r in records:
        r.update(per_seq.get((r["config"], str(r["seed"])), {}))
    full.setdefault("compare_to", [c for c in full["grid"].get("compare_to", [])
                                   if any(r["config"] == c for r in records)])
    full["report_provenance"] = report_provenance()
    return render(directory, full, records, n_resamples=n_resamples, n_permutations=n_permutations)


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
