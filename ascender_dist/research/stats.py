"""Seed-level and example-level significance statistics for ablations.

Every comparison is *paired*: ``baseline[i]`` and ``treatment[i]`` come from the same seed (same
initialisation seed and data order) or, in the per-example variant, from the same evaluation example.
All differences are ``treatment - baseline`` in the metric's own units, so for a lower-is-better metric
(loss, perplexity) a negative difference is an improvement.

Over seeds (few: 3-9) the interval is the paired t interval (:func:`paired_t_ci`): a percentile
bootstrap over n seeds can only span the smallest to largest of n resampled means (about 74% coverage
at n = 3 for a nominal 95%). Over validation sequences, overlapping or adjacent windows of one document
are not independent, so the per-sequence statistics resample whole documents
(:func:`document_bootstrap_ci`, :func:`document_randomization_test`); the document interval's percentile
level is calibrated by simulation to its stated coverage at the reports' design
(:data:`DOCUMENT_BOOTSTRAP_CALIBRATION`). :func:`holm` adjusts the
p-values of one family of comparisons (Holm 1979); a report's family is every distinct comparison of
its tables, per test (:func:`ascender_dist.research.ablate.collect.adjust_over_report`).

When every paired difference is the same (sd 0, e.g. two seeds with equal differences) the t statistic,
the t interval and d_z divide by zero: they are undefined (NaN) rather than p = 0, a zero-width interval
and an infinite effect, which would read as certainty that the seeds cannot give.

The paired bootstrap (:func:`paired_bootstrap_ci`, :func:`scipy.stats.bootstrap`, percentile method) is
refused below ``BOOTSTRAP_MIN_N`` = 20 pairs and is a nominal 95% interval above (simulated: ~0.93 at 20
pairs, 0.94-0.95 at 100-200; ~0.90-0.91 at 10); no seed-level table uses it. The randomisation test is a
sign-flip loop written here, because ``scipy.stats.permutation_test(permutation_type="samples")`` is
~20x slower on per-example data (argsort-based pair shuffles) and its two-sided p-value is twice the
smaller one-sided p rather than ``|statistic|``-based. Both are driven by a
``numpy.random.Generator`` built from ``seed``, so every number here is reproducible.
See ``docs/research.md`` for what each statistic means.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import special, stats

__all__ = [
    "EXACT_MAX_N",
    "PairedComparison",
    "approximate_randomization_test",
    "cliffs_delta",
    "cohens_dz",
    "compare_paired",
    "compare_per_example",
    "compare_per_document",
    "DOCUMENT_BOOTSTRAP_CALIBRATION",
    "document_bootstrap_ci",
    "document_bootstrap_level",
    "document_randomization_test",
    "holm",
    "paired_t_ci",
    "paired_t_test",
    "hedges_g",
    "hedges_gz",
    "hedges_j",
    "paired_bootstrap_ci",
    "summarize",
]

EXACT_MAX_N = 16  # exact randomisation enumerates 2**n sign patterns: 65,536 at n = 16

# Values per resampling batch (scipy's bootstrap ``batch``, and the sign-flip loop here): memory is
# ~ 8 bytes * this, so per-example tests with 10^5 examples x 10^4 resamples stay at tens of MB.
_BATCH_VALUES = 1 << 22


def _vector(values, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of numbers, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = np.flatnonzero(~np.isfinite(arr))
        raise ValueError(f"{name}: non-finite value(s) at position(s) {bad[:5].tolist()}")
    return arr


def _need(n: int, what: str, minimum: int = 2) -> None:
    if n < minimum:
        raise ValueError(f"{what}: need at least {minimum} values, got n={n} "
                         "(a spread or a resampling distribution needs two or more seeds/examples)")


def _paired_differences(baseline, treatment) -> np.ndarray:
    b = _vector(baseline, "baseline")
    t = _vector(treatment, "treatment")
    if b.shape != t.shape:
        raise ValueError(f"paired data: baseline has {b.size} values but treatment has {t.size}; "
                         "pairs must line up (same seed / same example at each position)")
    _need(b.size, "paired data")
    return t - b


def _no_spread(d: np.ndarray, baseline, treatment) -> bool:
    """Whether the paired differences ``d`` are all equal up to the float rounding of the values they
    come from (64 ulps of the largest |value|): their sd is then 0 or noise, and whatever divides by it
    (t statistic, t interval, d_z) is undefined."""
    scale = max(float(np.abs(np.asarray(baseline, dtype=np.float64)).max()),
                float(np.abs(np.asarray(treatment, dtype=np.float64)).max()))
    return float(np.ptp(d)) <= 64 * np.finfo(np.float64).eps * scale


def _batch(n: int) -> int:
    return max(1, _BATCH_VALUES // max(n, 1))


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def summarize(values) -> tuple[float, float, int]:
    """``(mean, sample std with ddof=1, n)`` of one configuration's per-seed results."""
    arr = _vector(values, "summarize")
    _need(arr.size, "summarize")
    return float(arr.mean()), float(arr.std(ddof=1)), int(arr.size)


