"""Ablation tables (mean +- std over seeds, paired tests against a baseline) and the Pareto front.

Rows are flat dicts, one per (configuration, seed) run, e.g.
``{"config": "asc", "seed": 3, "val_loss": 3.41, "tokens_per_s": 51200}``. Each table comes back as
markdown (for reports) and as a JSON-ready dict (NaN/inf written as ``null``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np

from . import stats

__all__ = ["holm_table", "pareto_front", "results_markdown", "results_table", "summary_table"]


def _finite_or_none(x):
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


def _fmt(x, digits: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def _group(rows: Sequence[dict], metric: str, config_key: str, seed_key: str,
           allow_non_finite: bool = False) -> dict[str, dict]:
    """``{config: {seed: value}}`` in order of first appearance; rejects duplicates and bad rows. With
    ``allow_non_finite`` a ``None`` value reads as NaN: results.json writes non-finite values as null."""
    groups: dict[str, dict] = {}
    for i, row in enumerate(rows):
        for key in (config_key, seed_key, metric):
            if key not in row:
                raise ValueError(f"row {i}: missing key {key!r} (row keys: {sorted(row)})")
        try:
            value = math.nan if allow_non_finite and row[metric] is None else float(row[metric])
        except (TypeError, ValueError):
            raise ValueError(f"row {i}: {metric}={row[metric]!r} is not a number") from None
        if not allow_non_finite and not math.isfinite(value):
            raise ValueError(f"row {i}: {metric}={value} is not finite (config {row[config_key]!r})")
        cfg, seed = str(row[config_key]), row[seed_key]
        per_seed = groups.setdefault(cfg, {})
        if seed in per_seed:
            raise ValueError(f"row {i}: duplicate run for config {cfg!r} seed {seed!r}")
        per_seed[seed] = value
    return groups


def _split_diverged(groups: dict[str, dict]) -> tuple[dict[str, dict], dict[str, list]]:
    """``({config: {seed: finite value}}, {config: [seeds whose value is not finite]})``. A run whose
    metric is NaN or inf diverged; training is deterministic, so re-running it diverges again: it is
    left out of the statistics and named, rather than making the whole grid impossible to report."""
    finite = {cfg: {s: v for s, v in runs.items() if math.isfinite(v)} for cfg, runs in groups.items()}
    diverged = {cfg: [s for s, v in runs.items() if not math.isfinite(v)] for cfg, runs in groups.items()}
    return finite, diverged


PER_SEED_BELOW = 10  # below this many seeds every seed's value and paired difference is listed
UNDEFINED_P = "undefined (sd = 0)"  # the p cell of a comparison whose paired differences are all equal


def _entry(cfg: str, runs: dict, base: dict, diverged: list, baseline: str, metric: str) -> dict:
    """One config's row of :func:`results_table` before its comparison: mean ± std over its finite runs."""
    values = np.array(list(runs.values()))
    notes = []
    if diverged:
        notes.append(f"{len(diverged)} diverged run(s) left out of the statistics (seed(s) "
                     f"{', '.join(map(str, diverged))}: {metric} not finite; training is deterministic, "
                     "a re-run diverges again)")
    if values.size < 2:
        notes.append(f"only {values.size} seed: no std")
    return {"config": cfg, "n": int(values.size), "seeds": list(runs), "diverged": list(diverged),
            "mean": float(values.mean()) if values.size else None,
            "std": float(values.std(ddof=1)) if values.size >= 2 else None,
            "per_seed": {str(s): v for s, v in runs.items()},
            "per_seed_difference": ({str(s): runs[s] - base[s] for s in runs if s in base}
                                    if cfg != baseline else None),
            "comparison": None, "note": notes}


def _compare(entry: dict, runs: dict, base: dict, **kw) -> None:
    """Fill ``entry``'s paired comparison with the baseline on the seeds both ran (or note why not)."""
    shared = [s for s in runs if s in base]
    if len(shared) < 2:
        entry["note"].append(f"{len(shared)} seed(s) shared with baseline: no paired test")
        return
    cmp = stats.compare_paired([base[s] for s in shared], [runs[s] for s in shared], interval="t", **kw)
    entry["comparison"] = {k: _finite_or_none(v) for k, v in cmp.to_dict().items()}
    entry["comparison"]["paired_seeds"] = shared
    if len(shared) < len(runs) or len(shared) < len(base):
        entry["note"].append(f"paired on {len(shared)} shared seeds")
    if math.isnan(cmp.p_value):
        entry["note"].append(f"every paired difference is {_fmt(cmp.mean_diff, 4)} (sd = 0): no t interval, p or "
                             "g_z; the seeds agree, which is not evidence of a difference")


