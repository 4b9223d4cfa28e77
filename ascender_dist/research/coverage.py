"""Coverage of the reports' intervals, simulated under a variance-components model of the loss differences.

    ascender-dist coverage [--results benchmarks/results/research] [--out benchmarks/results/research/coverage]
                           [--pair REPORT BASELINE TREATMENT ...] [--experiments 4000] [--n-resamples 10000]
    ascender-dist coverage --rewrite [--out DIR]   (coverage.md and coverage.png again from DIR/coverage.json)

Why. Every ablation report prints two intervals for a difference between two variants (treatment −
baseline): over seeds, the paired t interval and t-test over the per-seed mean validation losses
(:func:`ascender_dist.research.stats.compare_paired`); per sequence, the losses averaged over the seeds
and whole documents resampled ("95% (calibrated)" document bootstrap and document sign-flip test,
:func:`ascender_dist.research.stats.compare_per_document`). An interval is called 95% only once
simulation has checked how often it covers the quantity it is read as. Three quantities are in play:

* **Δ variants**: the difference between the variants, over training seeds and text like the
  validation set (what "variant B is better" claims);
* **Δ trained models**: the difference between the five trained models of each variant on text like
  this (Δ variants plus the mean seed effect of the five seeds);
* **Δ these documents**: the difference between the variants on the 28 validation documents (Δ variants
  plus the documents' effects), what the paired t over seeds estimates, since every seed is scored on
  the same documents.

Model. The loss difference of window ``w`` (of document ``j``) in seed ``s`` is
``D[s, w] = Δ + seed[s] + document[j] + window[w] + seed×document[s, j] + residual[s, w]``: every part
independent, normal, mean 0; ``window`` is a window's own effect (the same in every seed), ``residual``
what is left. The five variances are estimated from a report's ``per_sequence.npz`` for a named pair of
variants by the method of moments (:func:`estimate_components`: the ANOVA sums of squares of the
seeds × (documents / windows) layout equated to their expectations); a negative estimate counts as 0.
Each experiment draws ``D`` at the report's own design (its 256 windows in 28 documents, its 5 seeds)
with Δ = 0 and computes the intervals and tests with the functions the tables call
(:func:`simulate_setting`), once with the estimated variances and once without the seed effect (the
world in which the per-sequence interval's premise holds). The seed variance rests on the 5 seeds' means
alone (4 degrees of freedom), so each comparison stands for a kind of comparison ("no_sep-like"), not
for its own true variances.

Outputs (``--out``): ``coverage.json`` (estimates, every rate with its binomial sd, settings and their
hash, the inputs' sha256 and run commits, the provenance of the run), ``coverage.md`` and
``coverage.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import stats

log = logging.getLogger("ascender_dist")

COMPONENTS = ("seed", "document", "window", "seed_document", "residual")
COMPONENT_LABELS = ("seed", "document", "window", "seed × document", "residual")
# the reports' representative comparisons: (report, baseline, treatment)
DEFAULT_PAIRS = (("bias", "ascender", "no_coh"), ("omega-sharing", "per-head", "shared"),
                 ("bias", "ascender", "no_sep"))
WORLDS = {"as estimated": {}, "no seed effect": {"seed": 0.0}}  # variances replaced in each world
TARGETS = ("variants", "models", "documents")
EXPERIMENTS = 4000
CHUNK = 250  # experiments drawn at a time: 250 x 5 x 256 doubles, ~2.6 MB per array
EFFECT_SIZE_DRAWS = 20_000  # simulated 5-seed experiments for the bias of d_z and g_z
NOMINAL = 0.95
ALPHA = 0.05


# ============================================================================ data

def load_pair(report_dir: Path, baseline: str, treatment: str) -> tuple[np.ndarray, np.ndarray, list]:
    """``(differences [seeds, windows], documents [windows], seeds)``: treatment − baseline per-window
    validation loss of every seed both variants ran, from a report's ``per_sequence.npz``; the windows'
    document ids must be the same in every run (the report's design)."""
    from .ablate.report import PER_SEQUENCE, read_per_sequence

    runs = read_per_sequence(Path(report_dir) / PER_SEQUENCE)  # {(config, seed): {key: list}}
    seeds = sorted({s for c, s in runs if c == baseline} & {s for c, s in runs if c == treatment}, key=int)
    if len(seeds) < 2:
        raise ValueError(f"{report_dir}: {baseline!r} and {treatment!r} share {len(seeds)} seed(s) with "
                         f"per-sequence losses; variants there: {sorted({c for c, _ in runs})}")
    documents = np.asarray(runs[(baseline, seeds[0])]["val_example_documents"])
    for config in (baseline, treatment):
        for s in seeds:
            if not np.array_equal(np.asarray(runs[(config, s)]["val_example_documents"]), documents):
                raise ValueError(f"{report_dir}: {config} seed {s} was scored on other documents")
    differences = np.stack([np.subtract(runs[(treatment, s)]["val_example_losses"],
                                        runs[(baseline, s)]["val_example_losses"]) for s in seeds])
    return differences, documents, seeds


def _layout(documents) -> tuple[np.ndarray, np.ndarray]:
    """``(inverse [windows], counts [documents])``: each window's document index and each document's
    number of windows."""
    _, inverse, counts = np.unique(np.asarray(documents), return_inverse=True, return_counts=True)
    return inverse, counts.astype(np.float64)


# ============================================================================ estimation

def sums_of_squares(x: np.ndarray, inverse: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The five ANOVA sums of squares of ``x [..., seeds, windows]`` (windows nested in documents,
    crossed with seeds): between seeds, between documents, between windows within documents,
    seed × document, and seed × window within document (residual). ``[..., 5]``; they add up to the
    total sum of squares about the grand mean (every document has its windows in every seed, so the
    weighted decomposition is orthogonal)."""
    onehot = np.eye(counts.size)[inverse]                 # [windows, documents]
    n_seeds, n_windows = x.shape[-2:]
    grand = x.mean(axis=(-2, -1), keepdims=True)          # [..., 1, 1]
    seed = x.mean(axis=-1, keepdims=True)                 # [..., seeds, 1]
    window = x.mean(axis=-2, keepdims=True)               # [..., 1, windows]
    cell = (x @ onehot) / counts                          # [..., seeds, documents]
    document = cell.mean(axis=-2, keepdims=True)          # [..., 1, documents]
    return np.stack([
        n_windows * ((seed - grand) ** 2).sum(axis=(-2, -1)),
        n_seeds * (counts * (document - grand) ** 2).sum(axis=(-2, -1)),
        n_seeds * ((window - document[..., inverse]) ** 2).sum(axis=(-2, -1)),
        (counts * (cell - seed - document + grand) ** 2).sum(axis=(-2, -1)),
        ((x - cell[..., inverse] - window + document[..., inverse]) ** 2).sum(axis=(-2, -1)),
    ], axis=-1)


def _indicators(n_seeds: int, inverse: np.ndarray, n_documents: int) -> list[np.ndarray]:
    """Per component, the 0/1 columns of its design matrix, each as a ``[seeds, windows]`` array:
    ``D = Σ_c Z_c u_c`` with ``u_c`` the component's independent draws."""
    n_windows = inverse.size
    windows, seeds = np.arange(n_windows), np.arange(n_seeds)
    seed = np.zeros((n_seeds, n_seeds, n_windows))
    seed[seeds, seeds, :] = 1.0                                     # [seeds, seeds, windows]
    document = np.zeros((n_documents, n_seeds, n_windows))
    document[inverse, :, windows] = 1.0                             # [documents, seeds, windows]
    window = np.zeros((n_windows, n_seeds, n_windows))
    window[windows, :, windows] = 1.0                               # [windows, seeds, windows]
    seed_document = np.zeros((n_seeds, n_documents, n_seeds, n_windows))
    seed_document[seeds[:, None], inverse[None, :], seeds[:, None], windows[None, :]] = 1.0
    residual = np.eye(n_seeds * n_windows).reshape(-1, n_seeds, n_windows)  # [seeds * windows, seeds, windows]
    return [seed, document, window, seed_document.reshape(-1, n_seeds, n_windows), residual]


def expected_sums_of_squares(n_seeds: int, documents) -> np.ndarray:
    """``E[sums_of_squares] = M @ variances``: ``M [5 sums, 5 components]``, exact for this design.
    A component ``c`` adds ``σ_c² · ||P_k Z_c||²_F`` to sum ``k`` (``P_k`` the sum's projection,
    ``Z_c`` the component's design matrix), computed by applying :func:`sums_of_squares` to
    ``Z_c``'s columns."""
    inverse, counts = _layout(documents)
    columns = _indicators(n_seeds, inverse, counts.size)
    return np.stack([sums_of_squares(z, inverse, counts).sum(axis=0) for z in columns], axis=-1)


def estimate_components(differences: np.ndarray, documents) -> np.ndarray:
    """Method-of-moments (ANOVA) estimates of the five variances (:data:`COMPONENTS`, nats²) from
    ``differences [..., seeds, windows]``: the sums of squares equated to their expectations. Unbiased;
    an estimate may be negative (sampling noise around a small variance): use :func:`clip` before
    simulating. ``[..., 5]``."""
    differences = np.asarray(differences, dtype=np.float64)
    inverse, counts = _layout(documents)
    moments = expected_sums_of_squares(differences.shape[-2], documents)
    observed = sums_of_squares(differences, inverse, counts)          # [..., 5]
    return np.linalg.solve(moments, observed[..., None])[..., 0]


def clip(variances) -> np.ndarray:
    """The variances to simulate with: negative estimates as 0."""
    return np.clip(np.asarray(variances, dtype=np.float64), 0.0, None)


# ============================================================================ simulation

def draw_differences(variances, documents, n_seeds: int, experiments: int, rng: np.random.Generator,
                     documents_per_seed: bool = False) -> tuple[np.ndarray, dict]:
    """``experiments`` simulated tables' differences ``[experiments, seeds, windows]`` with Δ variants
    = 0, and the quantities an interval may be read as, ``{target: [experiments]}``: ``variants`` (0),
    ``models`` (the mean seed effect of the experiment's seeds) and ``documents`` (the mean over its
    windows of their document and window effects). ``documents_per_seed``: every seed is scored on its
    own draw of documents (a world the reports are not in: their seeds share the validation set)."""
    sd = np.sqrt(clip(variances))
    inverse, counts = _layout(documents)
    n_docs, n_windows = counts.size, inverse.size
    per_seed = n_seeds if documents_per_seed else 1
    seed = rng.normal(0, sd[0], (experiments, n_seeds, 1))                               # [E, S, 1]
    text = (rng.normal(0, sd[1], (experiments, per_seed, n_docs))[..., inverse]
            + rng.normal(0, sd[2], (experiments, per_seed, n_windows)))                  # [E, 1 or S, W]
    seed_document = rng.normal(0, sd[3], (experiments, n_seeds, n_docs))[..., inverse]  # [E, S, W]
    residual = rng.normal(0, sd[4], (experiments, n_seeds, n_windows))                  # [E, S, W]
    targets = {"variants": np.zeros(experiments), "models": seed[:, :, 0].mean(axis=1),
               "documents": text.mean(axis=(1, 2))}
    return seed + text + seed_document + residual, targets


def printed_intervals(differences: np.ndarray, documents, *, n_resamples: int, seed: int) -> dict:
    """What a report prints for one simulated table ``differences [seeds, windows]``, computed by the
    functions its tables call: ``{"per sequence": (lo, hi, p), "over seeds": (lo, hi, p)}`` and the
    per-sequence interval's label. Differences against a zero baseline: both statistics depend on
    the paired differences alone."""
    zeros = np.zeros_like(differences)
    per_sequence = stats.compare_per_document(zeros, differences, documents, n_resamples=n_resamples,
                                              n_permutations=n_resamples, seed=seed)
    over_seeds = stats.compare_paired(zeros.mean(axis=1), differences.mean(axis=1), interval="t",
                                      n_permutations=n_resamples, seed=seed)
    return {"per sequence": (per_sequence.ci_low, per_sequence.ci_high, per_sequence.p_value),
            "over seeds": (over_seeds.ci_low, over_seeds.ci_high, over_seeds.p_value),
            "label": per_sequence.interval}


def rate(hits) -> dict:
    """``{"rate", "sd", "n"}``: a share of experiments and its binomial standard deviation."""
    hits = np.asarray(hits, dtype=bool)
    p = float(hits.mean())
    return {"rate": p, "sd": math.sqrt(p * (1 - p) / hits.size), "n": int(hits.size)}


def summarize_outcomes(outcomes: dict, targets: dict) -> dict:
    """Per interval: how often it covers each target and how often its test rejects Δ variants = 0
    (p <= 0.05). ``outcomes[interval]``: ``[experiments, 3]`` rows of ``(lo, hi, p)``."""
    out = {}
    for interval, rows in outcomes.items():
        lo, hi, p = rows.T
        out[interval] = {"covers": {t: rate((lo <= targets[t]) & (targets[t] <= hi)) for t in TARGETS},
                         "rejects_null": rate(p <= ALPHA)}
    return out


def simulate_setting(variances, documents, n_seeds: int, experiments: int, *, n_resamples: int,
                     rng: np.random.Generator, documents_per_seed: bool = False, seed_offset: int = 0,
                     progress=None) -> dict:
    """Coverage and rejection rates of both printed intervals over ``experiments`` simulated tables
    (:func:`draw_differences`, :func:`printed_intervals`), drawn ``CHUNK`` at a time;
    ``progress(k)`` is called after each ``k`` experiments. The resampling seed of experiment ``i``
    is ``seed_offset + i``."""
    outcomes = {"per sequence": [], "over seeds": []}
    targets = {t: [] for t in TARGETS}
    labels = set()
    for start in range(0, experiments, CHUNK):
        rows = min(CHUNK, experiments - start)
        diffs, drawn = draw_differences(variances, documents, n_seeds, rows, rng, documents_per_seed)
        for i in range(rows):
            printed = printed_intervals(diffs[i], documents, n_resamples=n_resamples,
                                        seed=seed_offset + start + i)
            for interval in outcomes:
                outcomes[interval].append(printed[interval])
            labels.add(printed["label"])
        for t in TARGETS:
            targets[t].append(drawn[t])
        if progress is not None:
            progress(rows)
    summary = summarize_outcomes({k: np.array(v) for k, v in outcomes.items()},     # [E, 3] each
                                 {t: np.concatenate(v) for t, v in targets.items()})  # [E] each
    summary["per sequence"]["interval"] = sorted(labels)
    return summary


def effect_size_bias(n_seeds: int, draws: int, rng: np.random.Generator, delta: float = 1.0) -> dict:
    """Mean Cohen's d_z and Hedges' g_z over ``draws`` experiments of ``n_seeds`` normal paired
    differences with true standardised effect ``delta`` (:func:`stats.cohens_dz`,
    :func:`stats.hedges_gz`): their mean over ``delta`` with its standard error."""
    x = rng.normal(delta, 1.0, (draws, n_seeds))      # [draws, seeds]: differences, sd 1
    zeros = np.zeros(n_seeds)
    dz = np.array([stats.cohens_dz(zeros, row) for row in x])
    gz = np.array([stats.hedges_gz(zeros, row) for row in x])
    return {"seeds": n_seeds, "delta": delta, "draws": draws, "j": stats.hedges_j(n_seeds - 1),
            **{name: {"mean_over_delta": float(v.mean() / delta), "se": float(v.std(ddof=1) / delta / math.sqrt(draws))}
               for name, v in (("cohens_dz", dz), ("hedges_gz", gz))}}


# ============================================================================ one run

def pair_record(results: Path, report: str, baseline: str, treatment: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """One comparison's estimates and inputs as the JSON records them, with its documents and seeds."""
    from .ablate.index import run_commits
    from .ablate.provenance import file_sha256
    from .ablate.report import PER_SEQUENCE

    directory = results / report
    differences, documents, seeds = load_pair(directory, baseline, treatment)
    raw = estimate_components(differences, documents)
    full = json.loads((directory / "results.json").read_text())
    return ({"report": report, "baseline": baseline, "treatment": treatment, "seeds": seeds,
             "windows": int(documents.size), "documents": int(np.unique(documents).size),
             "design": sorted(_layout(documents)[1].astype(int).tolist(), reverse=True),
             "mean_difference": float(differences.mean()),
             "seed_means_sd": float(differences.mean(axis=1).std(ddof=1)),
             "variances_estimated": dict(zip(COMPONENTS, raw.tolist())),
             "sd_simulated": dict(zip(COMPONENTS, np.sqrt(clip(raw)).tolist())),
             "per_sequence_npz_sha256": file_sha256(directory / PER_SEQUENCE),
             "run_commits": run_commits(full)}, documents, np.array(seeds))


def run(results: Path, pairs: Sequence[tuple], experiments: int, n_resamples: int, seed: int) -> dict:
    """Every pair in every world (:data:`WORLDS`), and the effect-size bias; the JSON object."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    loaded = [pair_record(results, *pair) for pair in pairs]
    settings = [(k, world) for k in range(len(loaded)) for world in WORLDS]
    rows = []
    with logging_redirect_tqdm(), tqdm(total=experiments * len(settings), desc="coverage", unit="experiment") as bar:
        for index, (k, world) in enumerate(settings):
            record, documents, seeds = loaded[k]
            variances = clip(list(record["variances_estimated"].values()))
            for name, value in WORLDS[world].items():
                variances[COMPONENTS.index(name)] = value
            rng = np.random.default_rng([seed, index])
            summary = simulate_setting(variances, documents, seeds.size, experiments, n_resamples=n_resamples,
                                       rng=rng, seed_offset=index * experiments, progress=bar.update)
            rows.append({"pair": k, "world": world, "sd": dict(zip(COMPONENTS, np.sqrt(variances).tolist())),
                         **summary})
            log.info("coverage: %s %s − %s, %s: per sequence covers Δ variants %.3f, over seeds %.3f",
                     record["report"], record["treatment"], record["baseline"], world,
                     summary["per sequence"]["covers"]["variants"]["rate"],
                     summary["over seeds"]["covers"]["variants"]["rate"])
    n_seeds = loaded[0][2].size
    bias = effect_size_bias(n_seeds, EFFECT_SIZE_DRAWS, np.random.default_rng([seed, len(settings)]))
    return {"pairs": [r for r, _, _ in loaded], "rows": rows, "effect_size_bias": bias}


# ============================================================================ outputs

def _cell(r: dict) -> str:
    return f"{r['rate']:.3f} ({r['sd']:.3f})"


def _pair_name(p: dict) -> str:
    return f"`{p['report']}`: {p['treatment']} − {p['baseline']}"


def _estimates_table(pairs: list[dict]) -> list[str]:
    lines = ["| comparison | seeds | mean Δ (nats) | sd of the seed means | "
             + " | ".join(f"σ {c}" for c in COMPONENT_LABELS) + " |", "|---|---:|---:|---:|" + "---:|" * 5]
    for p in pairs:
        cells = [f"{math.sqrt(v):.4f}" if v >= 0 else f"0 (variance estimate {v:.2g})"
                 for v in p["variances_estimated"].values()]
        lines.append(f"| {_pair_name(p)} | {len(p['seeds'])} | {p['mean_difference']:+.4f} | "
                     f"{p['seed_means_sd']:.4f} | " + " | ".join(cells) + " |")
    return lines


def _per_sequence_label(data: dict) -> str:
    """The per-sequence interval's name in the headings: "95% (calibrated)" only when every row's
    interval was the calibrated one (another design falls back to the plain percentile level)."""
    labels = {label for r in data["rows"] for label in r["per sequence"]["interval"]}
    return "\"95% (calibrated)\"" if labels and all("calibrated" in label for label in labels) else "interval"


def _coverage_table(data: dict) -> list[str]:
    lines = [f"| comparison | world | per sequence {_per_sequence_label(data)}: covers Δ variants | rejects Δ variants = 0 "
             "| covers Δ trained models | over seeds 95% paired t: covers Δ variants | rejects Δ variants = 0 "
             "| covers Δ these documents |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in data["rows"]:
        seq, seeds = row["per sequence"], row["over seeds"]
        lines.append(f"| {_pair_name(data['pairs'][row['pair']])} | {row['world']} | "
                     f"{_cell(seq['covers']['variants'])} | {_cell(seq['rejects_null'])} | "
                     f"{_cell(seq['covers']['models'])} | {_cell(seeds['covers']['variants'])} | "
                     f"{_cell(seeds['rejects_null'])} | {_cell(seeds['covers']['documents'])} |")
    return lines


def render(data: dict) -> str:
    """coverage.md from the coverage.json object alone."""
    s, prov, bias = data["settings"], data.get("provenance") or {}, data["effect_size_bias"]
    commit = str(prov.get("git_commit") or "not recorded")[:12]
    commit += " (uncommitted changes)" if prov.get("git_dirty") else ""
    sd95 = math.sqrt(NOMINAL * (1 - NOMINAL) / s["experiments"])
    labels = sorted({label for r in data["rows"] for label in r["per sequence"]["interval"]})
    seeds, documents = len(data["pairs"][0]["seeds"]), data["pairs"][0]["documents"]
    lines = [
        "# Coverage of the reports' intervals (variance-components simulation)", "",
        f"Generated by `ascender-dist coverage` (`ascender_dist/research/coverage.py`) at commit {commit}; "
        f"settings sha256 {data['settings_sha256'][:16]}. {s['experiments']:,} simulated experiments per row "
        f"(binomial sd of a rate: {sd95:.4f} at 0.95, at most {math.sqrt(0.25 / s['experiments']):.4f}; each "
        f"cell gives it in parentheses), {s['n_resamples']:,} bootstrap resamples and sign flips per "
        f"experiment{' (as the reports)' if s['n_resamples'] == 10_000 else ''}, the intervals and tests "
        "computed by the functions the tables call.", "",
        "Model: the loss difference of window w (document j) in seed s is Δ + seed[s] + document[j] + window[w] + "
        "seed×document[s, j] + residual[s, w], every part normal and independent; variances estimated by the "
        "method of moments from each report's `per_sequence.npz` (negative estimates simulated as 0); each "
        "experiment draws a table at the report's own design "
        f"({data['pairs'][0]['windows']} windows in {data['pairs'][0]['documents']} documents of "
        f"{'/'.join(map(str, data['pairs'][0]['design']))} windows, {len(data['pairs'][0]['seeds'])} seeds) with "
        f"Δ variants = 0. The seed variance rests on the seed means alone ({seeds - 1} degrees of freedom at {seeds} "
        "seeds): a "
        "row stands for a kind of comparison, not for that comparison's true variances.", "",
        "## Estimated components (sd, nats)", "", *_estimates_table(data["pairs"]), "",
        "## Coverage and rejection rates", "",
        "Δ variants: the difference between the variants (over training seeds and text like this, 0 here); "
        f"Δ trained models: between the {seeds} trained models of each variant on text like this (Δ variants + "
        f"the mean of the experiment's seed effects); Δ these documents: between the variants on the {documents} "
        "documents scored (Δ variants + their document and window effects). \"rejects\": p <= 0.05 under "
        "Δ variants = 0 (per sequence: the document sign-flip test; over seeds: the paired t-test). World "
        "\"no seed effect\": the seed variance set to 0, the premise of the per-sequence interval.", "",
        *_coverage_table(data), "",
        f"Per-sequence interval as computed: {'; '.join(labels)}.", "",
        "## Effect size over seeds", "",
        f"{bias['draws']:,} experiments of {bias['seeds']} normal paired differences, true standardised effect "
        f"{bias['delta']:g}: mean Cohen's d_z {bias['cohens_dz']['mean_over_delta']:.3f} × the true effect "
        f"(se {bias['cohens_dz']['se']:.3f}; 1 / J({bias['seeds'] - 1}) = {1 / bias['j']:.3f}), mean Hedges' "
        f"g_z = J({bias['seeds'] - 1}) d_z {bias['hedges_gz']['mean_over_delta']:.3f} × (se "
        f"{bias['hedges_gz']['se']:.3f}; J({bias['seeds'] - 1}) = {bias['j']:.3f}). The reports print g_z.", "",
        "Figure: `coverage.png` (every rate with ±2 binomial sd).", "",
    ]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """coverage.png: coverage of each interval for each target, and the rejection rates under the null,
    per comparison and world, with ±2 binomial sd."""
    from ascender_dist.plotting import pyplot

    plt = pyplot()
    names = [f"{data['pairs'][r['pair']]['treatment']} − {data['pairs'][r['pair']]['baseline']}\n{r['world']}"
             for r in data["rows"]]
    panels = [(f"per sequence {_per_sequence_label(data)}", "per sequence", ("variants", "models"), NOMINAL),
              ("over seeds, 95% paired t", "over seeds", ("variants", "documents"), NOMINAL)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.55 * len(names) + 2.4), sharey=True, layout="constrained")
    y = np.arange(len(names))
    for ax, (title, interval, targets, level) in zip(axes, panels):
        for k, target in enumerate(targets):
            rates = [r[interval]["covers"][target] for r in data["rows"]]
            ax.errorbar([x["rate"] for x in rates], y + 0.15 * (k - 0.5), xerr=[2 * x["sd"] for x in rates], fmt="o",
                        capsize=3, label=f"covers Δ {target}")
        ax.axvline(level, color="k", lw=0.8, ls="--")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("coverage")
        ax.legend(fontsize=8, loc="lower left")
    ax = axes[2]
    for k, interval in enumerate(("per sequence", "over seeds")):
        rates = [r[interval]["rejects_null"] for r in data["rows"]]
        ax.errorbar([x["rate"] for x in rates], y + 0.15 * (k - 0.5), xerr=[2 * x["sd"] for x in rates], fmt="s",
                    capsize=3, label=interval)
    ax.axvline(ALPHA, color="k", lw=0.8, ls="--")
    ax.set_title("rejects Δ variants = 0 (p <= 0.05)", fontsize=10)
    ax.set_xlabel("share of null experiments")
    ax.legend(fontsize=8, loc="lower right")
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Coverage at the reports' design ({data['settings']['experiments']:,} experiments per row; "
                 "bars: ±2 binomial sd)")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_outputs(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "coverage.json").write_text(json.dumps(data, indent=1))
    (out / "coverage.md").write_text(render(data))
    plot(data, out / "coverage.png")


# ============================================================================ CLI

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascender-dist coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="benchmarks/results/research", help="folder of the ablation reports")
    p.add_argument("--out", default="benchmarks/results/research/coverage",
                   help="output directory (coverage.json, coverage.md, coverage.png)")
    p.add_argument("--pair", nargs=3, action="append", metavar=("REPORT", "BASELINE", "TREATMENT"),
                   help="a comparison whose variances to estimate (repeatable; default: "
                        + "; ".join(" ".join(x) for x in DEFAULT_PAIRS) + ")")
    p.add_argument("--experiments", type=int, default=EXPERIMENTS, help="simulated experiments per row")
    p.add_argument("--n-resamples", type=int, default=10_000,
                   help="bootstrap resamples and sign flips per experiment (the reports': 10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rewrite", action="store_true", help="only coverage.md and coverage.png again from coverage.json")
    return p


def _rewrite(out: Path) -> int:
    path = out / "coverage.json"
    if not path.is_file():
        print(f"error: --rewrite: {path} not found (written by an earlier `ascender-dist coverage`)", file=sys.stderr)
        return 2
    from ascender_dist.config.errors import UserError

    from .saved_json import draw_saved

    def draw(data: dict) -> str:
        table = render(data)
        plot(data, out / "coverage.png")
        return table

    try:
        table = draw_saved(path, ("settings", "settings_sha256", "pairs", "rows", "effect_size_bias"),
                           "ascender-dist coverage", draw)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (out / "coverage.md").write_text(table)
    print(f"wrote {out / 'coverage.md'} and coverage.png from {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist coverage``: the simulation and its table, figure and JSON. Exit 2 on a user error."""
    from ascender_dist.logs import setup_cli_logging

    from .ablate.grid import AblationError
    from .ablate.provenance import config_hash, report_provenance

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    if args.rewrite:
        return _rewrite(out)
    if args.experiments < 1 or args.n_resamples < 1:
        print("error: --experiments and --n-resamples must be >= 1", file=sys.stderr)
        return 2
    setup_cli_logging()
    pairs = [tuple(p) for p in args.pair] if args.pair else list(DEFAULT_PAIRS)
    settings = {"results": args.results, "pairs": [list(p) for p in pairs], "experiments": args.experiments,
                "n_resamples": args.n_resamples, "seed": args.seed, "worlds": WORLDS, "chunk": CHUNK,
                "effect_size_draws": EFFECT_SIZE_DRAWS, "nominal": NOMINAL, "alpha": ALPHA}
    provenance = report_provenance()  # before anything is written: the outputs may lie inside the checkout
    try:
        data = run(Path(args.results), pairs, args.experiments, args.n_resamples, args.seed)
    except (OSError, KeyError, ValueError, AblationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = {"settings": settings, "settings_sha256": config_hash(settings), **data, "provenance": provenance}
    write_outputs(data, out)
    print(f"wrote {out / 'coverage.md'}, coverage.json and coverage.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
