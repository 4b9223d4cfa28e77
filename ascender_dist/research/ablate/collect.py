"""Run records -> tables: load finished runs, paired tables per reference, cost, omega, data pairing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np


from .grid import RESULT, AblationError, Grid, Variant, run_config, run_dir



def _load_record(result_file: Path, variant_name: str) -> dict:
    record = json.loads(Path(result_file).read_text())
    record["config"] = variant_name
    return record


def check_recorded_config(grid: Grid, variant: Variant, seed: int, record: dict) -> None:
    """Refuse a finished run whose recorded config hash is not that of the config the grid asks for now
    (a ``--set`` or an edited grid after the run). Records without a hash (older runs) pass."""
    from ascender_dist.config.loader import to_dict

    from .provenance import config_hash

    got = (record.get("provenance") or {}).get("config_sha256")
    if got is None:
        return
    want = config_hash(to_dict(run_config(grid, variant, seed)))
    if got != want:
        raise AblationError(f"{run_dir(grid, variant, seed)}: {RESULT} was trained with config sha256 {got[:12]}, "
                            f"the grid now asks for {want[:12]} (grid or --set changed since); remove the run "
                            "directory to re-run it, or use another --runs-dir")


def load_checked_record(grid: Grid, variant: Variant, seed: int) -> dict:
    """The record of a finished run, refused if it was trained with another config than the grid's now."""
    record = _load_record(run_dir(grid, variant, seed) / RESULT, variant.name)
    check_recorded_config(grid, variant, seed, record)
    return record


def collect_records(grid: Grid) -> list[dict]:
    """Records of every finished run of the grid (missing runs are left out); a run trained with another
    config than the grid asks for now is refused (:func:`check_recorded_config`)."""
    out = []
    for s in grid.seeds:
        for v in grid.variants:
            if (run_dir(grid, v, s) / RESULT).exists():
                out.append(load_checked_record(grid, v, s))
    return out


# ============================================================================ aggregation

def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def _num(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.0f}"


def _aligned(run: dict, base: dict) -> bool:
    """Two runs scored the same validation rows (same global indices, or same count when unrecorded)."""
    if run.get("index") is not None and base.get("index") is not None:
        return list(run["index"]) == list(base["index"])
    return run["losses"].shape == base["losses"].shape


def interval_label(intervals: Sequence[str]) -> str:
    """How a table's per-sequence intervals are labelled: "95% (calibrated)" only when every one is a
    document bootstrap calibrated by simulation to 95% coverage at its design
    (:func:`ascender_dist.research.stats.compare_per_document`), else "nominal 95%"."""
    calibrated = bool(intervals) and all("calibrated to 95% coverage" in i for i in intervals)
    return "95% (calibrated)" if calibrated else "nominal 95%"


def interval_note(intervals: Sequence[str]) -> str:
    """One sentence on the per-sequence intervals' level, for under the table."""
    if interval_label(intervals) == "95% (calibrated)":
        levels = sorted({i.split("percentile at ")[1].split(",")[0] for i in intervals})
        return (f"95% (calibrated): percentile interval at {'/'.join(levels)}, the level at which simulated "
                "experiments at these documents' window counts cover the true difference 95% of the time "
                "(the plain 95% percentile interval covers ~90% there).")
    return ("Nominal 95%: plain percentile intervals, their coverage at this design not checked by simulation "
            "(with few documents of uneven size they cover less).")


