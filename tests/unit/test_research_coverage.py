"""The variance-components coverage simulation (ascender_dist/research/coverage.py), whose committed
table (benchmarks/results/research/coverage/) the research README cites.

Each check can fail: the estimator must recover variances it was not told, the per-sequence interval
must cover ~0.95 where its premise holds and far less where it does not, the paired t over seeds must
cover what its documents allow, and the statistics simulated must be the ones the reports print.
Bands are +-3 binomial sd of the experiments run here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ascender_dist.research import coverage, stats

REPO = Path(__file__).resolve().parents[2]
BIAS = REPO / "benchmarks/results/research/bias"
# variances (nats^2) of seed, document, window, seed x document, residual: all distinct, so a swap shows
KNOWN = np.array([1.0e-4, 0.6e-4, 0.2e-4, 0.3e-4, 1.5e-4])


def _design() -> np.ndarray:
    return np.load(BIAS / "per_sequence.npz")["gpt|1|val_example_documents"]


def _band(p: float, n: int) -> float:
    return 3 * math.sqrt(p * (1 - p) / n)


def _draw_independently(variances, documents, n_seeds: int, datasets: int, rng) -> np.ndarray:
    """Tables ``[datasets, seeds, windows]`` drawn here, not by the module, from the five components."""
    _, inv = np.unique(documents, return_inverse=True)
    sd = np.sqrt(variances)
    n_docs, n_win = inv.max() + 1, inv.size
    return (rng.normal(0, sd[0], (datasets, n_seeds, 1)) + rng.normal(0, sd[1], (datasets, 1, n_docs))[..., inv]
            + rng.normal(0, sd[2], (datasets, 1, n_win)) + rng.normal(0, sd[3], (datasets, n_seeds, n_docs))[..., inv]
            + rng.normal(0, sd[4], (datasets, n_seeds, n_win)))


def test_expected_sums_of_squares_match_the_textbook_ones_at_the_reports_design():
    """Between-seed sum: (S-1) N σ_seed² + ...; residual sum: (S-1)(N-J) σ_res² alone; the matrix is
    upper triangular (each sum holds its own component and those nested below it)."""
    docs = _design()
    m = coverage.expected_sums_of_squares(5, docs)
    n, j = docs.size, np.unique(docs).size
    assert m[0, 0] == pytest.approx(4 * n) and m[4, 4] == pytest.approx(4 * (n - j))
    assert np.allclose(np.tril(m, -1), 0.0)
    assert m[2, 2] == pytest.approx(5 * (n - j))  # windows within documents, each seen in 5 seeds


def test_component_estimates_recover_known_components():
    """Method of moments is unbiased: over 400 tables drawn with known variances, the mean estimate of
    each is within 4 standard errors (and 10%) of the truth; the module's own generator too."""
    docs = _design()
    for name, tables in (("independent draws", _draw_independently(KNOWN, docs, 5, 400, np.random.default_rng(0))),
                         ("module's draws", coverage.draw_differences(KNOWN, docs, 5, 400,
                                                                      np.random.default_rng(1))[0])):
        est = coverage.estimate_components(tables, docs)  # [400, 5]
        se = est.std(axis=0, ddof=1) / math.sqrt(len(est))
        assert np.all(np.abs(est.mean(axis=0) - KNOWN) <= 4 * se), (name, est.mean(axis=0) / KNOWN)
        assert np.allclose(est.mean(axis=0), KNOWN, rtol=0.1), name
    one = coverage.estimate_components(_draw_independently(KNOWN * [0, 1, 1, 1, 1], docs, 5, 1,
                                                           np.random.default_rng(2))[0], docs)
    assert one.shape == (5,)


