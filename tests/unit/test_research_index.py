"""`ascender-dist tables --index`: the generated index of a folder of ablation reports (state of the
code since each report's commit, grids not run, every comparison and its reading)."""

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ascender_dist.research.ablate import index
from ascender_dist.research.ablate.grid import AblationError
from ascender_dist.research.ablate.main import tables_main

ROOT = Path(__file__).resolve().parents[2]
BIAS = ROOT / "benchmarks" / "results" / "research" / "bias" / "results.json"
CONNECTION = ROOT / "benchmarks" / "results" / "research" / "connection" / "results.json"


def _git(repo: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    f = repo / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    _git(repo, "add", path)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"change {path}")
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture()
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    return repo


def test_docs_only_commits_keep_a_report_current(repo):
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    _commit(repo, "docs/notes.md", "text\n")
    assert index.code_state([run], {}, repo) == ("current", "no model/trainer/data code changed since")


def test_a_later_trainer_commit_makes_it_stale_and_is_named(repo):
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    later = _commit(repo, "ascender_dist/training/trainer.py", "b = 2\n")
    state, why = index.code_state([run], {}, repo)
    assert state == "stale" and later[:7] in why


def test_commits_are_named_at_a_fixed_length_whatever_git_abbreviates_to(repo, monkeypatch):
    """git's %h grows with the object count, so a clone with more objects wrote another index."""
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.abbrev")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "12")
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    later = _commit(repo, "ascender_dist/training/trainer.py", "b = 2\n")
    assert index.later_model_commits(run, repo) == [(later, "change ascender_dist/training/trainer.py")]
    state, why = index.code_state([run], {}, repo)
    assert state == "stale" and f"in {later[:index.SHORT_SHA]}:" in why


def test_a_reviewed_commit_is_named_not_counted(repo):
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    later = _commit(repo, "data_pipeline/shard.py", "c = 3\n")
    state, why = index.code_state([run], {later[:7]: "metadata only"}, repo)
    assert state == "current" and later[:7] in why and index.NEUTRAL_FILE in why
    _commit(repo, "ascender_dist/config/schema.py", "d = 4\n")  # a second, unreviewed one
    assert index.code_state([run], {later[:7]: "metadata only"}, repo)[0] == "stale"


def test_runs_from_a_commit_outside_heads_history_are_stale(repo):
    """A side branch's model code never reached HEAD: no later commit touches it, yet it differs."""
    base = _commit(repo, "README.md", "x\n")
    side = _commit(repo, "ascender_dist/models/m.py", "a = 2\n")
    _git(repo, "checkout", "-q", base)
    _git(repo, "checkout", "-q", "-b", "main2")
    _commit(repo, "docs/notes.md", "text\n")
    state, why = index.code_state([side], {}, repo)
    assert state == "stale" and "not in HEAD's history" in why


@pytest.mark.parametrize("path", ["ascender_dist/research/ablate/launch.py", "ascender_dist/research/ablate/grid.py",
                                  "ascender_dist/launch_entry.py", "ascender_dist/research/ablate/main.py"])
def test_the_run_driver_counts_as_code_a_run_computes_with(repo, path):
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    later = _commit(repo, path, "tail = 3\n")
    state, why = index.code_state([run], {}, repo)
    assert state == "stale" and later[:7] in why


def test_an_edited_grid_yaml_makes_its_report_stale_a_new_grid_does_not(repo, tmp_path):
    """main.py's _child_main is the run's entry point and a grid YAML says what its runs compute: an edit
    to either makes the report stale; adding another grid changes no earlier run."""
    _commit(repo, "configs/ablations/bias.yaml", "seeds: [1, 2]\n")
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    folder = tmp_path / "research"
    _report(folder, "bias", run)
    assert "| current: no model/trainer/data code changed since |" in index.index_markdown(folder, tmp_path, repo)
    _commit(repo, "configs/ablations/connection.yaml", "seeds: [1]\n")  # a new grid: no earlier run changes
    assert index.code_state([run], {}, repo)[0] == "current"
    edit = _commit(repo, "configs/ablations/bias.yaml", "seeds: [1, 2]\nset: {train.lr: 0.1}\n")
    text = index.index_markdown(folder, tmp_path, repo)
    assert f"**stale**: model/trainer/data code changed since, in {edit[:7]}: re-run" in text
    assert "`ascender_dist/research/ablate/main.py`" in text and "`configs/ablations`" in text