def per_example_table(records: Sequence[dict], reference: str, *, n_resamples: int = 10_000,
                      n_permutations: int = 10_000, seed: int = 0, digits: int = 4) -> tuple[str, dict]:
    """Each config vs ``reference`` per validation sequence (losses averaged over shared seeds).

    Resampling unit: the document (all validation windows of one document together,
    :func:`ascender_dist.research.stats.compare_per_document`) when the runs recorded document ids;
    otherwise single sequences, and the table says so. p-values Holm-adjusted over the table's rows."""
    from ..stats import compare_per_document, compare_per_example, holm

    by_cfg: dict[str, dict] = {}
    for r in records:
        if r.get("val_example_losses"):
            by_cfg.setdefault(r["config"], {})[r["seed"]] = {
                "losses": np.asarray(r["val_example_losses"], dtype=np.float64),
                "index": r.get("val_example_index"), "documents": r.get("val_example_documents")}
    if reference not in by_cfg:
        return f"- no per-sequence losses for {reference!r}\n", {"reference": reference, "configs": []}
    base = by_cfg[reference]
    entries, cmps = [], []
    for cfg, runs in by_cfg.items():
        if cfg == reference:
            continue
        shared = [s for s in runs if s in base and _aligned(runs[s], base[s])]
        if not shared:
            entries.append({"config": cfg, "comparison": None, "note": "no shared seed with equal validation sets"})
            cmps.append(None)
            continue
        b = np.stack([base[s]["losses"] for s in shared])  # [seeds, sequences]
        t = np.stack([runs[s]["losses"] for s in shared])
        docs = base[shared[0]]["documents"]
        kw = dict(n_resamples=n_resamples, n_permutations=n_permutations, seed=seed)
        if docs is not None and len(docs) == b.shape[1] and len(set(docs)) < 2:
            entries.append({"config": cfg, "comparison": None, "paired_seeds": shared,
                            "note": f"all {b.shape[1]} validation sequences lie in one document: no per-document test"})
            cmps.append(None)
            continue
        if docs is not None and len(docs) == b.shape[1]:
            cmp, unit = compare_per_document(b, t, docs, **kw), "document"
        else:
            cmp, unit = compare_per_example(b, t, **kw), "sequence"
        cmps.append(cmp)
        d = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in cmp.to_dict().items()}
        entries.append({"config": cfg, "paired_seeds": shared, "n_sequences": int(b.shape[1]),
                        "n_documents": int(np.unique(docs).size) if unit == "document" else None,
                        "unit": unit, "comparison": d, "note": None})
    adjusted = holm([c.p_value if c is not None else None for c in cmps])
    for e, p_adj in zip(entries, adjusted):
        if e["comparison"]:
            e["comparison"]["p_holm"] = p_adj
    m = sum(c is not None for c in cmps)
    label = interval_label([c.interval for c in cmps if c is not None])
    lines = [f"| config | seeds | sequences | documents | Δ val loss vs {reference} [{label} CI] | p | "
             f"p Holm (m={m}) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        c = e["comparison"]
        if not c:
            lines.append(f"| {e['config']} | {len(e.get('paired_seeds') or [])} | n/a | n/a | n/a | n/a | n/a |")
            continue
        docs_cell = str(e["n_documents"]) if e["n_documents"] is not None else "not recorded"
        lines.append(f"| {e['config']} | {len(e['paired_seeds'])} | {e['n_sequences']} | {docs_cell} | "
                     f"{_fmt(c['mean_diff'], digits)} [{_fmt(c['ci_low'], digits)}, {_fmt(c['ci_high'], digits)}] "
                     f"| {_fmt(c['p_value'], 3)} | {_fmt(c['p_holm'], 3)} |")
    units = sorted({e["unit"] for e in entries if e.get("unit")})
    if not units:  # every row was skipped (its note says why)
        how = "No per-sequence test in this table."
    elif units == ["document"]:
        how = ("Resampling unit: the document (all validation windows of a document drawn together; percentile "
               "bootstrap over documents, sign-flip test on documents' summed differences). "
               + interval_note([c.interval for c in cmps if c is not None]))
    else:
        how = ("Resampling unit: single validation sequences for the rows without recorded document ids (older "
               "records): windows of one document are treated as independent, so these intervals are too narrow.")
    notes = [f"- {e['config']}: {e['note']}" for e in entries if e.get("note")]
    md = ("\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")
          + f"\n\n{how} p Holm: Holm-adjusted over the {m} comparisons of this table.\n")
    obj = {"reference": reference, "unit": units, "resampling": how,
           "multiple_comparisons": f"Holm over the {m} comparisons of this table",
           "difference": "config - reference", "n_resamples": n_resamples, "n_permutations": n_permutations,
           "configs": entries}
    return md, obj