def paired_bootstrap_ci(baseline, treatment, *, n_resamples: int = 10_000, confidence: float = 0.95,
                        seed: int = 0) -> tuple[float, float, float]:
    """Percentile bootstrap CI of the mean paired difference ``mean(treatment - baseline)``.

    The pairs are resampled with replacement (Efron & Tibshirani 1993, ch. 13), so the CI accounts for
    the seed-to-seed (or example-to-example) variation the two runs share. Returns
    ``(mean_diff, lo, hi)``. Constant differences give a zero-width interval at that constant; identical
    arrays give ``(0, 0, 0)``.
    """
    _check_confidence(confidence)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    d = _paired_differences(baseline, treatment)
    mean_diff = float(d.mean())
    if np.ptp(d) == 0.0:  # every resample has the same mean: skip the work, avoid float noise
        return mean_diff, mean_diff, mean_diff
    res = stats.bootstrap((d,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                          method="percentile", vectorized=True, batch=_batch(d.size),
                          rng=np.random.default_rng(seed))
    ci = res.confidence_interval
    return mean_diff, float(ci.low), float(ci.high)


def _count_at_least(signs: np.ndarray, d: np.ndarray, observed: float, tol: float) -> int:
    """How many sign patterns (rows of ``signs``, entries +-1) give ``|mean(sign * d)| >= observed``."""
    null = np.abs(signs @ d) / d.size
    return int(np.count_nonzero(null >= observed - tol))


def approximate_randomization_test(baseline, treatment, *, n_permutations: int = 10_000, seed: int = 0,
                                   exact: bool | None = None) -> float:
    """Two-sided paired approximate randomisation test (Noreen 1989; Riezler & Maxwell 2005).

    Under the null hypothesis the two systems are exchangeable within each pair, so the labels of each
    pair are swapped at random (equivalently, the sign of each difference ``treatment - baseline`` is
    flipped with probability 1/2) and the statistic ``|mean(d)|`` is recomputed. The Monte Carlo p-value
    is ``(c + 1) / (R + 1)`` where ``c`` of the ``R = n_permutations`` shuffles reach at least the
    observed statistic (the +1 counts the observed arrangement, keeping the test valid).

    ``exact=True`` enumerates all ``2**n`` swap patterns instead and returns ``c / 2**n`` (no +1: the
    identity pattern is among them); allowed for ``n <= EXACT_MAX_N``. ``exact=None`` (default) picks the
    exact test whenever ``2**n <= n_permutations``, i.e. when sampling could not beat enumeration;
    ``exact=False`` forces Monte Carlo. Identical arrays give ``p = 1``.
    Note the floor: the smallest exact two-sided p with ``n`` pairs is ``2 / 2**n`` (0.0625 at n = 5).
    """
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be >= 1, got {n_permutations}")
    d = _paired_differences(baseline, treatment)
    n = d.size
    if np.all(d == 0.0):
        return 1.0
    if exact is None:
        exact = n <= EXACT_MAX_N and 2 ** n <= n_permutations
    observed = abs(float(np.ones(n) @ d)) / n
    tol = 1e-9 * float(np.abs(d).mean())  # float ties: a shuffle equal to the observed value counts
    if exact:
        if n > EXACT_MAX_N:
            raise ValueError(f"exact randomisation test: n={n} pairs would need 2**{n} patterns; "
                             f"exact=True is limited to n <= {EXACT_MAX_N}")
        codes = np.arange(2 ** n, dtype=np.int64)[:, None] >> np.arange(n)
        signs = 1.0 - 2.0 * (codes & 1)
        return _count_at_least(signs, d, observed, tol) / 2 ** n
    rng = np.random.default_rng(seed)
    count, done, batch = 0, 0, _batch(n)
    while done < n_permutations:
        rows = min(batch, n_permutations - done)
        signs = rng.integers(0, 2, size=(rows, n), dtype=np.int8) * np.int8(2) - np.int8(1)
        count += _count_at_least(signs, d, observed, tol)
        done += rows
    return (count + 1) / (n_permutations + 1)


def cohens_dz(baseline, treatment) -> float:
    """Paired standardised effect ``d_z = mean(d) / sd(d)`` with ``d = treatment - baseline``, ddof=1.

    Zero differences give 0.0; constant non-zero differences (sd = 0, up to float rounding) give NaN:
    the effect is undefined, not infinite.
    """
    d = _paired_differences(baseline, treatment)
    if np.all(d == 0.0):
        return 0.0
    if _no_spread(d, baseline, treatment):
        return math.nan
    return float(d.mean()) / float(d.std(ddof=1))


def hedges_j(df: int) -> float:
    """Hedges' exact small-sample factor ``J(df) = Gamma(df/2) / (sqrt(df/2) Gamma((df-1)/2))``
    (Hedges 1981; ~ ``1 - 3 / (4 df - 1)``): a standardised mean difference whose sd has ``df`` degrees
    of freedom overstates the true effect by ``1 / J(df)`` on average (normal data), so ``J(df) * d`` is
    unbiased. ``J(4) = 0.798``: at 5 paired seeds d_z overstates by ~25%. NaN below 2 degrees of
    freedom: at ``df = 1`` the mean of d is infinite and no factor makes it unbiased (``J(1) = 0``)."""
    if df < 2:
        return math.nan
    return math.exp(special.gammaln(df / 2) - special.gammaln((df - 1) / 2)) / math.sqrt(df / 2)


def hedges_gz(baseline, treatment) -> float:
    """Paired standardised effect with Hedges' small-sample correction: ``g_z = J(n - 1) * d_z``
    (:func:`hedges_j`, :func:`cohens_dz`), the unbiased version of d_z for normal differences. At the
    reports' 5 seeds ``J(4) = 0.798``. Undefined (NaN) where d_z is, and at 2 pairs (:func:`hedges_j`);
    zero differences give 0.0."""
    dz = cohens_dz(baseline, treatment)
    if dz == 0.0:
        return 0.0
    return hedges_j(len(np.asarray(baseline)) - 1) * dz


def hedges_g(baseline, treatment) -> float:
    """Independent-samples standardised mean difference with Hedges' small-sample correction.

    ``g = J(df) * (mean(treatment) - mean(baseline)) / s_pooled`` with
    ``s_pooled = sqrt(((n1-1) s1^2 + (n2-1) s2^2) / df)``, ``df = n1 + n2 - 2`` and the exact factor
    :func:`hedges_j` (Hedges 1981). The two groups need not pair up or have equal size. Zero pooled
    spread gives 0.0 for equal means, else NaN (undefined, as :func:`cohens_dz`).
    """
    b = _vector(baseline, "baseline")
    t = _vector(treatment, "treatment")
    _need(b.size, "hedges_g baseline")
    _need(t.size, "hedges_g treatment")
    df = b.size + t.size - 2
    pooled = math.sqrt(((b.size - 1) * b.var(ddof=1) + (t.size - 1) * t.var(ddof=1)) / df)
    diff = float(t.mean() - b.mean())
    if pooled == 0.0:
        return 0.0 if diff == 0.0 else math.nan
    return hedges_j(df) * diff / pooled


def cliffs_delta(baseline, treatment) -> float:
    """Cliff's delta ``P(T > B) - P(T < B)`` over all (baseline, treatment) pairs, in [-1, 1].

    Rank-based, so insensitive to outlier seeds; the paper's checklist offers it beside Cohen's d.
    """
    b = _vector(baseline, "baseline")
    t = _vector(treatment, "treatment")
    _need(min(b.size, t.size), "cliffs_delta", minimum=1)
    sign = np.sign(t[:, None] - b[None, :])
    return float(sign.mean())


def paired_t_ci(baseline, treatment, *, confidence: float = 0.95) -> tuple[float, float, float]:
    """Paired t interval of ``mean(treatment - baseline)``: ``mean ± t_{n-1, (1+c)/2} * sd / sqrt(n)``.

    Exact under normally distributed differences, and the interval to use over a handful of seeds.
    Returns ``(mean_diff, lo, hi)``; zero differences give ``(0, 0, 0)``, constant non-zero ones
    (sd = 0) ``(mean, NaN, NaN)``: no spread was seen, so the interval is undefined, not zero-width.
    """
    _check_confidence(confidence)
    d = _paired_differences(baseline, treatment)
    m = float(d.mean())
    if m != 0.0 and _no_spread(d, baseline, treatment):
        return m, math.nan, math.nan
    se = float(d.std(ddof=1)) / math.sqrt(d.size)
    half = float(stats.t.ppf(0.5 + confidence / 2, d.size - 1)) * se
    return m, m - half, m + half


def paired_t_test(baseline, treatment) -> float:
    """Two-sided p of the paired t-test (H0: mean difference 0). Zero differences give 1; constant
    non-zero ones (sd = 0, up to float rounding) give NaN: the t statistic is undefined, and p = 0 would
    call two seeds that happen to agree a certain difference."""
    d = _paired_differences(baseline, treatment)
    if np.all(d == 0.0):
        return 1.0
    if _no_spread(d, baseline, treatment):
        return math.nan
    t = float(d.mean()) / (float(d.std(ddof=1)) / math.sqrt(d.size))
    return float(2.0 * stats.t.sf(abs(t), d.size - 1))


def holm(p_values) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error over the comparisons given), input order.

    ``p_adj[(i)] = max_{j <= i} min(1, (m - j + 1) * p_(j))`` over the ascending order ``p_(1) <= ...``.
    ``None`` and NaN entries (comparisons that could not be made or whose p is undefined) come back
    ``None`` and do not count in ``m``.
    """
    idx = [i for i, p in enumerate(p_values) if p is not None and not math.isnan(p)]
    p = np.array([float(p_values[i]) for i in idx], dtype=np.float64)
    out: list = [None] * len(p_values)
    order = np.argsort(p, kind="stable")
    running = 0.0
    for rank, k in enumerate(order):
        running = max(running, min(1.0, (p.size - rank) * p[k]))
        out[idx[k]] = running
    return out


def _documents(d: np.ndarray, documents) -> tuple[np.ndarray, np.ndarray]:
    """Per document: sum of the differences of its windows and its window count (``[n_docs]`` each)."""
    docs = np.asarray(documents)
    if docs.shape != d.shape:
        raise ValueError(f"documents: {docs.size} ids for {d.size} per-sequence values; one id per sequence")
    _, inverse = np.unique(docs, return_inverse=True)
    sums = np.bincount(inverse, weights=d)
    counts = np.bincount(inverse).astype(np.float64)
    _need(sums.size, "documents")
    return sums, counts


def document_bootstrap_ci(baseline, treatment, documents, *, n_resamples: int = 10_000,
                          confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Cluster bootstrap of the mean per-sequence difference: documents (all their windows together)
    are drawn with replacement, and each resample's statistic is its windows' mean difference
    (sum over drawn documents / windows drawn). Percentile interval at ``confidence``. Returns
    ``(mean_diff, lo, hi)``.

    With few documents of uneven size the percentile interval covers less than ``confidence`` (at the
    reports' 28 validation documents, 95% covers ~0.90): :func:`compare_per_document` uses the level
    calibrated by simulation for the design (:func:`document_bootstrap_level`) and labels it so."""
    _check_confidence(confidence)
    d = _paired_differences(baseline, treatment)
    sums, counts = _documents(d, documents)
    rng = np.random.default_rng(seed)
    n_docs = sums.size
    stats_out, done = [], 0
    batch = _batch(n_docs)
    while done < n_resamples:
        rows = min(batch, n_resamples - done)
        draws = rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=rows).astype(np.float64)
        stats_out.append((draws @ sums) / (draws @ counts))  # [rows]
        done += rows
    boot = np.concatenate(stats_out)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(boot, [alpha, 1.0 - alpha])
    return float(d.mean()), float(lo), float(hi)