def results_table(rows: Sequence[dict], baseline: str, metric: str, *, config_key: str = "config",
                  seed_key: str = "seed", n_resamples: int = 10_000, n_permutations: int = 10_000,
                  confidence: float = 0.95, seed: int = 0, digits: int = 4) -> tuple[str, dict]:
    """One metric across configurations: mean +- std, and a paired comparison with ``baseline``.

    Each configuration is paired with the baseline on the seeds both ran (same seed = same init and data
    order); for those pairs the table gives the mean difference ``config - baseline`` with its paired t
    interval, the paired t-test p, that p Holm-adjusted over the comparisons of this table (a report
    re-adjusts over all its tables: :func:`holm_table` and :func:`results_markdown`), and Hedges' g_z,
    the paired standardised effect corrected for its small-sample bias (Cohen's d_z overstates it by
    ~25% at 5 seeds; d_z, Hedges' g and the randomisation p in the JSON). Below ``PER_SEED_BELOW``
    seeds a second table lists every seed's value and its paired difference. A configuration with fewer
    than two seeds shared with the baseline gets ``n/a`` and a ``note`` instead of raising; paired
    differences that are all equal (sd = 0) get an undefined interval, p and g_z; a run whose metric is
    not finite (a diverged run) is left out of every statistic, counted per configuration and named in a
    note. Returns ``(markdown, json_obj)``.
    """
    groups = _group(rows, metric, config_key, seed_key, allow_non_finite=True)
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} has no rows; configs present: {list(groups)}")
    finite, diverged = _split_diverged(groups)
    order = [baseline] + [c for c in groups if c != baseline]
    base = finite[baseline]
    kw = dict(n_resamples=n_resamples, n_permutations=n_permutations, confidence=confidence, seed=seed)
    entries = []
    for cfg in order:
        entry = _entry(cfg, finite[cfg], base, diverged[cfg], baseline, metric)
        if cfg != baseline:
            _compare(entry, finite[cfg], base, **kw)
        entry["note"] = "; ".join(entry["note"]) or None
        entries.append(entry)
    pct = f"{confidence * 100:g}%"
    obj = {"metric": metric, "baseline": baseline, "difference": "config - baseline",
           "interval": f"paired t interval ({pct}) over seeds", "test": "paired t-test over seeds",
           "confidence": confidence, "n_resamples": n_resamples, "n_permutations": n_permutations,
           "seed": seed, "configs": entries}
    holm_table(obj)
    return results_markdown(obj, digits), obj


def holm_table(obj: dict, adjusted: Optional[dict] = None, family: str = "this table") -> int:
    """Set ``p_holm`` of every comparison of a :func:`results_table` object (or a per-sequence table's,
    keyed by "reference"): Holm over this table's
    comparisons, or ``adjusted[frozenset((config, baseline))]`` where a wider family was adjusted (a
    report's distinct comparisons), named by ``family``. Returns the family size ``m`` (comparisons with
    a defined p), which the table's header prints."""
    ref = obj["baseline"] if "baseline" in obj else obj["reference"]  # a per-sequence table: "reference"
    compared = [e for e in obj["configs"] if e["comparison"]]
    if adjusted is None:
        adjusted = dict(zip([frozenset((e["config"], ref)) for e in compared],
                            stats.holm([e["comparison"]["p_value"] for e in compared])))
    for e in compared:
        e["comparison"]["p_holm"] = adjusted[frozenset((e["config"], ref))]
    m = sum(p is not None for p in adjusted.values())
    obj["holm_m"] = m
    obj["multiple_comparisons"] = f"Holm over the {m} comparisons of {family}"
    return m


def _comparison_cells(c: Optional[dict], digits: int) -> tuple[str, str, str, str]:
    """(Δ [interval], p, p Holm, g_z) cells of one comparison dict (None: no paired test)."""
    if c is None:
        return "n/a", "n/a", "n/a", "n/a"
    if c["p_value"] is None:  # every paired difference equal: sd = 0
        return f"{_fmt(c['mean_diff'], digits)} [undefined]", UNDEFINED_P, "n/a", "undefined"
    delta = f"{_fmt(c['mean_diff'], digits)} [{_fmt(c['ci_low'], digits)}, {_fmt(c['ci_high'], digits)}]"
    return delta, _fmt(c["p_value"], 3), _fmt(c["p_holm"], 3), _fmt(c["hedges_gz"], 3)


def _n_cell(e: dict) -> str:
    return f"{e['n']} (+{len(e['diverged'])} diverged)" if e.get("diverged") else str(e["n"])


