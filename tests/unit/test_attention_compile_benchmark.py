"""benchmarks/attention_compile.py and attention_chunks.py without timing anything: the tile chain's same-round
ratios to the in-place passes, the git state taken before measuring, the recorded CPU count in the text."""

import json

import pytest

import benchmarks.attention_chunks as chunks
import benchmarks.attention_compile as compile_bench


def test_tile_chain_reports_median_and_minimum_of_the_same_round_ratio_to_in_place():
    rounds = [{compile_bench.IN_PLACE: a, "pure, compiled": b} for a, b in
              ((1.0, 2.0), (2.0, 3.0), (1.0, 1.5), (4.0, 4.0), (1.0, 3.0))]
    rows = {r["variant"]: r for r in compile_bench.chain_rows({"rounds": rounds})}
    # same-round ratios 2, 1.5, 1.5, 1, 3: median 1.5, minimum 1 (the ratio of the medians would be 3 / 1 = 3)
    assert rows["pure, compiled"]["x_in_place"] == {"median": 1.5, "min": 1.0}
    assert rows["pure, compiled"]["median_s"] == 3.0
    assert rows[compile_bench.IN_PLACE]["x_in_place"] == {"median": 1.0, "min": 1.0}


def _layer_rounds():
    return [dict(sdpa_s=1.0, fast_s={"eager": 4.0, "compiled row algebra": 3.0})] * 5


def test_the_tile_chain_table_and_rewrite(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_bench, "RESULTS", tmp_path)
    chain = {"rounds": [{compile_bench.IN_PLACE: 2e-3, "pure, eager": 5e-3, "pure, compiled": 3e-3}] * 5,
             "compile_s": 1.0, "shape": [8, 64, 2048], "max_rel_diff": 1e-7}
    result = dict(n=2048, layer=dict(rounds=_layer_rounds(), compile_s=1.0, graphs=3), chain=chain,
                  load_start=0.5, load_end=0.5, threads=1, machine="Some CPU",
                  machine_record={"logical_cpus": 4}, git_commit="a" * 40, git_dirty=False)
    (tmp_path / "attention_compile.json").write_text(json.dumps(result))
    compile_bench.main(["--rewrite"])
    md = (tmp_path / "attention_compile.md").read_text()
    assert "| variant | ms | x in place median | x in place min |" in md
    assert "| pure, compiled | 3.00 | 1.50 | 1.50 |" in md and "4 logical CPUs, shared" in md
    assert (tmp_path / "attention_compile.png").stat().st_size > 0  # the figure beside the table


def test_compile_takes_git_state_before_measuring(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(compile_bench, "RESULTS", tmp_path)
    monkeypatch.setattr(compile_bench, "git_state", lambda: events.append("git") or {"git_commit": "a", "git_dirty": None})
    monkeypatch.setattr(compile_bench, "measure_layer", lambda n, rounds: events.append("layer") or {})
    monkeypatch.setattr(compile_bench, "measure_chain", lambda n, rounds, calls: events.append("chain") or {})
    monkeypatch.setattr(compile_bench, "machine", lambda: "Some CPU")
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # the test process keeps its threads
    monkeypatch.setattr(compile_bench, "write_results", lambda result: events.append(result["git_commit"]))
    (tmp_path / "attention_compile.md").write_text("")
    compile_bench.main(["--rounds", "5"])
    assert events == ["git", "layer", "chain", "a"]


def test_compile_refuses_fewer_than_five_rounds():
    with pytest.raises(SystemExit):
        compile_bench.main(["--rounds", "4"])


def test_chunks_take_git_state_before_measuring_and_record_the_cpu_count(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(chunks, "git_state", lambda: events.append("git") or {"git_commit": "b" * 40, "git_dirty": True})
    monkeypatch.setattr(chunks, "_layer", lambda *a, **kw: (lambda: None))
    monkeypatch.setattr(chunks, "cpu_time", lambda fn: events.append("time") or 1.0)
    monkeypatch.setattr(chunks, "machine", lambda: "Some CPU")
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # the test process keeps its threads
    result = chunks.measure(64, 5)
    assert events[0] == "git" and events.count("git") == 1
    monkeypatch.setattr(chunks, "RESULTS", tmp_path)
    result["machine_record"] = {"logical_cpus": 16}
    chunks.write_results(result)
    md = (tmp_path / "attention_chunks.md").read_text()
    assert "16 logical CPUs, shared" in md and "2 shared cores" not in md and "(dirty)" in md
    assert (tmp_path / "attention_chunks.png").stat().st_size > 0