# The validation design of every committed report (benchmarks/results/research/*/per_sequence.npz): 256
# windows in 28 documents, windows per document (descending). At this design the plain 95% percentile
# document bootstrap covers only ~0.90 (few documents, one holding 77 of the 256 windows), so the
# percentile level is calibrated by simulation: ``{target coverage: (design, percentile level)}``.
# Measured (3,000 simulated experiments x 2,000 resamples per setting, true mean known; per-document
# effect sd / per-window noise sd 0.008/0.01, 0.008/0, 0.3/0.05, and t(3) document effects): the 98.25%
# percentile interval covers 0.950-0.954 (the 95% one 0.895-0.902, 98% 0.943-0.949, 99% 0.963-0.966).
# Checked in tests/unit/test_research_stats_calibrated.py.
VALIDATION_DESIGN_28 = (77, 37, 31, 17, 14, 13, 10, 9, 7, 7, 7, 4, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
DOCUMENT_BOOTSTRAP_CALIBRATION = {0.95: (VALIDATION_DESIGN_28, 0.9825)}


def _design(documents) -> tuple:
    """Windows per document, descending: what the document bootstrap's coverage depends on."""
    _, counts = np.unique(np.asarray(documents), return_counts=True)
    return tuple(sorted((int(c) for c in counts), reverse=True))


def document_bootstrap_level(documents, confidence: float = 0.95) -> float | None:
    """Percentile level at which :func:`document_bootstrap_ci` covers ``confidence`` at this design
    (windows per document), where that was calibrated by simulation
    (:data:`DOCUMENT_BOOTSTRAP_CALIBRATION`); ``None`` at any other design or confidence."""
    design, level = DOCUMENT_BOOTSTRAP_CALIBRATION.get(confidence, (None, None))
    return level if design is not None and _design(documents) == design else None


def document_randomization_test(baseline, treatment, documents, *, n_permutations: int = 10_000,
                                seed: int = 0) -> float:
    """Two-sided randomisation test with documents as the unit: under H0 the two systems are
    exchangeable within each document, so the sign of each document's summed difference is flipped
    at random. ``p = (c + 1) / (R + 1)``."""
    d = _paired_differences(baseline, treatment)
    sums, _ = _documents(d, documents)
    return approximate_randomization_test(np.zeros_like(sums), sums, n_permutations=n_permutations, seed=seed,
                                          exact=False if sums.size > EXACT_MAX_N else None)


@dataclass(frozen=True)
class PairedComparison:
    """Everything reported for one treatment-vs-baseline comparison (differences: treatment - baseline)."""

    n: int
    mean_diff: float
    ci_low: float
    ci_high: float
    confidence: float
    p_value: float
    cohens_dz: float
    hedges_gz: float
    hedges_g: float
    interval: str = "paired t"
    test: str = "paired t-test"
    p_randomization: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# below this many pairs only the paired t interval is given. The percentile bootstrap's coverage of a nominal
# 95% (normal differences, 2,000 resamples): ~0.93 at 20 pairs (0.928 over 12,000 experiments; normal theory
# 0.929), 0.94-0.95 at 100-200 (theory 0.946 / 0.948), ~0.90-0.91 at 10 (theory 0.904): it approaches 95%
# slowly; tests/unit/test_research_stats_coverage.py
BOOTSTRAP_MIN_N = 20


def compare_paired(baseline, treatment, *, n_resamples: int = 10_000, n_permutations: int = 10_000,
                   confidence: float = 0.95, seed: int = 0, exact: bool | None = None,
                   interval: str = "t") -> PairedComparison:
    """One paired comparison: interval, p-value and effect sizes.

    ``interval="t"`` (the default, the one for seeds): paired t interval and paired t-test p.
    ``interval="bootstrap"``: percentile bootstrap interval (nominal: ~0.93 coverage at
    ``BOOTSTRAP_MIN_N`` pairs, approaching 0.95 with more) and approximate-randomisation p; refused below ``BOOTSTRAP_MIN_N``
    pairs, where its coverage falls further (0.91 at 10, ~0.74 at 3). The randomisation p is
    reported beside the t-test p in either case (``p_randomization``)."""
    b = _vector(baseline, "baseline")
    t = _vector(treatment, "treatment")
    p_rand = approximate_randomization_test(b, t, n_permutations=n_permutations, seed=seed, exact=exact)
    if interval == "t":
        mean_diff, lo, hi = paired_t_ci(b, t, confidence=confidence)
        p, names = paired_t_test(b, t), ("paired t", "paired t-test")
    elif interval == "bootstrap":
        if b.size < BOOTSTRAP_MIN_N:
            raise ValueError(f"percentile bootstrap over {b.size} pairs: below {BOOTSTRAP_MIN_N} its coverage is "
                             "far below nominal; use interval='t'")
        mean_diff, lo, hi = paired_bootstrap_ci(b, t, n_resamples=n_resamples, confidence=confidence, seed=seed)
        p, names = p_rand, ("percentile bootstrap", "approximate randomisation")
    else:
        raise ValueError(f"interval must be 't' or 'bootstrap', got {interval!r}")
    return PairedComparison(n=int(b.size), mean_diff=mean_diff, ci_low=lo, ci_high=hi, confidence=confidence,
                            p_value=p, cohens_dz=cohens_dz(b, t), hedges_gz=hedges_gz(b, t), hedges_g=hedges_g(b, t),
                            interval=names[0],
                            test=names[1], p_randomization=p_rand)


def compare_per_document(baseline_losses, treatment_losses, documents, *, n_resamples: int = 10_000,
                         n_permutations: int = 10_000, confidence: float = 0.95, seed: int = 0) -> PairedComparison:
    """Per-sequence comparison with whole documents as the unit of analysis.

    ``baseline_losses``/``treatment_losses``: ``[n_sequences]`` or ``[n_seeds, n_sequences]`` (seeds
    averaged first); ``documents``: one document id per sequence (windows sharing a document share an
    id). Document bootstrap interval and document sign-flip p; ``n`` is the number of documents, and the
    effect sizes are over documents too: d_z and g_z of the per-document summed differences (the
    values the sign-flip test flips) and Hedges' g between the per-document mean losses (between loss
    sums it would measure the documents' lengths: 1 to 77 windows gave a pooled SD of ~85 nats and
    g ~ 0.0004). Windows
    of one document are not independent, so an effect size over windows would not describe the ``n``
    units reported.

    The interval is reported at ``confidence`` only where its coverage was checked by simulation at this
    design (:func:`document_bootstrap_level`): there the percentile level is the calibrated one (98.25%
    for 95% at the 28-document validation set of the reports) and ``interval`` says "calibrated".
    Elsewhere it is the plain ``confidence`` percentile interval and ``interval`` says its coverage was
    not checked (at the reports' design the plain 95% interval covered ~0.90)."""
    b = np.asarray(baseline_losses, dtype=np.float64)
    t = np.asarray(treatment_losses, dtype=np.float64)
    if b.shape != t.shape:
        raise ValueError(f"per-sequence data: baseline shape {b.shape} != treatment shape {t.shape}")
    if b.ndim == 2:
        b, t = b.mean(axis=0), t.mean(axis=0)
    level = document_bootstrap_level(documents, confidence)
    mean_diff, lo, hi = document_bootstrap_ci(b, t, documents, n_resamples=n_resamples,
                                              confidence=level or confidence, seed=seed)
    p = document_randomization_test(b, t, documents, n_permutations=n_permutations, seed=seed)
    (b_docs, counts), t_docs = _documents(b, documents), _documents(t, documents)[0]  # [n_docs] loss sums
    return PairedComparison(n=int(b_docs.size), mean_diff=mean_diff, ci_low=lo, ci_high=hi, confidence=confidence,
                            p_value=p, cohens_dz=cohens_dz(b_docs, t_docs), hedges_gz=hedges_gz(b_docs, t_docs),
                            hedges_g=hedges_g(b_docs / counts, t_docs / counts),
                            interval=(f"document bootstrap (percentile at {level * 100:g}%, calibrated to "
                                      f"{confidence * 100:g}% coverage at this design)" if level else
                                      f"document bootstrap (percentile at {confidence * 100:g}%, coverage not "
                                      "checked at this design)"),
                            test="document sign-flip randomisation",
                            p_randomization=p)


def compare_per_example(baseline_losses, treatment_losses, **kwargs) -> PairedComparison:
    """Paired comparison over evaluation examples (the paper's test-set-resampling bootstrap).

    Accepts per-example values of shape ``[n_examples]`` (one run each) or ``[n_seeds, n_examples]``
    (rows paired by seed, columns by example; every run must score the same examples in the same order).
    With several seeds, each example's value is first averaged over seeds, then examples are the
    resampling unit. Keyword arguments are those of :func:`compare_paired`.
    """
    b = np.asarray(baseline_losses, dtype=np.float64)
    t = np.asarray(treatment_losses, dtype=np.float64)
    if b.shape != t.shape:
        raise ValueError(f"per-example data: baseline shape {b.shape} != treatment shape {t.shape}; "
                         "both must score the same examples (and seeds) in the same order")
    if b.ndim == 2:
        b, t = b.mean(axis=0), t.mean(axis=0)
    elif b.ndim != 1:
        raise ValueError(f"per-example data: expected [n_examples] or [n_seeds, n_examples], got {b.shape}")
    kwargs.setdefault("interval", "bootstrap")
    return compare_paired(b, t, **kwargs)
