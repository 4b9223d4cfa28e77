"""benchmarks/attention_fixed_cost.py: the line fit and the per-round summary, on made-up timings."""

import pytest

from benchmarks.attention_fixed_cost import HEAD_COUNTS, fit_line, summary


def test_fit_line_recovers_intercept_and_slope():
    xs = [1, 2, 4, 8]
    assert fit_line(xs, [0.3 + 0.2 * x for x in xs]) == pytest.approx((0.3, 0.2))
    # least squares, not the end points: mean x 3.75, mean y 1.0, Sxx 28.75, Sxy 6.6
    intercept, slope = fit_line(xs, [0.4, 0.6, 1.0, 2.0])
    assert slope == pytest.approx(6.6 / 28.75) and intercept == pytest.approx(1.0 - 3.75 * 6.6 / 28.75)


def test_summary_reports_multiples_of_the_same_rounds_sdpa():
    rounds = []
    for sdpa_s, fixed, per_head in ((0.5, 0.1, 0.25), (1.0, 0.2, 0.5), (0.4, 0.1, 0.2)):
        fast = {str(h): fixed + h * per_head for h in HEAD_COUNTS}
        rounds.append(dict(sdpa_s=sdpa_s, fast_s=fast, fixed_s=fixed, per_head_s=per_head))
    s = summary({"rounds": rounds})
    assert s["fixed_x_sdpa"] == {"median": pytest.approx(0.2), "min": pytest.approx(0.2)}
    assert s["per_head_work_x_sdpa"]["median"] == pytest.approx(4.0)
    assert s["fast_x_sdpa"]["median"] == pytest.approx(4.2) and s["fast_x_sdpa"]["min"] == pytest.approx(4.2)
    assert s["fixed_share"]["min"] == pytest.approx(0.1 / 2.1)