def test_a_commit_reviewed_for_some_layers_leaves_only_runs_without_them_current(repo, tmp_path):
    """``{reason, layers: S}``: the commit changes ASCender (S) layers only: a report of GPT / Connection
    runs stays current, one with an S layer (or whose layers were not recorded) goes stale."""
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    later = _commit(repo, "ascender_dist/models/ascender/fast.py", "b = 2\n")
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / index.NEUTRAL_FILE).write_text(f'"{later[:7]}":\n  reason: ASCender only\n  layers: S\n')
    neutral = index.read_neutral(folder)
    state, why = index.code_state([run], neutral, repo, layers_run={"A", "C"})
    assert state == "current" and later[:7] in why
    assert index.code_state([run], neutral, repo, layers_run={"A", "S"})[0] == "stale"
    assert index.code_state([run], neutral, repo, layers_run=None)[0] == "stale"
    (folder / index.NEUTRAL_FILE).write_text(f'"{later[:7]}":\n  reason: ASCender only\n')
    with pytest.raises(AblationError, match="layers: LETTERS"):
        index.read_neutral(folder)


def test_runs_without_a_commit_or_with_an_unknown_one(repo):
    _commit(repo, "README.md", "x\n")
    assert index.code_state([None], {}, repo)[0] == "stale"
    assert index.code_state(["0" * 40], {}, repo)[0] == "unknown"


def _report(folder: Path, name: str, commit) -> dict:
    full = json.loads(BIAS.read_text())
    for r in full["records"]:
        r.setdefault("provenance", {})["git_commit"] = commit
    (folder / name).mkdir(parents=True)
    (folder / name / "results.json").write_text(json.dumps(full))
    return full


def test_reversed_comparisons_appear_once_and_ties_are_counted():
    full = json.loads(BIAS.read_text())
    rows = index.comparison_rows(full)
    pairs = [(r["config"], r["reference"]) for r in rows]
    assert ("ascender", "gpt") in pairs and ("gpt", "ascender") not in pairs
    assert len(pairs) == len(set(pairs)) == 4 + 3  # 4 vs gpt, then 3 vs ascender (gpt − ascender dropped)
    tied = copy.deepcopy(full)
    c = tied["tables"]["main"]["configs"][1]
    c["per_seed_difference"] = {k: 0.0 for k in c["per_seed_difference"]}
    row = index.comparison_rows(tied)[0]
    assert (row["lower"], row["equal"]) == (0, 5) and "equal in 5 of 5" in index._seed_count(row)


def test_the_index_adjusts_p_over_the_distinct_comparisons_of_a_report():
    """The connection report shows 13 distinct comparisons; each table was Holm-adjusted over its own 7
    (steps6 − connection 0.041): the index adjusts over the 13 it shows, per test, and says so."""
    from ascender_dist.research.stats import holm

    full = json.loads(CONNECTION.read_text())
    tables = [full["tables"]["main"], *full["tables"]["vs"].values()]
    raw = {(e["config"], t["baseline"]): e["comparison"]["p_value"] for t in tables for e in t["configs"]
           if e["comparison"]}
    rows = index.comparison_rows(full)
    assert len(rows) == 13
    assert [r["p_holm"] for r in rows] == pytest.approx(holm([raw[r["config"], r["reference"]] for r in rows]))
    assert [r["doc"]["p_holm"] for r in rows] == pytest.approx(holm([r["doc"]["p_value"] for r in rows]))
    steps6 = next(r for r in rows if (r["config"], r["reference"]) == ("steps6", "connection"))
    assert round(steps6["p_holm"], 3) == 0.076
    text = "\n".join(index.section("connection", full))
    assert "| Δ over seeds [95% paired t] | p Holm (13) | seeds |" in text
    assert "| Δ per sequence, these trained models [" in text and "documents resampled] | p Holm (13), these models |" in text
    assert "| steps6 − connection | +0.0123 [+0.0059, +0.0186] | 0.076 |" in text
    assert "over the report's 13 distinct comparisons" in text


