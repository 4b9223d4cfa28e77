"""Figure 4 and Table 4 redrawn from their JSON (no checkpoints): rows name seeds, every label's
heatmap shares one colour scale, Table 4 lists every seed's value."""

import json

import numpy as np
import pytest

from ascender_dist.research import figures


def _summary(tmp_path):
    rng = np.random.default_rng(0)
    dirs = {"ascender": ["runs/a-seed3", "runs/a-seed7"], "no_align": ["runs/n-seed3", "runs/n-seed7"]}
    scale = {"ascender": 1.0, "no_align": 3.0}  # different ranges: a per-figure scale would hide it
    fig4 = {label: {"layers": [1, 2], "n_seeds": 2, "dirs": ds,
                    "omega_per_run": (scale[label] * rng.random((2, 2, 4, 3))).tolist(),
                    "mass_moved_per_run": rng.random((2, 2, 4, 3)).tolist()} for label, ds in dirs.items()}
    models = [{"dir": d, "seed": int(d[-1]), "label": label} for label, ds in dirs.items() for d in ds]
    rows = [{"config": m["label"], "seed": m["dir"], **{k: float(i) for k in figures.METRICS},
             **{f"argmax_{k}": float(-i) for k in figures.METRICS}} for i, m in enumerate(models)]
    table4 = {"metrics": list(figures.METRICS), "rows": rows, "settings": {"cluster_examples": 2}}
    (tmp_path / "figures.json").write_text(json.dumps({"figure1": [], "figure4": fig4, "table4": None,
                                                       "models": models}))
    (tmp_path / "table4_clusters.json").write_text(json.dumps(table4))
    return fig4


def test_redraw_labels_rows_by_seed_and_shares_one_scale(tmp_path, monkeypatch):
    fig4 = _summary(tmp_path)
    calls = []
    monkeypatch.setattr(figures, "plot_head_heatmaps",
                        lambda values, stds, rows, path, title, panels, value_range=None:
                        calls.append((path.name, rows, value_range)))
    figures.redraw(tmp_path)
    omega = {name: (rows, vr) for name, rows, vr in calls if name.endswith("_omega.png")}
    assert set(omega) == {"fig4_ascender_omega.png", "fig4_no_align_omega.png"}
    rows, shared = omega["fig4_ascender_omega.png"]
    assert rows == ["seed 3, layer 1", "seed 3, layer 2", "seed 7, layer 1", "seed 7, layer 2"]
    every = np.concatenate([np.ravel(e["omega_per_run"]) for e in fig4.values()])
    assert shared == (every.min(), every.max()) and omega["fig4_no_align_omega.png"][1] == shared
    assert shared[1] > 1.0  # the scale reaches no_align's larger values in ascender's figure too


def test_redraw_writes_pngs_and_table4_with_every_seed(tmp_path):
    _summary(tmp_path)
    figures.redraw(tmp_path)
    for label in ("ascender", "no_align"):
        assert (tmp_path / f"fig4_{label}_omega.png").stat().st_size > 0
        assert (tmp_path / f"fig4_{label}_mass_moved.png").stat().st_size > 0
    md = (tmp_path / "table4_clusters.md").read_text()
    assert md.count("Per seed:") == 2
    assert "| ascender | 3 | 0 | 0 | 0 | 0 |" in md and "| no_align | 7 | 3 | 3 | 3 | 3 |" in md
    summary = json.loads((tmp_path / "figures.json").read_text())
    assert summary["figure4"]["ascender"]["omega_png"].endswith("fig4_ascender_omega.png")


