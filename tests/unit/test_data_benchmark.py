"""benchmarks/data.py without running the pipeline: the sharding rounds alternate 1 and 2 workers and report
medians, minima and the same-round speedup; the report renders older data.json records and the new fields;
data.png is drawn; versions and config hashes are recorded (stand-in subprocesses, made-up numbers)."""

import argparse
import json
from pathlib import Path

import pytest

import benchmarks.data as bench


def test_sharding_alternates_the_two_settings_each_round_and_reports_minima(tmp_path, monkeypatch):
    order, seconds = [], {1: iter([4.0, 5.0, 4.0, 8.0, 4.0]), 2: iter([2.0, 2.0, 4.0, 4.0, 1.0])}
    def fake_run(cmd, **kw):  # `data-pipeline shard`: writes a manifest, "takes" the scripted seconds
        workers = int(cmd[cmd.index("--workers") + 1])
        dest = tmp_path / cmd[cmd.index("--out-dir") + 1]
        dest.mkdir(parents=True)
        (dest / "manifest.json").write_text("same shards")
        order.append(workers)
        return workers

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "timed", lambda fn, *a, **kw: (lambda w: (w, next(seconds[w])))(fn(*a, **kw)))
    out = bench.bench_sharding(tmp_path / "corpus.jsonl", tmp_path / "tok.model", tmp_path,
                               argparse.Namespace(repeats=5, samples_per_shard=128))
    assert order == [1, 2, 2, 1, 1, 2, 2, 1, 1, 2]  # rotated each round, not all 1-worker runs first
    assert out["shard_runs"] == {"w1": [4.0, 5.0, 4.0, 8.0, 4.0], "w2": [2.0, 2.0, 4.0, 4.0, 1.0]}
    assert (out["shard_s_w1"], out["shard_s_w1_min"], out["shard_s_w2"], out["shard_s_w2_min"]) == (4.0, 4.0, 2.0, 1.0)
    # same-round speedups 2, 2.5, 1, 2, 4: median 2, minimum 1
    assert out["shard_speedup_w2"] == {"median": 2.0, "min": 1.0}
    assert out["shard_outputs_identical"] is True


def test_fewer_than_five_repeats_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "3"])


def _committed():
    return json.loads((bench.RESULTS / "data.json").read_text())


OLDER_JSON = Path(__file__).parent / "fixtures" / "data_benchmark_before_minima.json"  # data.json as committed
# before sharding alternated its settings and kept minima (0fa7b63)


def test_an_older_data_json_still_renders():
    md = bench.render(json.loads(OLDER_JSON.read_text()))
    assert "the ratio of the medians of back-to-back runs" in md and "an older run: no minimum kept" in md
    assert "data.png" not in md  # no figure named unless one was drawn


def test_the_new_fields_render_minima_speedup_versions_and_the_figure():
    r = _committed()
    r["machine"]["versions"] = {"sentencepiece": "0.2.0", "webdataset": "1.0.2", "numpy": None}
    r.update(shard_mb_per_s_w1_best=2.5, shard_mb_per_s_w2_best=4.75, shard_runs={"w1": [1] * 5, "w2": [1] * 5},
             shard_speedup_w2={"median": 1.8, "min": 1.25}, config_sha256={"configs/scaling/gpt-small.yaml": "ab"})
    for key in ("10", "90", "10_small_buffer", "90_small_buffer"):
        r[f"resume_s_{key}_min"], r[f"resume_s_{key}_runs"] = 0.012, [0.012] * 5
    md = bench.render(r, has_plot=True)
    assert ", sentencepiece 0.2.0, webdataset 1.0.2, numpy not installed," in md
    assert "MB/s of text: median (fastest run)" in md and "(2.50) |" in md and "(4.75) |" in md
    assert "same-round speedup 1.80x median, 1.25x minimum (efficiency 90%" in md
    assert "(min 12)" in md and "the median of 5 runs, the fastest in brackets" in md
    assert "![loader tokens/s per rank against the GPU's need](data.png)" in md
    assert "sha256 of the 1 `configs/scaling/*.yaml` configs read" in md


def test_the_figure_is_drawn_from_the_loader_section(tmp_path):
    pytest.importorskip("matplotlib")
    assert bench.plot(_committed(), tmp_path / "data.png")
    assert (tmp_path / "data.png").read_bytes().startswith(b"\x89PNG")
    assert bench.plot({"presets": {}}, tmp_path / "none.png") is False and not (tmp_path / "none.png").exists()


def test_render_mode_rewrites_md_and_png_from_the_json_only(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    (tmp_path / "data.json").write_text(json.dumps(_committed()))
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    before = (tmp_path / "data.json").read_text()
    assert bench.main(["--render"]) == 0
    assert (tmp_path / "data.json").read_text() == before
    assert "](data.png)" in (tmp_path / "data.md").read_text() and (tmp_path / "data.png").exists()


def test_versions_and_config_hashes_are_recorded():
    assert set(bench.machine()["versions"]) == {"sentencepiece", "webdataset", "numpy"}
    need = bench.preset_needs("small")
    hashes = need["config_sha256"]
    assert set(hashes) == {f"configs/scaling/{a}-small.yaml" for a in ("gpt", "ascender", "connection")}
    assert all(len(h) == 64 for h in hashes.values()) and len(set(hashes.values())) == 3


def test_a_reused_work_dir_times_corpus_and_tokenizer_again(tmp_path):
    """--work-dir keeps intermediate files, but build-corpus and train-tokenizer refuse to replace
    theirs: a second run into the same directory failed; the previous outputs are removed first."""
    import benchmarks.data as bench

    prefix = tmp_path / "tok"
    files = [tmp_path / "corpus.jsonl", *bench.tokenizer_files(prefix)]
    assert [f.name for f in files] == ["corpus.jsonl", "tok.model", "tok.vocab", "tok.json"]
    for f in files:
        f.write_text("old")
    (tmp_path / "keep.txt").write_text("kept")
    bench.remove_previous(*files, tmp_path / "never-there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