def results_markdown(obj: dict, digits: int = 4) -> str:
    """The markdown of a :func:`results_table` object: the table, its notes and, below
    ``PER_SEED_BELOW`` seeds, every seed's value. Rendered from the object alone, so a report that
    re-adjusts ``p_holm`` over a wider family (:func:`holm_table`) renders the table again after."""
    metric, baseline, entries = obj["metric"], obj["baseline"], obj["configs"]
    pct = f"{obj['confidence'] * 100:g}%"
    lines = [f"| config | n | {metric} mean ± std | Δ vs {baseline} [{pct} paired t CI] | p (paired t) "
             f"| p Holm (m={obj['holm_m']}) | g_z |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        if e["config"] == baseline:
            delta, p, ph, gz = "(baseline)", "", "", ""
        else:
            delta, p, ph, gz = _comparison_cells(e["comparison"], digits)
        lines.append(f"| {e['config']} | {_n_cell(e)} | {_fmt(e['mean'], digits)} ± {_fmt(e['std'], digits)} "
                     f"| {delta} | {p} | {ph} | {gz} |")
    notes = [f"{e['config']}: {e['note']}" for e in entries if e["note"]]
    md = "\n".join(lines)
    if notes:
        md += "\n\n" + "\n".join(f"- {n}" for n in notes)
    all_seeds = list(dict.fromkeys(s for e in entries for s in [*e["seeds"], *e.get("diverged", [])]))
    if len(all_seeds) < PER_SEED_BELOW:
        md += "\n\n" + _per_seed_markdown(entries, all_seeds, metric, baseline, digits)
    return md + "\n"


def _per_seed_markdown(entries: list[dict], seeds: list, metric: str, baseline: str, digits: int) -> str:
    """Every seed's value and, in parentheses, its paired difference to the baseline's same seed (a
    diverged run: "diverged")."""
    head = "| config | " + " | ".join(f"seed {s}" for s in seeds) + " |"
    lines = [f"Per seed: {metric} (Δ vs {baseline}, same seed)", "", head, "|---|" + "---:|" * len(seeds)]
    for e in entries:
        cells = []
        for s in seeds:
            v = e["per_seed"].get(str(s))
            d = (e["per_seed_difference"] or {}).get(str(s))
            cell = _fmt(v, digits) if v is not None else ("diverged" if s in e.get("diverged", []) else "—")
            cells.append(cell + (f" ({d:+.{digits}g})" if d is not None else ""))
        lines.append(f"| {e['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(rows: Sequence[dict], metrics: Sequence[str], *, config_key: str = "config",
                  seed_key: str = "seed", digits: int = 4) -> tuple[str, dict]:
    """Several metrics side by side as mean ± std over seeds (e.g. Table 4: NMI, ARI, CH, silhouette).

    Non-finite values (a NaN silhouette for a one-cluster run) are left out of a cell's statistics; the
    cell then shows how many seeds it rests on. Returns ``(markdown, json_obj)``.
    """
    per_metric = {m: _group(rows, m, config_key, seed_key, allow_non_finite=True) for m in metrics}
    configs = list(dict.fromkeys(c for g in per_metric.values() for c in g))
    lines = ["| config | n | " + " | ".join(f"{m} mean ± std" for m in metrics) + " |",
             "|---|---:|" + "---:|" * len(metrics)]
    entries = []
    for cfg in configs:
        n_runs = max(len(per_metric[m].get(cfg, {})) for m in metrics)
        entry = {"config": cfg, "n": n_runs, "metrics": {}}
        cells = []
        for m in metrics:
            vals = np.array([v for v in per_metric[m].get(cfg, {}).values() if math.isfinite(v)])
            mean = float(vals.mean()) if vals.size else None
            std = float(vals.std(ddof=1)) if vals.size >= 2 else None
            entry["metrics"][m] = {"mean": mean, "std": std, "n": int(vals.size)}
            cell = f"{_fmt(mean, digits)} ± {_fmt(std, digits)}"
            cells.append(cell if vals.size == n_runs else f"{cell} (n={vals.size})")
        entries.append(entry)
        lines.append(f"| {cfg} | {n_runs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", {"metrics": list(metrics), "configs": entries}


def pareto_front(points, *, maximize_quality: bool = False) -> list[int]:
    """Indices of the non-dominated ``(quality, cost)`` points, ordered by increasing cost.

    By default lower is better on both axes (loss vs FLOPs/latency/memory); ``maximize_quality=True``
    for accuracy-like quality. A point is dominated when another is at least as good on both axes and
    strictly better on one; identical points do not dominate each other, so both stay on the front.
    """
    p = np.asarray(points, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] != 2:
        raise ValueError(f"points must be a sequence of (quality, cost) pairs, got shape {p.shape}")
    if not np.all(np.isfinite(p)):
        raise ValueError("points contain non-finite values")
    q = p.copy()
    if maximize_quality:
        q[:, 0] = -q[:, 0]
    no_worse = np.all(q[:, None, :] <= q[None, :, :], axis=2)   # [j, i]: j at least as good as i
    better = np.any(q[:, None, :] < q[None, :, :], axis=2)      # [j, i]: j strictly better somewhere
    dominated = np.any(no_worse & better, axis=0)
    front = np.flatnonzero(~dominated)
    return sorted(front.tolist(), key=lambda i: (q[i, 1], q[i, 0], i))
