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


def _saved_config_agrees(saved: Path, got: str, want: str) -> bool:
    """The run's own config.yaml (written whole at launch) is the config its record hashed (``got``),
    and read with today's schema it is the config the grid asks for (``want``): only the schema grew
    since the run (a field added later, at its default, changes the hash of unchanged settings)."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.config.loader import from_dict, read_yaml_file, to_dict
    from ascender_dist.config.schema import RunConfig

    from .provenance import config_hash

    try:
        raw = read_yaml_file(saved)
        return config_hash(raw) == got and config_hash(to_dict(from_dict(RunConfig, raw))) == want
    except (OSError, ConfigError):
        return False


def check_recorded_config(grid: Grid, variant: Variant, seed: int, record: dict) -> None:
    """Refuse a finished run whose recorded config hash is not that of the config the grid asks for now
    (a ``--set`` or an edited grid after the run), unless the run's saved config shows the settings are
    the same and only the schema grew (:func:`_saved_config_agrees`). Records without a hash (older
    runs) pass."""
    from ascender_dist.config.loader import to_dict

    from .provenance import config_hash

    cfg = run_config(grid, variant, seed)
    asked = grid.eval_iters if grid.eval_iters is not None else cfg.train.eval_iters
    if record.get("eval_iters", asked) != asked:  # not in the config hash: a flag of the run (older records: none)
        raise AblationError(f"{run_dir(grid, variant, seed)}: {RESULT} was validated over eval_iters "
                            f"{record['eval_iters']!r}, the grid now asks for {asked!r} (another validation set); "
                            "remove the run directory to re-run it, or use another --runs-dir")
    _check_recorded_data(grid, variant, seed, record, cfg.data.manifest)
    got = (record.get("provenance") or {}).get("config_sha256")
    if got is None:
        return
    want = config_hash(to_dict(cfg))
    if got != want and not _saved_config_agrees(run_dir(grid, variant, seed) / "config.yaml", got, want):
        raise AblationError(f"{run_dir(grid, variant, seed)}: {RESULT} was trained with config sha256 {got[:12]}, "
                            f"the grid now asks for {want[:12]} (grid or --set changed since); remove the run "
                            "directory to re-run it, or use another --runs-dir")


def _check_recorded_data(grid: Grid, variant: Variant, seed: int, record: dict, manifest: str) -> None:
    """Refuse a finished run trained on other data than the grid's manifest holds now: the config
    names the manifest's path, not its content (a dataset root rebuilt with other settings, or the
    embedded corpus under another Python). Records without the hash (older runs) pass."""
    from .provenance import file_sha256

    got = (record.get("provenance") or {}).get("data_manifest_sha256")
    now = file_sha256(manifest) if manifest and Path(manifest).is_file() else None
    if got is not None and now is not None and got != now:
        raise AblationError(f"{run_dir(grid, variant, seed)}: {RESULT} was trained on data manifest sha256 "
                            f"{got[:12]}, {manifest} is now {now[:12]} (the dataset was rebuilt); remove the run "
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


def check_same_validation(records: Sequence[dict]) -> None:
    """Every record was scored on the same validation set: a table compares their losses, which over
    different sets compares the sets too. The set is the split's first ``val_sequences`` sequences
    (eval_iters micro-batches in all, whatever the ranks; ``val_batches`` is per rank and differs
    between runs at other rank counts that read the same set)."""
    sets = {}
    for r in records:
        sets.setdefault(r.get("val_sequences"), f"{r['config']} seed {r.get('seed')}")
    if len(sets) > 1:
        (a, first), (b, second) = list(sets.items())[:2]
        raise AblationError(f"runs validated on different sets: {first} on {a} sequences, {second} on {b}; "
                            "re-run them with one eval_iters")


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


def _per_sequence_runs(records: Sequence[dict]) -> tuple[dict, dict]:
    """``({config: {seed: run}}, {config: [seeds]})``: the runs with per-sequence losses, and those whose
    losses are not all finite (a diverged run: left out of the per-sequence tests and named)."""
    by_cfg: dict[str, dict] = {}
    diverged: dict[str, list] = {}
    for r in records:
        if not r.get("val_example_losses"):
            continue
        losses = np.asarray(r["val_example_losses"], dtype=np.float64)  # a None (JSON null) reads as NaN
        if not np.all(np.isfinite(losses)):
            diverged.setdefault(r["config"], []).append(r["seed"])
            continue
        by_cfg.setdefault(r["config"], {})[r["seed"]] = {
            "losses": losses, "index": r.get("val_example_index"), "documents": r.get("val_example_documents")}
    return by_cfg, diverged


def _diverged_note(seeds: list) -> str:
    return (f"{len(seeds)} diverged run(s) left out (seed(s) {', '.join(map(str, seeds))}: per-sequence losses "
            "not finite)")


def per_example_table(records: Sequence[dict], reference: str, *, n_resamples: int = 10_000,
                      n_permutations: int = 10_000, seed: int = 0, digits: int = 4) -> tuple[str, dict]:
    """Each config vs ``reference`` per validation sequence (losses averaged over shared seeds).

    Resampling unit: the document (all validation windows of one document together,
    :func:`ascender_dist.research.stats.compare_per_document`) when the runs recorded document ids;
    otherwise single sequences, and the table says so. p-values Holm-adjusted over the table's rows (a
    report re-adjusts over all its per-sequence tables: :func:`adjust_over_report`). Runs with non-finite
    losses (diverged) are left out and named."""
    from ..tables import holm_table

    by_cfg, diverged = _per_sequence_runs(records)
    if reference not in by_cfg:
        missing = f"no per-sequence losses for {reference!r}" + (
            f" ({_diverged_note(diverged[reference])})" if reference in diverged else "")
        obj = {"reference": reference, "configs": [], "diverged": diverged, "missing": missing}
        return per_example_markdown(obj, digits), obj
    base = by_cfg[reference]
    entries = []
    for cfg in dict.fromkeys([*by_cfg, *diverged]):
        if cfg == reference:
            continue
        entry = _per_example_entry(cfg, by_cfg.get(cfg, {}), base, n_resamples=n_resamples,
                                   n_permutations=n_permutations, seed=seed)
        notes = [x for x in (_diverged_note(diverged[cfg]) if cfg in diverged else None, entry["note"]) if x]
        entry["note"] = "; ".join(notes) or None
        entries.append(entry)
    intervals = [e["comparison"]["interval"] for e in entries if e["comparison"]]
    units = sorted({e["unit"] for e in entries if e.get("unit")})
    obj = {"reference": reference, "unit": units, "resampling": _resampling_sentence(units, intervals),
           "difference": "config - reference", "n_resamples": n_resamples, "n_permutations": n_permutations,
           "diverged": diverged, "configs": entries}
    holm_table(obj)
    return per_example_markdown(obj, digits), obj


def _per_example_entry(cfg: str, runs: dict, base: dict, **kw) -> dict:
    """One row of :func:`per_example_table`: ``cfg``'s runs against the reference's on their shared
    seeds with equal validation sets (or a note why there is no test)."""
    from ..stats import BOOTSTRAP_MIN_N, compare_per_document, compare_per_example

    shared = [s for s in runs if s in base and _aligned(runs[s], base[s])]
    if not shared:
        return {"config": cfg, "comparison": None, "note": "no shared seed with equal validation sets"}
    b = np.stack([base[s]["losses"] for s in shared])  # [seeds, sequences]
    t = np.stack([runs[s]["losses"] for s in shared])
    docs = base[shared[0]]["documents"]
    if docs is not None and len(docs) == b.shape[1] and len(set(docs)) < 2:
        return {"config": cfg, "comparison": None, "paired_seeds": shared,
                "note": f"all {b.shape[1]} validation sequences lie in one document: no per-document test"}
    if docs is not None and len(docs) == b.shape[1]:
        cmp, unit = compare_per_document(b, t, docs, **kw), "document"
    elif b.shape[1] < BOOTSTRAP_MIN_N:  # compare_per_example's percentile bootstrap refuses so few
        return {"config": cfg, "comparison": None, "paired_seeds": shared,
                "note": f"{b.shape[1]} validation sequences without document ids: below the {BOOTSTRAP_MIN_N} a "
                        "per-sequence bootstrap needs"}
    else:
        cmp, unit = compare_per_example(b, t, **kw), "sequence"
    d = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in cmp.to_dict().items()}
    return {"config": cfg, "paired_seeds": shared, "n_sequences": int(b.shape[1]),
            "n_documents": int(np.unique(docs).size) if unit == "document" else None,
            "unit": unit, "comparison": d, "note": None}


def _resampling_sentence(units: list, intervals: list) -> str:
    """What a per-sequence table resampled, as one sentence under it."""
    if not units:  # every row was skipped (its note says why)
        return "No per-sequence test in this table."
    if units == ["document"]:
        return ("Resampling unit: the document (all validation windows of a document drawn together; percentile "
                "bootstrap over documents, sign-flip test on documents' summed differences). "
                + interval_note(intervals))
    return ("Resampling unit: single validation sequences for the rows without recorded document ids (older "
            "records): windows of one document are treated as independent, so these intervals are too narrow.")


def per_example_markdown(obj: dict, digits: int = 4) -> str:
    """The markdown of a :func:`per_example_table` object (rendered from it alone, so a report renders it
    again after re-adjusting ``p_holm`` over all its per-sequence tables)."""
    if obj.get("missing"):
        return f"- {obj['missing']}\n"
    m, reference, entries = obj["holm_m"], obj["reference"], obj["configs"]
    label = interval_label([e["comparison"]["interval"] for e in entries if e["comparison"]])
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
    notes = [f"- {e['config']}: {e['note']}" for e in entries if e.get("note")]
    if reference in obj.get("diverged", {}):
        notes.insert(0, f"- {reference} (reference): {_diverged_note(obj['diverged'][reference])}")
    return ("\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")
            + f"\n\n{obj['resampling']} p Holm: {obj['multiple_comparisons']}.\n")


SEED_FAMILY = "the report's over-seed tables (each distinct comparison once: b − a is a − b again)"
SEQUENCE_FAMILY = "the report's per-sequence tables (each distinct comparison once: b − a is a − b again)"


def holm_family(tables: Sequence[dict]) -> dict:
    """``{frozenset((config, reference)): Holm-adjusted p}`` over the distinct comparisons of ``tables``
    (results_table / per_example_table objects, or the same from results.json). ``b − a`` after ``a − b``
    is the same comparison with the same p (the paired t-test and the sign-flip test are symmetric), so
    it is counted once: the family is what a reader of the report sees, not how many tables show it."""
    from ..stats import holm

    pairs: dict = {}
    for table in tables:
        ref = table["baseline"] if "baseline" in table else table["reference"]
        for e in table["configs"]:
            if e.get("comparison") and e["config"] != ref:
                pairs.setdefault(frozenset((ref, e["config"])), e["comparison"].get("p_value"))
    return dict(zip(pairs, holm(list(pairs.values()))))


def report_families(tables: dict) -> tuple[list, list]:
    """A report's comparison tables grouped into its two Holm families: the over-seed t-tests (the
    main table and every ``vs`` table) and the per-sequence tests."""
    return [tables["main"], *tables.get("vs", {}).values()], list((tables.get("per_example") or {}).values())


def adjust_over_report(obj: dict) -> None:
    """Holm over a report's distinct comparisons, per test: the over-seed t-tests of the main and ``vs``
    tables form one family, the per-sequence tests another (each table adjusted on its own under-counted
    the family a reader sees). Sets every ``p_holm`` and each table's ``holm_m``."""
    from ..tables import holm_table

    for tables, family in zip(report_families(obj), (SEED_FAMILY, SEQUENCE_FAMILY)):
        adjusted = holm_family(tables)
        for table in tables:
            holm_table(table, adjusted, family)


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