def _report_of(rows: list) -> dict:
    """A results.json object of one over-seed table from ``rows`` (config, seed, val_loss)."""
    from ascender_dist.research.tables import results_table

    _, table = results_table(rows, rows[0]["config"], "val_loss", n_resamples=100, n_permutations=100)
    return {"tables": {"metric": "val_loss", "main": json.loads(json.dumps(table)), "vs": {}}}


def test_equal_differences_over_seeds_are_undefined_not_significant():
    """Two seeds with d = [0.25, 0.25] printed "0.25 [0.25, 0.25], p 0, Holm 0" and the reading called
    it excluding 0."""
    rows = [{"config": c, "seed": s, "val_loss": v + (0.25 if c == "b" else 0.0)}
            for c in ("a", "b") for s, v in ((1, 3.0), (2, 3.5))]
    full = _report_of(rows)
    [row] = index.comparison_rows(full)
    table = "\n".join(index.comparison_table([row], "val_loss", 0, 0))
    assert "| b − a | +0.2500 [undefined] | undefined (sd = 0) | lower in 0 of 2 seeds | — | — |" in table
    from ascender_dist.research.tables import UNDEFINED_P

    assert index.UNDEFINED_P == UNDEFINED_P  # the index prints what the report's table prints
    text = index.reading([row])
    assert "excludes 0" in text and "b higher" not in text and "keep Holm" not in text
    assert "every seed (sd = 0), so no interval or test (p undefined), not counted as significant: b − a" in text


def test_the_index_counts_diverged_runs_per_variant():
    rows = [{"config": c, "seed": s, "val_loss": 3.0 + 0.1 * s + (0.05 if c == "b" else 0.0) + 0.01 * (c == "b") * s}
            for c in ("a", "b") for s in (1, 2, 3)]
    rows[4]["val_loss"] = float("nan")  # b seed 2
    full = _report_of(rows)
    assert index.diverged_line(full) == ("Diverged runs (val_loss not finite; left out of every statistic above, and "
                                         "training is deterministic, so a re-run diverges again): b 1 of 3 (seed(s) 2).")
    assert index.comparison_rows(full)[0]["seeds"] == 2
    assert index.diverged_line(json.loads(BIAS.read_text())) == ""


def test_reading_names_only_intervals_that_exclude_zero():
    rows = [{"config": "a", "reference": "r", "diff": 0.01, "low": 0.002, "high": 0.02, "p_holm": 0.03,
             "lower": 0, "equal": 0, "seeds": 5},
            {"config": "b", "reference": "r", "diff": -0.01, "low": -0.02, "high": 0.001, "p_holm": 0.5,
             "lower": 4, "equal": 0, "seeds": 5}]
    text = index.reading(rows)
    assert "a higher than r" in text and "b " not in text and "1 keep Holm p < 0.05 over the report's 2" in text
    assert "no paired t interval" in index.reading(rows[1:])


def test_index_lists_every_report_and_each_grid_not_run(tmp_path, capsys):
    folder = tmp_path / "research"
    full = _report(folder, "bias", None)
    grids = tmp_path / "grids"
    grids.mkdir()
    shutil.copy(ROOT / "configs" / "ablations" / "bias.yaml", grids / "bias.yaml")
    shutil.copy(ROOT / "configs" / "ablations" / "omega-sharing.yaml", grids / "omega-sharing.yaml")
    assert tables_main([str(folder), "--index", "--grids", str(grids)]) == 0
    text = (folder / "results.md").read_text()
    assert "| [`bias/`](bias/results.md) |" in text and "**stale**: no git commit recorded" in text
    assert f"`{grids / 'omega-sharing.yaml'}` | 10 planned |" in text  # outside the repository: as given
    assert f"{len(full['records'])} runs" in text and "Reading:" in text