def cost_table(records: Sequence[dict], order: Sequence[str]) -> tuple[str, dict]:
    """Parameters, FLOPs and measured cost per config (mean +- std over seeds where they vary)."""
    by_cfg: dict[str, list] = {}
    for r in records:
        by_cfg.setdefault(r["config"], []).append(r)
    lines = ["| config | params | FLOPs/token (train) | training FLOPs | tokens/s mean ± std | step time (s) "
             "| peak RSS (MiB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    entries = []
    for cfg in [c for c in order if c in by_cfg]:
        rs = by_cfg[cfg]
        tps = np.array([r["tokens_per_s"] for r in rs if r.get("tokens_per_s")], dtype=np.float64)
        steps = np.array([r["median_step_time_s"] for r in rs if r.get("median_step_time_s")], dtype=np.float64)
        rss = np.array([r["peak_rss_mib"] for r in rs], dtype=np.float64)
        e = {"config": cfg, "n": len(rs), "params": rs[0]["params"], "flops_per_token": rs[0]["flops_per_token"],
             "training_flops": float(np.mean([r["training_flops"] for r in rs])),
             "tokens_per_s_mean": float(tps.mean()) if tps.size else None,
             "tokens_per_s_std": float(tps.std(ddof=1)) if tps.size > 1 else None,
             "median_step_time_s": float(np.median(steps)) if steps.size else None,
             "peak_rss_mib_mean": float(rss.mean())}
        entries.append(e)
        lines.append(f"| {cfg} | {e['params']:,} | {e['flops_per_token']:.4g} | {e['training_flops']:.3g} | "
                     f"{_num(e['tokens_per_s_mean'])} ± {_num(e['tokens_per_s_std'])} | "
                     f"{_fmt(e['median_step_time_s'], 3)} | {e['peak_rss_mib_mean']:.0f} |")
    return "\n".join(lines) + "\n", {"configs": entries}


def omega_table(records: Sequence[dict], order: Sequence[str]) -> tuple[str, dict]:
    """Mean learned omega per bias (over layers, heads and seeds) for the ASCender configs."""
    lines = ["| config | ω_align | ω_sep | ω_coh |", "|---|---:|---:|---:|"]
    entries = []
    by_cfg: dict[str, list] = {}
    for r in records:
        if r.get("omega"):
            by_cfg.setdefault(r["config"], []).append(np.array([h for layer in r["omega"].values() for h in layer]))
    for cfg in [c for c in order if c in by_cfg]:
        arr = np.concatenate(by_cfg[cfg])  # [runs*layers*heads, 3]
        mean, std = arr.mean(0), arr.std(0)
        entries.append({"config": cfg, "mean": mean.tolist(), "std_over_heads": std.tolist(), "n_heads": len(arr)})
        lines.append(f"| {cfg} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(mean, std)) + " |")
    return "\n".join(lines) + "\n", {"configs": entries}


def data_pairing(records: Sequence[dict]) -> dict:
    """Per seed: do all configs share the training-data hash?"""
    by_seed: dict = {}
    for r in records:
        by_seed.setdefault(r["seed"], {})[r["config"]] = r.get("data_sha256")
    return {str(s): {"identical": len(set(h.values())) == 1, "configs": sorted(h)} for s, h in by_seed.items()}


def aggregate(records: Sequence[dict], baseline: str, compare_to: Sequence[str] = (), metric: str = "val_loss",
              *, n_resamples: int = 10_000, n_permutations: int = 10_000, seed: int = 0) -> tuple[str, dict]:
    """All tables of an ablation from run records (``{"config", "seed", metric, ...}``). Returns (markdown, json)."""
    from ..tables import results_table

    if not records:
        raise ValueError("no run records to aggregate")
    order = list(dict.fromkeys(r["config"] for r in records))
    kw = dict(n_resamples=n_resamples, n_permutations=n_permutations, seed=seed)
    seeds = sorted({r["seed"] for r in records})
    md, obj = [], {"metric": metric, "baseline": baseline, "compare_to": list(compare_to), "seeds": seeds,
                   "exact_p_floor": 2.0 / 2 ** len(seeds) if seeds else None}
    main_md, obj["main"] = results_table(records, baseline, metric, **kw)
    md += [f"### {metric} vs {baseline} (paired by seed; paired t interval and t-test, Holm over the table)", "",
           main_md]
    obj["vs"] = {}
    for ref in compare_to:
        ref_md, obj["vs"][ref] = results_table(records, ref, metric, **kw)
        md += [f"### {metric} vs {ref} (paired by seed; paired t interval and t-test, Holm over the table)", "",
               ref_md]
    if any(r.get("val_example_losses") for r in records) and metric == "val_loss":
        obj["per_example"] = {}
        for ref in [baseline, *compare_to]:
            pe_md, obj["per_example"][ref] = per_example_table(records, ref, **kw)
            md += [f"### val loss vs {ref}, per validation sequence (seeds averaged)", "", pe_md]
    if all(r.get("final_train_loss") is not None for r in records):
        tr_md, obj["final_train_loss"] = results_table(records, baseline, "final_train_loss", **kw)
        md += [f"### final train loss (mean of the last 10% of steps) vs {baseline}", "", tr_md]
    if all("params" in r and "flops_per_token" in r for r in records):
        c_md, obj["cost"] = cost_table(records, order)
        md += ["### cost", "", c_md]
    if any(r.get("omega") for r in records):
        o_md, obj["omega"] = omega_table(records, order)
        md += ["### learned ω (mean ± std over layers × heads × seeds)", "", o_md]
    obj["data_pairing"] = data_pairing(records)
    return "\n".join(md), obj
