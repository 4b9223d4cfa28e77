"""Significance statistics and ablation tables against references whose answer is known by hand."""

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from ascender_dist.research import stats
from ascender_dist.research.tables import pareto_front, results_table, summary_table


# ----------------------------------------------------------------------------------------- summarize


def test_summarize_mean_std_n():
    assert stats.summarize([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, math.sqrt(5 / 3), 4))


@pytest.mark.parametrize("fn", [
    lambda: stats.summarize([1.0]),
    lambda: stats.paired_bootstrap_ci([1.0], [2.0]),
    lambda: stats.approximate_randomization_test([1.0], [2.0]),
    lambda: stats.cohens_dz([1.0], [2.0]),
    lambda: stats.hedges_g([1.0], [2.0, 3.0]),
])
def test_fewer_than_two_values_is_a_clear_error(fn):
    with pytest.raises(ValueError, match="at least 2 values, got n=1"):
        fn()


def test_unpaired_lengths_and_non_finite_are_rejected():
    with pytest.raises(ValueError, match="3 values but treatment has 2"):
        stats.paired_bootstrap_ci([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="non-finite"):
        stats.approximate_randomization_test([1, 2, float("nan")], [1, 2, 3])


# ----------------------------------------------------------------------------------------- bootstrap


def test_identical_arrays_give_zero_ci_and_p_one():
    x = [3.1, 3.4, 2.9, 3.0]
    assert stats.paired_bootstrap_ci(x, x) == (0.0, 0.0, 0.0)
    assert stats.approximate_randomization_test(x, x) == 1.0
    assert stats.approximate_randomization_test(x, x, exact=True) == 1.0
    assert stats.approximate_randomization_test(x, x, exact=False) == 1.0
    assert stats.cohens_dz(x, x) == 0.0


def test_constant_differences_give_zero_width_ci_at_that_value():
    base = np.array([3.0, 2.5, 4.0, 3.3, 2.8])
    mean_diff, lo, hi = stats.paired_bootstrap_ci(base, base - 0.25)
    assert mean_diff == pytest.approx(-0.25) and lo == pytest.approx(-0.25) and hi == pytest.approx(-0.25)


def test_large_n_bootstrap_ci_is_close_to_the_t_interval():
    rng = np.random.default_rng(123)
    base = rng.normal(3.0, 1.0, 2000)
    treat = base + rng.normal(0.5, 1.0, 2000)
    d = treat - base
    half = sps.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    mean_diff, lo, hi = stats.paired_bootstrap_ci(base, treat, n_resamples=4000, seed=0)
    assert mean_diff == pytest.approx(d.mean())
    assert lo == pytest.approx(d.mean() - half, abs=0.1 * half)
    assert hi == pytest.approx(d.mean() + half, abs=0.1 * half)


def test_bootstrap_is_reproducible_per_seed():
    rng = np.random.default_rng(0)
    base, treat = rng.normal(size=10), rng.normal(size=10)
    a = stats.paired_bootstrap_ci(base, treat, n_resamples=500, seed=7)
    assert a == stats.paired_bootstrap_ci(base, treat, n_resamples=500, seed=7)
    assert a != stats.paired_bootstrap_ci(base, treat, n_resamples=500, seed=8)


# ------------------------------------------------------------------------------------ randomisation


def _enumerated_p(base, treat):
    """Reference: all 2^n within-pair swaps, written independently of the implementation."""
    pairs = list(zip(base, treat))
    observed = abs(np.mean([t - b for b, t in pairs]))
    hits = 0
    for swaps in itertools.product([False, True], repeat=len(pairs)):
        diffs = [(b - t) if s else (t - b) for (b, t), s in zip(pairs, swaps)]
        hits += abs(np.mean(diffs)) >= observed - 1e-12
    return hits / 2 ** len(pairs)


@pytest.mark.parametrize("shift", [0.0, 0.3, 1.0])
def test_exact_mode_equals_enumeration_and_scipy(shift):
    rng = np.random.default_rng(42)
    base = rng.normal(size=8)
    treat = base + shift + rng.normal(size=8)
    p = stats.approximate_randomization_test(base, treat, exact=True)
    assert p == pytest.approx(_enumerated_p(base, treat), abs=1e-12)
    d = treat - base
    ref = sps.permutation_test((d,), lambda x, axis: np.abs(np.mean(x, axis=axis)), permutation_type="samples",
                               alternative="greater", vectorized=True, n_resamples=np.inf).pvalue
    assert p == pytest.approx(ref, abs=1e-12)


def test_monte_carlo_p_matches_exact_within_sampling_error():
    rng = np.random.default_rng(5)
    base = rng.normal(size=12)
    treat = base + 0.4 + rng.normal(size=12)
    exact = stats.approximate_randomization_test(base, treat, exact=True)
    r = 20_000
    mc = stats.approximate_randomization_test(base, treat, exact=False, n_permutations=r, seed=3)
    assert 0.01 < exact < 0.99  # a non-trivial case
    assert mc == pytest.approx(exact, abs=4 * math.sqrt(exact * (1 - exact) / r) + 1 / r)


def test_default_is_exact_when_enumeration_is_cheaper():
    rng = np.random.default_rng(1)
    base, treat = rng.normal(size=6), rng.normal(size=6)
    assert stats.approximate_randomization_test(base, treat) == stats.approximate_randomization_test(
        base, treat, exact=True)


def test_floor_of_exact_p_and_plus_one_correction():
    base = np.array([3.0, 3.1, 2.9, 3.2, 3.05])
    assert stats.approximate_randomization_test(base, base + 0.1, exact=True) == pytest.approx(2 / 32)
    rng = np.random.default_rng(0)
    big = rng.normal(size=200)  # a huge effect: no shuffle reaches it, so p = (0 + 1) / (R + 1)
    assert stats.approximate_randomization_test(big, big + 5, n_permutations=999) == pytest.approx(1 / 1000)


def test_exact_mode_refuses_large_n():
    with pytest.raises(ValueError, match="n <= 16"):
        stats.approximate_randomization_test(np.zeros(17), np.ones(17) + np.arange(17), exact=True)


# ------------------------------------------------------------------------------------- effect sizes


def test_cohens_dz_hand_formula():
    base = [1.0, 2.0, 3.0, 4.0]
    treat = [1.5, 2.0, 4.0, 4.5]  # d = 0.5, 0, 1, 0.5: mean 0.5, sd sqrt(1/6)
    assert stats.cohens_dz(base, treat) == pytest.approx(0.5 / math.sqrt(1 / 6))


def test_hedges_gz_is_d_z_times_the_exact_j_of_its_degrees_of_freedom():
    base = [1.0, 2.0, 3.0, 4.0]
    treat = [1.5, 2.0, 4.0, 4.5]  # 4 pairs: sd with 3 degrees of freedom
    j3 = math.gamma(3 / 2) / (math.sqrt(3 / 2) * math.gamma(1))
    assert stats.hedges_j(3) == pytest.approx(j3)
    assert stats.hedges_gz(base, treat) == pytest.approx(j3 * stats.cohens_dz(base, treat))
    c = stats.compare_paired(base, treat, interval="t")
    assert c.hedges_gz == pytest.approx(j3 * c.cohens_dz) and c.to_dict()["hedges_gz"] == c.hedges_gz
    # undefined where d_z is, and at 2 pairs (J(1) = 0: no unbiased factor); zero differences give 0
    assert math.isnan(stats.hedges_gz([3.0, 3.5], [3.25, 3.75])) and math.isnan(stats.hedges_gz([1, 2], [2, 2]))
    assert stats.hedges_gz(base, base) == 0.0


def test_equal_paired_differences_leave_t_interval_p_and_dz_undefined():
    """Two seeds with d = [0.25, 0.25]: sd 0, so the t statistic, the t interval and d_z divide by 0.
    They were p = 0, a zero-width interval [0.25, 0.25] and d_z = inf, which read as certainty."""
    base, treat = [3.0, 3.5], [3.25, 3.75]
    assert math.isnan(stats.paired_t_test(base, treat)) and math.isnan(stats.cohens_dz(base, treat))
    m, lo, hi = stats.paired_t_ci(base, treat)
    assert m == pytest.approx(0.25) and math.isnan(lo) and math.isnan(hi)
    assert math.isnan(stats.hedges_g([1.0, 1.0], [2.0, 2.0]))
    c = stats.compare_paired(base, treat, interval="t")
    assert math.isnan(c.p_value) and math.isnan(c.ci_low) and math.isnan(c.cohens_dz)
    # equal up to float rounding (5.1 - 5.0 and 3.1 - 3.0 differ in the last bits): undefined too
    base, treat = [5.0, 4.0, 3.0], [5.1, 4.1, 3.1]
    assert np.ptp(np.subtract(treat, base)) > 0 and math.isnan(stats.paired_t_test(base, treat))
    base, treat = [3.0, 3.5], [3.25, 3.75]
    # zero differences stay p = 1, interval (0, 0, 0), d_z 0
    assert stats.paired_t_test(base, base) == 1.0 and stats.paired_t_ci(base, base) == (0.0, 0.0, 0.0)
    assert stats.holm([0.01, math.nan, None, 0.04]) == pytest.approx([0.02, None, None, 0.04])  # NaN: no test


def test_per_document_effect_sizes_are_over_documents_as_its_n():
    """n is the number of documents, so the effect sizes are over documents, not over the windows: a
    document of many windows is one unit. d_z is over the per-document summed differences (the values
    the sign-flip test flips); Hedges' g between the per-document mean losses, since between sums it
    measured the documents' lengths (g ~ 0.0004 in the reports where d_z was 0.3-0.5)."""
    docs = np.repeat([0, 1, 2, 3], [6, 1, 2, 3])  # 12 windows in 4 documents
    rng = np.random.default_rng(3)
    base = rng.normal(3.0, 0.2, docs.size)
    treat = base + np.array([0.05, 0.3, -0.1, 0.2])[docs] + rng.normal(0, 0.05, docs.size)
    c = stats.compare_per_document(base, treat, docs, n_resamples=200, n_permutations=200)
    b_sums, t_sums = np.bincount(docs, weights=base), np.bincount(docs, weights=treat)
    d = t_sums - b_sums
    assert c.n == 4
    assert c.cohens_dz == pytest.approx(d.mean() / d.std(ddof=1))
    counts = np.bincount(docs)
    assert c.hedges_g == pytest.approx(stats.hedges_g(b_sums / counts, t_sums / counts))
    assert c.hedges_g != pytest.approx(stats.hedges_g(b_sums, t_sums), rel=0.5)
    assert c.cohens_dz != pytest.approx(stats.cohens_dz(base, treat), rel=0.05)  # the windows' d_z differs


def test_hedges_g_hand_formula():
    a = [2.0, 4.0, 4.0, 5.0, 6.0]
    b = [5.0, 6.0, 7.0, 7.0, 8.0, 9.0, 10.0]
    ma, mb = 4.2, 52 / 7
    va = sum((x - ma) ** 2 for x in a) / 4
    vb = sum((x - mb) ** 2 for x in b) / 6
    df = 10
    sp = math.sqrt((4 * va + 6 * vb) / df)
    j = math.gamma(df / 2) / (math.sqrt(df / 2) * math.gamma((df - 1) / 2))
    g = stats.hedges_g(a, b)
    assert g == pytest.approx(j * (mb - ma) / sp)
    assert g == pytest.approx((1 - 3 / (4 * df - 1)) * (mb - ma) / sp, rel=1e-3)  # the usual approximation


def test_cliffs_delta_hand_count():
    # t > b in 6 of 9 pairs, t < b in 1, ties in 2
    assert stats.cliffs_delta([1, 2, 3], [2, 3, 4]) == pytest.approx(5 / 9)


def test_compare_per_example_averages_seeds_then_pairs_examples():
    rng = np.random.default_rng(0)
    base = rng.normal(2.0, 0.5, size=(3, 50))
    treat = base - 0.1 + rng.normal(0, 0.05, size=(3, 50))
    two_d = stats.compare_per_example(base, treat, n_resamples=500, n_permutations=500)
    one_d = stats.compare_paired(base.mean(0), treat.mean(0), n_resamples=500, n_permutations=500,
                                 interval="bootstrap")
    assert two_d == one_d and two_d.n == 50
    assert two_d.ci_low < -0.1 < two_d.ci_high and two_d.p_value == pytest.approx(1 / 501)
    with pytest.raises(ValueError, match="same examples"):
        stats.compare_per_example(base, treat[:, :49])


# -------------------------------------------------------------------------------------------- tables

BASE = {1: 3.50, 2: 3.55, 3: 3.48, 5: 3.52, 7: 3.60}


def _rows():
    rows = [{"config": "base", "seed": s, "loss": v} for s, v in BASE.items()]
    # rows listed in reverse seed order: pairing must follow the seed, not the row order
    rows += [{"config": "minus", "seed": s, "loss": BASE[s] - 0.1} for s in reversed(list(BASE))]
    rows += [{"config": "partial", "seed": s, "loss": BASE[s] + 0.02 * i} for i, s in enumerate([1, 2, 3])]
    rows += [{"config": "single", "seed": 1, "loss": 3.0}]
    return rows


def test_results_table_pairs_by_seed():
    md, obj = results_table(_rows(), baseline="base", metric="loss", n_resamples=500, n_permutations=500)
    json.dumps(obj, allow_nan=False)  # strictly valid JSON
    by = {c["config"]: c for c in obj["configs"]}
    assert [c["config"] for c in obj["configs"]] == ["base", "minus", "partial", "single"]
    mean, std, n = stats.summarize(list(BASE.values()))
    assert by["base"]["mean"] == pytest.approx(mean) and by["base"]["std"] == pytest.approx(std)
    assert by["base"]["comparison"] is None and by["base"]["n"] == 5

    minus = by["minus"]["comparison"]  # -0.1 on every seed (up to float rounding): sd 0
    assert minus["mean_diff"] == pytest.approx(-0.1) and minus["interval"] == "paired t"
    assert minus["p_randomization"] == pytest.approx(2 / 32)   # exact test over 5 seeds: its floor
    assert minus["ci_low"] is minus["ci_high"] is minus["p_value"] is minus["p_holm"] is minus["cohens_dz"] is None
    assert minus["hedges_gz"] is None
    assert minus["paired_seeds"] == [7, 5, 3, 2, 1]

    partial = by["partial"]
    assert partial["comparison"]["n"] == 3 and partial["comparison"]["mean_diff"] == pytest.approx(0.02)
    assert "paired on 3 shared seeds" in partial["note"]
    assert by["single"]["std"] is None and by["single"]["comparison"] is None

    lines = md.splitlines()
    assert lines[0] == ("| config | n | loss mean ± std | Δ vs base [95% paired t CI] | p (paired t) "
                        "| p Holm (m=1) | g_z |")  # minus has no p: not in the family
    assert lines[2] == "| base | 5 | 3.53 ± 0.0469 | (baseline) |  |  |  |"
    assert lines[3] == "| minus | 5 | 3.43 ± 0.0469 | -0.1 [undefined] | undefined (sd = 0) | n/a | undefined |"
    assert lines[5] == "| single | 1 | 3 ± n/a | n/a | n/a | n/a | n/a |"
    # below 10 seeds: every seed's value and its paired difference
    assert "Per seed: loss (Δ vs base, same seed)" in md
    per_seed = next(ln for ln in lines if ln.startswith("| minus |") and "(-0.1)" in ln)
    assert per_seed.count("(-0.1)") == 5
    assert obj["interval"].startswith("paired t interval") and "Holm" in obj["multiple_comparisons"]
    assert "- single: only 1 seed: no std; 1 seed(s) shared with baseline: no paired test" in md


@pytest.mark.parametrize("rows, match", [
    ([{"config": "a", "seed": 1, "loss": 1.0}], "baseline 'base' has no rows"),
    ([{"config": "base", "seed": 1, "loss": 1.0}, {"config": "base", "seed": 1, "loss": 2.0}], "duplicate run"),
    ([{"config": "base", "seed": 1}], "missing key 'loss'"),
    ([{"config": "base", "seed": 1, "loss": "x"}], "not a number"),
])
def test_results_table_rejects_bad_rows(rows, match):
    with pytest.raises(ValueError, match=match):
        results_table(rows, baseline="base", metric="loss")


def test_results_table_leaves_a_diverged_run_out_and_names_it():
    """A NaN run (training is deterministic: a re-run diverges again) made the grid impossible to report;
    it is left out of the statistics, counted per config and named in the table's notes."""
    rows = _rows()
    rows[6]["loss"] = float("nan")  # minus, seed 5
    md, obj = results_table(rows, baseline="base", metric="loss", n_resamples=200, n_permutations=200)
    json.dumps(obj, allow_nan=False)
    minus = {c["config"]: c for c in obj["configs"]}["minus"]
    assert minus["n"] == 4 and minus["diverged"] == [5] and "5" not in minus["per_seed"]
    assert minus["comparison"]["paired_seeds"] == [7, 3, 2, 1]
    assert "| minus | 4 (+1 diverged) |" in md
    assert "- minus: 1 diverged run(s) left out of the statistics (seed(s) 5: loss not finite" in md
    assert next(ln for ln in md.splitlines() if ln.startswith("| minus |") and "(-0.1)" in ln).count("diverged") == 1
    rows[0]["loss"] = None  # as results.json writes a non-finite value: the baseline's seed 1
    md, obj = results_table(rows, baseline="base", metric="loss", n_resamples=200, n_permutations=200)
    assert obj["configs"][0]["diverged"] == [1] and "| base | 4 (+1 diverged) |" in md


def test_equal_differences_over_seeds_print_an_undefined_p():
    rows = [{"config": c, "seed": s, "loss": v + (0.25 if c == "b" else 0.0)}
            for c in ("a", "b") for s, v in ((1, 3.0), (2, 3.5))]
    md, obj = results_table(rows, baseline="a", metric="loss", n_resamples=200, n_permutations=200)
    assert "| b | 2 | 3.5 ± 0.3536 | 0.25 [undefined] | undefined (sd = 0) | n/a | undefined |" in md
    assert "p Holm (m=0)" in md and "every paired difference is 0.25 (sd = 0)" in md
    assert obj["configs"][1]["comparison"]["p_value"] is None


def test_summary_table_skips_nan_cells():
    rows = [{"config": "asc", "seed": s, "nmi": 0.5 + 0.1 * s, "silhouette": float("nan") if s == 1 else 0.2}
            for s in (1, 2, 3)]
    md, obj = summary_table(rows, ["nmi", "silhouette"])
    cell = obj["configs"][0]["metrics"]
    assert cell["nmi"]["mean"] == pytest.approx(0.7) and cell["nmi"]["n"] == 3
    assert cell["silhouette"] == {"mean": 0.2, "std": 0.0, "n": 2}
    assert md.splitlines()[2] == "| asc | 3 | 0.7 ± 0.1 | 0.2 ± 0 (n=2) |"


def test_pareto_front_hand_example():
    #            0        1        2        3          4        5
    points = [(1.0, 5.0), (2.0, 2.0), (3.0, 1.0), (2.5, 2.5), (1.0, 5.0), (4.0, 4.0)]
    # 3 is dominated by 1, 5 by 1 and 2; 0 and 4 tie and both stay; ordered by cost
    assert pareto_front(points) == [2, 1, 0, 4]
    acc = [(0.9, 5.0), (0.8, 2.0), (0.85, 3.0), (0.7, 2.5)]  # accuracy: higher is better
    assert pareto_front(acc, maximize_quality=True) == [1, 2, 0]
    with pytest.raises(ValueError, match="quality, cost"):
        pareto_front([1.0, 2.0])