def test_index_of_a_folder_without_reports_is_a_one_line_error(tmp_path, capsys):
    assert tables_main([str(tmp_path), "--index", "--grids", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no */results.json" in err and "\n" not in err


def test_a_neutral_file_without_reasons_is_rejected(tmp_path):
    (tmp_path / index.NEUTRAL_FILE).write_text('"abc1234":\n')
    with pytest.raises(AblationError, match="non-empty reason"):
        index.read_neutral(tmp_path)


@pytest.mark.parametrize("key", ["c", "abc12", "ABC1234", "xyz1234", "a" * 41])
def test_a_neutral_key_names_one_commit_by_7_to_40_hex_digits(tmp_path, key):
    """A one-character key marked every later commit starting with it as reviewed (found by a review)."""
    (tmp_path / index.NEUTRAL_FILE).write_text(f'"{key}": metadata only\n')
    with pytest.raises(AblationError, match="7 to 40 lowercase hex digits"):
        index.read_neutral(tmp_path)


def test_a_full_sha_key_of_another_commit_sharing_7_digits_does_not_match(repo):
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    later = _commit(repo, "ascender_dist/training/trainer.py", "b = 2\n")
    other = later[:7] + ("0" if later[7] != "0" else "1") + later[8:]  # same 7 digits, another commit
    state, _ = index.code_state([run], {other: "reviewed"}, repo)
    assert state == "stale"
    assert index.code_state([run], {later: "reviewed"}, repo)[0] == "current"


def test_a_commit_yaml_reads_as_a_number_must_be_quoted(tmp_path):
    (tmp_path / index.NEUTRAL_FILE).write_text("0123456: metadata only\n")  # YAML 1.1: octal
    with pytest.raises(AblationError, match="must be quoted"):
        index.read_neutral(tmp_path)
    (tmp_path / index.NEUTRAL_FILE).write_text('"0123456": metadata only\n')
    assert index.read_neutral(tmp_path) == {"0123456": "metadata only"}


def test_committed_index_is_what_the_reports_and_the_code_say_now():
    """benchmarks/results/research/results.md must be regenerated when a report is added or when a later
    commit changes model, trainer or data code (which makes reports stale): `ascender-dist tables --index
    benchmarks/results/research`."""
    folder = ROOT / "benchmarks" / "results" / "research"
    generated = index.index_markdown(folder, ROOT / "configs" / "ablations", ROOT)
    assert (folder / index.INDEX_FILE).read_text() == generated


def test_a_report_with_runs_from_a_dirty_checkout_is_not_called_current(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    folder = tmp_path / "research"
    full = _report(folder, "bias", head)
    assert "| current: no model/trainer/data code changed since |" in index.index_markdown(folder, tmp_path, ROOT)
    full["records"][0]["provenance"]["git_dirty"] = True
    (folder / "bias" / "results.json").write_text(json.dumps(full))
    assert "**unknown**: 1 run(s) made from a checkout with uncommitted changes" in index.index_markdown(
        folder, tmp_path, ROOT)


def test_figures_and_the_efficiency_table_have_a_state_and_timings_take_no_review(repo, tmp_path):
    """The outputs that are not ablate reports (figures/, efficiency/) are listed with their state; a
    reviewed commit keeps the figures current but not the timing table (reviews compare every field
    but the timings)."""
    run = _commit(repo, "ascender_dist/models/layer.py", "a = 1\n")
    folder = tmp_path / "research"
    _report(folder, "bias", run)
    for rel in ("figures/figures.json", "efficiency/table2.json"):
        (folder / rel).parent.mkdir(parents=True)
        (folder / rel).write_text(json.dumps({"provenance": {"git_commit": run}}))
    text = index.index_markdown(folder, tmp_path, repo)
    assert f"| [`figures/figures.json`](figures/figures.json) | Figures 1 and 4, Table 4 | {run[:7]} | current: " in text
    later = _commit(repo, "ascender_dist/models/ascender/fast.py", "b = 2\n")
    (folder / index.NEUTRAL_FILE).write_text(f'"{later[:7]}": same numbers, faster\n')
    text = index.index_markdown(folder, tmp_path, repo)
    figures, table2 = (next(line for line in text.splitlines() if f"`{rel}`" in line)
                       for rel in ("figures/figures.json", "efficiency/table2.json"))
    assert "| current: " in figures and later[:7] in figures
    assert f"| **stale**: model/trainer/data code changed since, in {later[:7]}: re-run |" in table2