def test_reports_pair_loads_and_its_seed_means_spread_is_what_the_estimates_imply():
    """The variance of the 5 seed means implied by the estimates is their observed variance (the
    between-seed sum is matched exactly), so the simulated paired t sees the report's seed spread."""
    d, docs, seeds = coverage.load_pair(BIAS, "ascender", "no_sep")
    assert d.shape == (5, 256) and seeds == ["1", "2", "3", "5", "7"]
    v = coverage.estimate_components(d, docs)
    _, counts = np.unique(docs, return_counts=True)
    implied = v[0] + v[3] * (counts ** 2).sum() / docs.size ** 2 + v[4] / docs.size
    assert implied == pytest.approx(d.mean(axis=1).var(ddof=1), rel=1e-9)
    with pytest.raises(ValueError, match="share 0 seed"):
        coverage.load_pair(BIAS, "ascender", "no_such_variant")


def test_simulated_statistics_are_the_ones_the_report_printed():
    """printed_intervals on the bias report's own no_sep − ascender differences gives the interval and
    p its results.json holds (per sequence: same resamples, seed 0; over seeds: from the per-window
    means, which equal the recorded val_loss up to float32 rounding)."""
    d, docs, _ = coverage.load_pair(BIAS, "ascender", "no_sep")
    printed = coverage.printed_intervals(d, docs, n_resamples=10_000, seed=0)
    tables = json.loads((BIAS / "results.json").read_text())["tables"]
    seq = next(e for e in tables["per_example"]["ascender"]["configs"] if e["config"] == "no_sep")["comparison"]
    assert printed["per sequence"] == pytest.approx((seq["ci_low"], seq["ci_high"], seq["p_value"]), rel=1e-9)
    assert "calibrated to 95% coverage" in printed["label"]
    seeds = next(e for e in tables["vs"]["ascender"]["configs"] if e["config"] == "no_sep")["comparison"]
    assert printed["over seeds"] == pytest.approx((seeds["ci_low"], seeds["ci_high"], seeds["p_value"]), abs=2e-4)


def _no_sep_like(seed_variance: float) -> np.ndarray:
    v = KNOWN.copy()
    v[0] = seed_variance
    return v


def test_per_sequence_interval_covers_95_percent_only_without_seed_variance():
    """No seed effect: the calibrated document interval covers Δ variants ~0.95 and its test rejects
    ~5%. A seed effect large next to the document effect (sd 0.03 against 0.008; the reports' no_coh −
    ascender has 0.013 against ~0): it covers far less and rejects a null variant effect far more often,
    while still covering the trained models' difference."""
    docs, n = _design(), 400
    fixed = coverage.simulate_setting(_no_sep_like(0.0), docs, 5, n, n_resamples=2000, rng=np.random.default_rng(3))
    seq = fixed["per sequence"]
    assert abs(seq["covers"]["variants"]["rate"] - 0.95) <= _band(0.95, n), seq
    assert abs(seq["rejects_null"]["rate"] - 0.05) <= _band(0.05, n) + 0.01, seq
    seeded = coverage.simulate_setting(_no_sep_like(0.03 ** 2), docs, 5, n, n_resamples=2000,
                                       rng=np.random.default_rng(4))["per sequence"]
    assert seeded["covers"]["variants"]["rate"] < 0.5 and seeded["rejects_null"]["rate"] > 0.5, seeded
    assert abs(seeded["covers"]["models"]["rate"] - 0.95) <= _band(0.95, n), seeded


def test_paired_t_over_seeds_covers_the_variants_only_when_documents_are_resampled_too():
    """The reports score every seed on the same 28 documents: the paired t then covers the variants'
    difference on these documents at 95%, and the difference on text like this less (much less when
    the seed effect is small next to the documents'). Were each seed scored on its own documents, the
    t interval would cover the variants' difference at 95%."""
    docs, n = _design(), 1000
    strong_documents = np.array([0.0, 4e-4, 1e-4, 0.3e-4, 1.5e-4])  # no seed effect, large document effect
    held = coverage.simulate_setting(strong_documents, docs, 5, n, n_resamples=50,
                                     rng=np.random.default_rng(5))["over seeds"]
    assert abs(held["covers"]["documents"]["rate"] - 0.95) <= _band(0.95, n), held
    assert held["covers"]["variants"]["rate"] < 0.8, held
    fresh = coverage.simulate_setting(strong_documents, docs, 5, n, n_resamples=50, rng=np.random.default_rng(6),
                                      documents_per_seed=True)["over seeds"]
    assert abs(fresh["covers"]["variants"]["rate"] - 0.95) <= _band(0.95, n), fresh


