"""benchmarks/attention.py: --merge never mixes one length from two runs, --rewrite keeps the recorded
machine and the --note paragraphs, --quick writes nothing (made-up points, no timing)."""

import json
import sys

import pytest

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
    bench.write_results(points, [512, 1024], [], {"git_commit": "a" * 40, "git_dirty": False}, "Recorded CPU box")
    md = (tmp_path / "attention.md").read_text()
    assert "Machine: Recorded CPU box." in md
    assert json.loads((tmp_path / "attention.json").read_text())["machine"] == "Recorded CPU box"
    rows = [line for line in md.splitlines() if line.startswith("| 1024 | fast")]
    assert rows and rows[0].rstrip().endswith("| ccccccc |")


def _main(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["attention.py", *argv])
    bench.main()


def test_notes_are_saved_in_the_json_and_survive_rewrite(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "plot", lambda points, lengths: None)
    points = [_point("sdpa", 512, "a" * 40, 1.0), _point("fast", 512, "a" * 40, 4.0)]
    notes = ["Reading: fast is 4x SDPA here.", "Memory: a second paragraph."]
    bench.write_results(points, [512], notes, {"git_commit": "a" * 40, "git_dirty": False}, "Recorded CPU box", cpus=2)
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert saved["notes"] == notes and saved["logical_cpus"] == 2
    (tmp_path / "attention.md").write_text("overwritten by hand")  # --rewrite renders the notes from the JSON
    _main(monkeypatch, "--rewrite")
    md = (tmp_path / "attention.md").read_text()
    assert all(note in md for note in notes) and "Machine: Recorded CPU box." in md
    assert json.loads((tmp_path / "attention.json").read_text())["notes"] == notes
    _main(monkeypatch, "--rewrite", "--note", "A new reading.")  # new notes replace the recorded ones
    md = (tmp_path / "attention.md").read_text()
    assert "A new reading." in md and notes[0] not in md


def test_quick_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "plot", lambda points, lengths: pytest.fail("--quick drew a figure"))
    measured = []

    def run_length(n, impls, args):
        measured.append(n)
        return [dict(_point(impl, n, "a" * 40, 1.0 if impl == "sdpa" else 4.0)) for impl in impls]

    monkeypatch.setattr(bench, "run_length", run_length)
    _main(monkeypatch, "--quick", "--impls", "sdpa", "fast")
    assert measured == [256, 512]
    assert list(tmp_path.iterdir()) == []
    assert "| 512 | fast |" in capsys.readouterr().out


def test_fewer_than_five_reps_are_refused(monkeypatch):
    with pytest.raises(SystemExit):
        _main(monkeypatch, "--quick", "--reps", "3")


def test_time_worker_rotates_the_order_of_the_implementations(monkeypatch):
    """No implementation always runs first in a round (the first call of a round meets a colder cache)."""
    calls = []
    monkeypatch.setattr(bench, "_layer", lambda impl, n: (lambda: calls.append(impl)))
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # the test process keeps its threads
    res = bench.time_worker(64, ["sdpa", "reference", "fast"], 5)
    rounds = [calls[3 + 3 * i: 6 + 3 * i] for i in range(5)]  # after one warm-up call each
    assert [r[0] for r in rounds] == ["sdpa", "reference", "fast", "sdpa", "reference"]
    assert all(sorted(r) == ["fast", "reference", "sdpa"] for r in rounds)
    assert all(len(t) == 5 for t in res["times"].values())