def _distinct_omegas(layer: list) -> list:
    """A layer's recorded ω rows, one per head; a shared ω (every head's row the same) counts once."""
    return layer[:1] if all(row == layer[0] for row in layer) else layer


def omega_table(records: Sequence[dict], order: Sequence[str]) -> tuple[str, dict]:
    """Mean learned omega per bias (over layers, heads and seeds) for the ASCender configs, with the
    sample std (ddof 1, as every other std here) over the distinct values: each head's, or each
    layer's once where ω is shared by the heads (it is recorded once per head)."""
    lines = ["| config | ω_align | ω_sep | ω_coh |", "|---|---:|---:|---:|"]
    entries = []
    by_cfg: dict[str, list] = {}
    for r in records:
        if r.get("omega"):
            rows = [h for layer in r["omega"].values() for h in _distinct_omegas(layer)]
            by_cfg.setdefault(r["config"], []).append(np.array(rows))
    for cfg in [c for c in order if c in by_cfg]:
        arr = np.concatenate(by_cfg[cfg])  # [values, 3]: runs x layers x (heads, or 1 when shared)
        mean, std = arr.mean(0), arr.std(0, ddof=1) if len(arr) > 1 else np.full(3, np.nan)
        entries.append({"config": cfg, "mean": mean.tolist(), "std_over_heads": std.tolist(), "n_heads": len(arr)})
        lines.append(f"| {cfg} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(mean, std)) + " |")
    return "\n".join(lines) + "\n", {"configs": entries}


def data_pairing(records: Sequence[dict]) -> dict:
    """Per seed: do all configs share the training-data hash? (None: unknown, a record without one.)"""
    by_seed: dict = {}
    for r in records:
        by_seed.setdefault(r["seed"], {})[r["config"]] = r.get("data_sha256")
    return {str(s): {"identical": None if None in h.values() else len(set(h.values())) == 1, "configs": sorted(h)}
            for s, h in by_seed.items()}


def aggregate(records: Sequence[dict], baseline: str, compare_to: Sequence[str] = (), metric: str = "val_loss",
              *, n_resamples: int = 10_000, n_permutations: int = 10_000, seed: int = 0) -> tuple[str, dict]:
    """All tables of an ablation from run records (``{"config", "seed", metric, ...}``). p Holm is over the
    report's distinct comparisons, per test (:func:`adjust_over_report`); the final-train-loss table is
    adjusted on its own. Returns (markdown, json)."""
    from ..tables import results_markdown, results_table

    if not records:
        raise ValueError("no run records to aggregate")
    check_same_validation(records)
    order = list(dict.fromkeys(r["config"] for r in records))
    kw = dict(n_resamples=n_resamples, n_permutations=n_permutations, seed=seed)
    seeds = sorted({r["seed"] for r in records})
    obj = {"metric": metric, "baseline": baseline, "compare_to": list(compare_to), "seeds": seeds,
           "exact_p_floor": 2.0 / 2 ** len(seeds) if seeds else None}
    obj["main"] = results_table(records, baseline, metric, **kw)[1]
    obj["vs"] = {ref: results_table(records, ref, metric, **kw)[1] for ref in compare_to}
    if any(r.get("val_example_losses") for r in records) and metric == "val_loss":
        obj["per_example"] = {ref: per_example_table(records, ref, **kw)[1] for ref in [baseline, *compare_to]}
    adjust_over_report(obj)
    md = []
    for ref, table in [(baseline, obj["main"]), *obj["vs"].items()]:
        md += [f"### {metric} vs {ref} (paired by seed; paired t interval and t-test, Holm over the report's "
               f"{table['holm_m']} distinct comparisons)", "", results_markdown(table)]
    for ref, table in (obj.get("per_example") or {}).items():
        md += [f"### val loss vs {ref}, per validation sequence (seeds averaged)", "", per_example_markdown(table)]
    if all("final_train_loss" in r for r in records) and any(r["final_train_loss"] is not None for r in records):
        tr_md, obj["final_train_loss"] = results_table(records, baseline, "final_train_loss", **kw)
        md += [f"### final train loss (mean of the last 10% of steps) vs {baseline}", "", tr_md]
    if all("params" in r and "flops_per_token" in r for r in records):
        c_md, obj["cost"] = cost_table(records, order)
        md += ["### cost", "", c_md]
    if any(r.get("omega") for r in records):
        o_md, obj["omega"] = omega_table(records, order)
        md += ["### learned ω (mean ± std over layers × heads × seeds; a shared ω once per layer)", "", o_md]
    obj["data_pairing"] = data_pairing(records)
    return "\n".join(md), obj
