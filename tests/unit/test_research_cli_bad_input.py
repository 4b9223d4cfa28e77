"""Bad input to the research commands (ablate grids, efficiency, coverage) that must stop in one line
naming the file or flag, found by a review: a chain of grid bases taken for a loop, grid names and
folders of the wrong type, an unchecked --n-resamples, saved JSON that is unreadable or foreign."""

from __future__ import annotations

import json

import pytest

from ascender_dist.config.errors import ConfigError
from ascender_dist.research.ablate import load_grid
from ascender_dist.research.ablate.main import ablate_main
from ascender_dist.research.coverage import main as coverage_main
from ascender_dist.research.efficiency import efficiency_main

from tests.unit.test_research_ablate_review import _grid

# every top-level key the three readers ask for, each holding a list where they expect a mapping (or records)
SHAPE_KEYS = ("records", "tables", "rows", "ablation", "settings", "settings_sha256", "pairs", "effect_size_bias")


def test_a_long_chain_of_grid_bases_is_not_a_loop_and_a_real_loop_is(tmp_path):
    """A depth count called any chain of more than five grid files a loop."""
    previous = _grid(tmp_path, variants={"a": {}})  # tmp_path/grid.yaml, an inline base
    for i in range(8):
        path = tmp_path / f"chain{i}.yaml"
        path.write_text(f"name: c{i}\nbase: {previous.name}\nseeds: [1]\nvariants:\n  a: {{}}\n")
        previous = path
    assert load_grid(previous).name == "c7"
    (tmp_path / "x.yaml").write_text("name: x\nbase: y.yaml\nseeds: [1]\nvariants:\n  a: {}\n")
    (tmp_path / "y.yaml").write_text("name: y\nbase: x.yaml\nseeds: [1]\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match="grid files refer to each other in a loop"):
        load_grid(tmp_path / "x.yaml")


@pytest.mark.parametrize("key,value", [("name", True), ("name", [1, 2]), ("name", ""), ("runs_dir", False),
                                       ("report_dir", 0), ("runs_dir", "")])
def test_grid_names_and_folders_of_the_wrong_type_are_refused(tmp_path, key, value):
    """name: true ran into runs/ablations/True; runs_dir: false fell back to the default unnoticed."""
    with pytest.raises(ConfigError) as info:
        load_grid(_grid(tmp_path, variants={"a": {}}, **{key: value}))
    assert f": {key}: expected a " in str(info.value) and "\n" not in str(info.value)


def test_ablate_refuses_n_resamples_below_one_before_training(tmp_path, capsys):
    """Read only by the report, after every run had trained (then a traceback)."""
    grid = _grid(tmp_path, variants={"a": {}})
    assert ablate_main([str(grid), "--n-resamples", "0", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "error: --n-resamples must be >= 1 (got 0)"


@pytest.mark.parametrize("content,needle", [("{bad", "cannot read it"), ("[1]", "a JSON list, not an object"),
                                            ("{}", "not written by"),
                                            (json.dumps({k: [1] for k in SHAPE_KEYS}), "not written by")])
def test_saved_json_that_is_unreadable_or_foreign_is_one_line(tmp_path, capsys, content, needle):
    """efficiency --from-ablation / --rewrite and coverage --rewrite raised JSONDecodeError, KeyError or
    TypeError from the drawing code."""
    for name in ("table2.json", "coverage.json", "results.json"):
        (tmp_path / name).write_text(content)
    runs = [(efficiency_main, ["--out", str(tmp_path), "--rewrite"], "table2.json"),
            (coverage_main, ["--out", str(tmp_path), "--rewrite"], "coverage.json"),
            (efficiency_main, ["--out", str(tmp_path / "e"), "--rows", "gpt", "--from-ablation",
                               str(tmp_path / "results.json")], "results.json")]
    for main, argv, name in runs:
        assert main(argv) == 2, (argv, content)
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {tmp_path / name}: ") and needle in err and "\n" not in err, err