def test_hedges_j_at_five_seeds_and_the_bias_it_removes():
    """J(4) = 0.798: at 5 seeds d_z overstates the standardised effect by 1/J(4) ~ 1.25 on average,
    g_z = J(4) d_z does not."""
    assert stats.hedges_j(4) == pytest.approx(0.7978845608, rel=1e-9)
    assert stats.hedges_j(4) == pytest.approx(math.gamma(2) / (math.sqrt(2) * math.gamma(1.5)))
    assert math.isnan(stats.hedges_j(1))
    bias = coverage.effect_size_bias(5, 4000, np.random.default_rng(7))
    dz, gz = bias["cohens_dz"], bias["hedges_gz"]
    assert abs(dz["mean_over_delta"] - 1 / stats.hedges_j(4)) <= 4 * dz["se"], dz
    assert abs(gz["mean_over_delta"] - 1.0) <= 4 * gz["se"], gz
    assert dz["mean_over_delta"] > 1.15


def test_cli_writes_json_table_and_figure_with_provenance(tmp_path, capsys):
    from ascender_dist.cli import main

    out = tmp_path / "coverage"
    assert main(["coverage", "--pair", "bias", "ascender", "no_sep", "--experiments", "8", "--n-resamples", "100",
                 "--out", str(out)]) == 0
    data = json.loads((out / "coverage.json").read_text())
    assert {"git_commit", "git_dirty", "versions", "machine", "command"} <= set(data["provenance"])
    assert len(data["settings_sha256"]) == 64 and data["settings"]["experiments"] == 8
    pair = data["pairs"][0]
    assert len(pair["per_sequence_npz_sha256"]) == 64 and pair["run_commits"] and pair["documents"] == 28
    assert [r["world"] for r in data["rows"]] == list(coverage.WORLDS)
    md = (out / "coverage.md").read_text()
    assert "`bias`: no_sep − ascender" in md and "8 simulated experiments per row" in md
    assert (out / "coverage.png").stat().st_size > 0
    (out / "coverage.md").unlink()
    assert main(["coverage", "--rewrite", "--out", str(out)]) == 0
    assert (out / "coverage.md").read_text() == md
    assert main(["coverage", "--pair", "bias", "ascender", "nothing", "--out", str(tmp_path / "x")]) == 2
    assert "share 0 seed" in capsys.readouterr().err


def test_render_states_the_design_it_was_given():
    """Seeds, documents and the per-sequence interval's name come from the data: another design's table
    said "4 degrees of freedom at 5 seeds", "28 documents" and "95% (calibrated)" regardless."""
    data = json.loads((REPO / "benchmarks" / "results" / "research" / "coverage" / "coverage.json").read_text())
    md = coverage.render(data)
    assert "(4 degrees of freedom at 5 seeds)" in md and "the 5 trained models" in md and "the 28 documents" in md
    assert 'per sequence "95% (calibrated)": covers' in md
    data["pairs"][0].update(seeds=data["pairs"][0]["seeds"][:3], documents=11)
    for row in data["rows"]:
        row["per sequence"]["interval"] = ["document bootstrap (percentile at 95%, nominal)"]
    md = coverage.render(data)
    assert "(2 degrees of freedom at 3 seeds)" in md and "the 3 trained models" in md and "the 11 documents" in md
    assert "calibrated" not in md.split("## Coverage and rejection rates")[1].split("Per-sequence interval")[0]