def test_redraw_of_a_folder_without_figures_json_is_one_line(tmp_path, capsys):
    assert figures.figures_main(["--out", str(tmp_path), "--redraw"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    (tmp_path / "figures.json").write_text("{}")
    assert figures.figures_main(["--out", str(tmp_path), "--redraw"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "figures.json: not written by `ascender-dist figures` (no figure4, models)" in err


def test_redraw_keeps_the_provenance_of_the_computation(tmp_path):
    """Redrawing recomputes nothing: the commit that computed the numbers stays, the redraw's is added."""
    _summary(tmp_path)
    summary = json.loads((tmp_path / "figures.json").read_text())
    summary["provenance"] = {"git_commit": "c0ffee" * 6}
    (tmp_path / "figures.json").write_text(json.dumps(summary))
    figures.redraw(tmp_path)
    after = json.loads((tmp_path / "figures.json").read_text())
    assert after["provenance"] == {"git_commit": "c0ffee" * 6}
    assert "machine" in after["redraw_provenance"]


@pytest.mark.parametrize("extra,expected", [
    (["--max-tokens", "0"], "error: --max-tokens: must be >= 1 (got 0)"),
    (["--examples", "-1"], "error: --examples: must be >= 1 (got -1)"),
    (["--cluster-tokens", "0"], "error: --cluster-tokens: must be >= 1 (got 0)"),
    (["--text", ""], "error: --text: is empty: no tokens to draw"),
    (["--heads", "abc"], "error: --heads: expected comma-separated integers, got 'abc'"),
    (["--layers", "1,x"], "error: --layers: expected comma-separated integers, got '1,x'"),
], ids=["max-tokens-0", "examples-neg", "cluster-tokens-0", "empty-text", "heads-abc", "layers-x"])
def test_bad_figures_arguments_are_one_line_before_any_model_is_loaded(tmp_path, capsys, monkeypatch, extra, expected):
    """--max-tokens 0 / --text '' gave a torch dtype traceback from inside the model, --heads abc a
    ValueError from int(): each is now one line naming the flag, before anything is read."""
    monkeypatch.setattr(figures, "make_figures", lambda *a, **k: pytest.fail("reached make_figures"))
    assert figures.figures_main([str(tmp_path / "cons"), "--out", str(tmp_path / "out"), *extra]) == 2
    assert capsys.readouterr().err == expected + "\n"


def test_one_directory_given_twice_is_refused(tmp_path, capsys, monkeypatch):
    """The same directory twice failed after all the work ('duplicate run for config ... seed ...')."""
    monkeypatch.setattr(figures, "make_figures", lambda *a, **k: pytest.fail("reached make_figures"))
    cons = tmp_path / "cons"
    for argv in ([str(cons), str(cons)], ["--model", f"x={cons}", "--model", f"x={cons}"]):
        assert figures.figures_main([*argv, "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"error: {cons}: given twice (one model per directory)\n"


def test_a_layer_or_head_the_model_does_not_have_is_named():
    """--layers 5 on a 2-layer model drew no Figure 1 and exited 0 ('wrote 0 Figure 1 PNGs')."""
    from ascender_dist.config.errors import ConfigError

    figures._check_chosen([1, 2], [1, 2], "--layers", "d's ASCender layers")  # all there
    figures._check_chosen(None, [1, 2], "--layers", "d's ASCender layers")  # not given: all
    with pytest.raises(ConfigError) as info:
        figures._check_chosen([1, 5], [1, 2], "--layers", "d's ASCender layers")
    assert str(info.value) == "--layers: 5 is not one of d's ASCender layers: 1, 2"


def test_examples_come_from_a_mixture_runs_validation_split_within_its_positions(tmp_path):
    """The figures read data.manifest only (a mixture run had no validation examples), and a
    --max-tokens above model.seq_length gave a window of seq_length + 1 ids (past learned positions)."""
    import types

    from .data_fixtures import SEQ, make_dataset

    make_dataset(tmp_path / "a", [4], val_counts=[4])
    make_dataset(tmp_path / "b", [4], val_counts=[4], first_id=1000)
    mixture = [types.SimpleNamespace(manifest=str(tmp_path / name), weight=1.0, url_template=None) for name in "ab"]
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(manifest=None, mixture=mixture, url_template=None),
                                model=types.SimpleNamespace(seq_length=SEQ), train=types.SimpleNamespace(seed=1))
    out = figures.examples(cfg, 3, 200)
    assert len(out) == 3 and all(len(ids) == SEQ for ids in out)
