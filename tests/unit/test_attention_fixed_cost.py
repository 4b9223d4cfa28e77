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


def test_the_report_names_the_recorded_cpu_count_not_a_fixed_one(tmp_path, monkeypatch):
    import benchmarks.attention_fixed_cost as bench

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    rounds = [dict(sdpa_s=1.0, fast_s={str(h): 1.0 + h for h in HEAD_COUNTS}, fixed_s=1.0, per_head_s=1.0)] * 5
    result = dict(n=2048, rounds=rounds, load_start=0.5, load_end=0.6, threads=1, machine="Some CPU",
                  machine_record={"cpu": "Some CPU", "isa": "avx2", "logical_cpus": 16}, chunk_rows=64,
                  git_commit="a" * 40, git_dirty=False)
    bench.write_results(result)
    md = (tmp_path / "attention_fixed_cost.md").read_text()
    assert "(1-minute average at start / end; 16 logical CPUs, shared)" in md and "2 shared cores" not in md
    del result["machine_record"]  # a record made before the machine record was kept: no count claimed
    bench.write_results(result)
    assert "(1-minute average at start / end)." in (tmp_path / "attention_fixed_cost.md").read_text()


def test_git_state_is_taken_before_measuring(monkeypatch):
    import benchmarks.attention_fixed_cost as bench

    events = []
    monkeypatch.setattr(bench, "git_state", lambda: events.append("git") or {"git_commit": "a", "git_dirty": False})
    monkeypatch.setattr(bench, "_layer", lambda *a, **kw: (lambda: None))
    monkeypatch.setattr(bench, "cpu_time", lambda fn: events.append("time") or 1.0)
    monkeypatch.setattr(bench, "machine", lambda: "Some CPU")
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # the test process keeps its threads
    result = bench.measure(64, 5)
    assert events[0] == "git" and events.count("git") == 1 and result["git_commit"] == "a"
    assert result["machine_record"]["logical_cpus"]
