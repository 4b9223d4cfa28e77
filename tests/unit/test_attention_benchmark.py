"""benchmarks/attention.py: --merge never mixes one length from two runs, and --rewrite keeps the
recorded machine (made-up points, no timing)."""

import argparse
import json

import benchmarks.attention as bench


def _point(impl: str, n: int, commit: str, ratio: float) -> dict:
    return dict(impl=impl, n=n, status="ok", git_commit=commit, git_dirty=False, peak_mib=10.0, time_s=ratio,
                time_ratio=ratio, time_ratio_min=ratio, rounds=5, cpu_ratio=ratio, load_start=0.5, load_1m=0.5,
                threads=1, cpu="Some CPU")  # fmt: skip


def test_merge_replaces_whole_lengths():
    old = [_point(i, n, "a" * 40, 1.0) for n in (512, 2048) for i in ("sdpa", "reference", "fast")]
    new = [_point(i, 2048, "b" * 40, 2.0) for i in ("sdpa", "fast")]  # reference not re-measured
    merged = bench.merged_points(old, new)
    at_2048 = {p["impl"]: p["git_commit"][0] for p in merged if p["n"] == 2048}
    assert at_2048 == {"sdpa": "b", "fast": "b"}  # the old reference row (against the old SDPA) is gone
    assert {p["impl"] for p in merged if p["n"] == 512} == {"sdpa", "reference", "fast"}


def test_rewrite_keeps_the_recorded_machine_and_names_each_rows_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "plot", lambda points, lengths: None)
    points = [_point("sdpa", 512, "a" * 40, 1.0), _point("fast", 512, "a" * 40, 4.0),
              _point("sdpa", 1024, "c" * 40, 1.0), _point("fast", 1024, "c" * 40, 4.5)]  # fmt: skip
    args = argparse.Namespace(note=None)
    bench.write_results(points, [512, 1024], args, {"git_commit": "a" * 40, "git_dirty": False}, "Recorded CPU box")
    md = (tmp_path / "attention.md").read_text()
    assert "Machine: Recorded CPU box." in md
    assert json.loads((tmp_path / "attention.json").read_text())["machine"] == "Recorded CPU box"
    rows = [line for line in md.splitlines() if line.startswith("| 1024 | fast")]
    assert rows and rows[0].rstrip().endswith("| ccccccc |")
