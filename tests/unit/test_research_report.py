"""The ablation report: provenance and the mixed-commit rule, per-sequence losses committed beside
results.json, ``ascender-dist tables`` rebuilding the report from them, and the research extra."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from ascender_dist.research import ablate
from ascender_dist.research.ablate import provenance, report
from tests.helpers.multiproc import REPO_ROOT


def _records(commits=("a" * 40,)):
    """gpt/asc x 3 seeds, 12 sequences in 4 documents of 3 windows; asc 0.1 lower everywhere."""
    rng = np.random.default_rng(0)
    out = []
    for i, (cfg, shift) in enumerate((("gpt", 0.0), ("asc", -0.1))):
        for s in (1, 2, 3):
            ex = rng.normal(5.0, 0.3, 12) + shift
            commit = commits[(i * 3 + s) % len(commits)]
            out.append({"config": cfg, "seed": s, "val_loss": float(ex.mean()), "val_example_losses": ex.tolist(),
                        "val_example_index": list(range(12)), "val_example_documents": [0, 0, 0, 1, 1, 1, 2, 2, 2,
                                                                                        3, 3, 3],
                        "val_curve": [[1, 6.0], [2, float(ex.mean())]], "final_train_loss": 5.5,
                        "train_losses": [7.0, 6.0], "params": 10, "flops_per_token": 60.0, "training_flops": 6e4,
                        "tokens_per_s": 100.0, "median_step_time_s": 0.1, "peak_rss_mib": 5.0,
                        "data_sha256": f"seed{s}", "steps": 2, "tokens": 100, "val_sequences": 12,
                        "provenance": {"git_commit": commit, "git_dirty": False, "config_sha256": cfg * 32}})
    return out


def _grid(tmp_path):
    return ablate.Grid(name="syn", path="syn.yaml", base={}, seeds=[1, 2, 3], baseline="gpt",
                       variants=[ablate.Variant(n, {}) for n in ("gpt", "asc")], report_dir=tmp_path / "report")


def test_one_commit_no_flag_two_commits_or_none_flagged_in_the_first_line():
    assert provenance.mixed_commit_line(_records()) is None
    line = provenance.mixed_commit_line(_records(("a" * 40, "b" * 40)))
    assert line.startswith("**Mixed commits") and "aaaaaaaaaaaa" in line and "bbbbbbbbbbbb" in line
    old = [{k: v for k, v in r.items() if k != "provenance"} for r in _records()]
    assert "no git commit" in provenance.mixed_commit_line(old)


def test_runs_from_a_dirty_checkout_are_named_in_the_first_line():
    records = _records()
    for r in records:
        r["provenance"]["git_dirty"] = True
    line = provenance.mixed_commit_line(records)
    assert line.startswith("**Uncommitted changes") and "aaaaaaaaaaaa" in line
    records[0]["provenance"]["git_dirty"] = False  # clean and dirty runs of one commit: two states
    assert provenance.mixed_commit_line(records).startswith("**Mixed commits")


def test_two_sets_of_uncommitted_changes_on_one_commit_are_two_states(tmp_path, monkeypatch, capsys):
    """Runs of one commit, each from a checkout with other uncommitted changes, were grouped as one
    "commit+dirty" and tabled together (a review changed init_method_std for seed 1 only): the
    changes' hash now tells them apart, and ablate refuses the mix like two commits."""
    records = _records()
    for r in records:
        r["provenance"].update(git_dirty=True, git_changes_sha256="c" * 64 if r["seed"] == 1 else "d" * 64)
    assert len(provenance.commits_of(records)) == 2
    line = provenance.mixed_commit_line(records)
    assert line.startswith("**Mixed commits") and "uncommitted changes cccccccccccc" in line, line
    err = _refused_by_ablate(tmp_path, monkeypatch, capsys, records)
    assert "aaaaaaaaaaaa + uncommitted changes dddddddddddd" in err, err
    for r in records:  # one set of changes: one state, named in the first line as before
        r["provenance"]["git_changes_sha256"] = "c" * 64
    assert provenance.mixed_commit_line(records).startswith("**Uncommitted changes")


def _repo_with(tmp_path, name: str, text: str) -> None:
    """A git repository in tmp_path whose one commit holds ``name`` with ``text``."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / name).write_text(text)
    git("add", name)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")


def test_the_changes_hash_follows_the_uncommitted_content(tmp_path):
    _repo_with(tmp_path, "model.py", "std = 0.02\n")
    assert provenance.git_state(tmp_path)["git_changes_sha256"] is None  # clean
    (tmp_path / "model.py").write_text("std = 0.06\n")
    edited = provenance.git_state(tmp_path)["git_changes_sha256"]
    (tmp_path / "model.py").write_text("std = 0.02\n")
    (tmp_path / "note.txt").write_text("untracked\n")
    untracked = provenance.git_state(tmp_path)["git_changes_sha256"]
    assert edited and untracked and edited != untracked
    (tmp_path / "note.txt").write_text("untracked, edited\n")
    assert provenance.git_state(tmp_path)["git_changes_sha256"] not in (None, untracked)


def test_a_large_untracked_file_counts_by_name_and_size_not_read(tmp_path, monkeypatch):
    """A run directory or dataset left untracked in the checkout is not read by every rank at start:
    over UNTRACKED_HASH_BYTES a file changes the hash through its size only."""
    from ascender_dist import versions

    monkeypatch.setattr(versions, "UNTRACKED_HASH_BYTES", 8)
    _repo_with(tmp_path, "model.py", "std = 0.02\n")
    (tmp_path / "ckpt.bin").write_bytes(b"a" * 16)
    first = provenance.git_state(tmp_path)["git_changes_sha256"]
    (tmp_path / "ckpt.bin").write_bytes(b"b" * 16)  # same size, other bytes: not read
    assert provenance.git_state(tmp_path)["git_changes_sha256"] == first
    (tmp_path / "ckpt.bin").write_bytes(b"b" * 17)
    assert provenance.git_state(tmp_path)["git_changes_sha256"] != first
    (tmp_path / "small.py").write_bytes(b"x = 1")  # at most the limit: read
    small = provenance.git_state(tmp_path)["git_changes_sha256"]
    (tmp_path / "small.py").write_bytes(b"x = 2")
    assert provenance.git_state(tmp_path)["git_changes_sha256"] != small


def test_links_and_directories_inside_another_checkout_are_not_read_or_credited(tmp_path):
    """An untracked link to /dev/zero was followed (its size 0, then read forever); a copy of the code
    installed below some other checkout (a virtual environment inside it) was credited with that
    checkout's commit; a non-UTF-8 file name must not stop a run (recording never raises)."""
    import os

    _repo_with(tmp_path, "model.py", "std = 0.02\n")
    os.symlink("/dev/zero", tmp_path / "zeros")
    (tmp_path / "caf\udce9.txt".encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")).write_text("x")
    state = provenance.git_state(tmp_path)
    assert state["git_dirty"] is True and len(state["git_changes_sha256"]) == 64
    os.unlink(tmp_path / "zeros")
    os.symlink("/dev/null", tmp_path / "zeros")  # another target: another hash
    assert provenance.git_state(tmp_path)["git_changes_sha256"] != state["git_changes_sha256"]
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    assert provenance.git_state(tmp_path / "venv" / "lib") == {"git_commit": None, "git_dirty": None,
                                                                "git_changes_sha256": None}


def test_untracked_files_make_a_checkout_dirty(tmp_path):
    _repo_with(tmp_path, ".gitignore", "runs/\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "result.json").write_text("{}")  # ignored: still clean
    assert provenance.git_state(tmp_path)["git_dirty"] is False
    (tmp_path / "new_module.py").write_text("x = 1\n")
    assert provenance.git_state(tmp_path)["git_dirty"] is True


def test_report_of_mixed_commits_says_so_first(tmp_path):
    report.write_report(_grid(tmp_path), _records(("a" * 40, "b" * 40)), n_resamples=200, n_permutations=200)
    assert (tmp_path / "report" / "results.md").read_text().startswith("**Mixed commits")


def test_ablate_refuses_mixed_commits_unless_allowed(tmp_path, monkeypatch, capsys):
    grid = _grid(tmp_path)
    monkeypatch.setattr(ablate.main, "load_grid", lambda *a, **k: grid)
    monkeypatch.setattr(ablate.main, "collect_records", lambda g: _records(("a" * 40, "b" * 40)))
    assert ablate.ablate_main(["x.yaml", "--report-only", "--n-resamples", "200"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-mixed-commits" in err and "aaaaaaaaaaaa: 3 runs" in err
    assert ablate.ablate_main(["x.yaml", "--report-only", "--n-resamples", "200", "--allow-mixed-commits"]) == 0


def _refused_by_ablate(tmp_path, monkeypatch, capsys, records) -> str:
    """``ablate --report-only`` over ``records``: exit 2 with one stderr line naming the way out; returns it."""
    grid = _grid(tmp_path)
    monkeypatch.setattr(ablate.main, "load_grid", lambda *a, **k: grid)
    monkeypatch.setattr(ablate.main, "collect_records", lambda g: records)
    assert ablate.ablate_main(["x.yaml", "--report-only", "--n-resamples", "200"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-mixed-commits" in err, err
    return err


def _with_versions(records, torch_of=lambda i: "2.13.0+cpu"):
    for i, r in enumerate(records):
        r["provenance"]["versions"] = {"torch": torch_of(i), "deepspeed": "0.19.8"}
    return records


def test_runs_of_mixed_library_versions_are_named_refused_and_reported_as_theirs(tmp_path, monkeypatch, capsys):
    """The provenance sentence gives the runs' versions (not the report process's), and a version mix
    is named in the first line like a commit mix, and refused by ablate unless allowed."""
    mixed = _with_versions(_records(), lambda i: "2.4.0+cpu" if i < 2 else "2.13.0+cpu")
    line = provenance.mixed_version_line(mixed)
    assert line.startswith("**Mixed versions") and "torch 2.4.0+cpu (2 runs), 2.13.0+cpu (4 runs)" in line
    assert provenance.mixed_version_line(_with_versions(_records())) is None
    report.write_report(_grid(tmp_path), mixed, n_resamples=200, n_permutations=200)
    text = (tmp_path / "report" / "results.md").read_text()
    assert text.startswith("**Mixed versions") and "versions torch 2.4.0+cpu / 2.13.0+cpu" in text
    assert "Mixed versions" in _refused_by_ablate(tmp_path, monkeypatch, capsys, mixed)


def test_runs_on_other_data_or_configs_are_named_refused_and_reported(tmp_path, monkeypatch, capsys):
    """Seeds trained on two corpora (or one variant's seeds on two configs) were paired in the tables
    without a word: the report printed the manifest file's hash, not the runs'."""
    records = _records()
    for i, r in enumerate(records):
        r["provenance"].update(data_manifest_sha256=("d" if i < 4 else "e") * 64, config_sha256=f"{r['config']}" * 16)
    line = provenance.mixed_inputs_line(records)
    assert line.startswith("**Mixed inputs: this table combines runs trained on data manifests dddddddddddd "
                           "(4 runs), eeeeeeeeeeee (2 runs)")
    records[0]["provenance"]["config_sha256"] = "f" * 64
    assert f"variant {records[0]['config']} with 2 configs" in provenance.mixed_inputs_line(records)
    same = _records()
    for r in same:
        r["provenance"].update(data_manifest_sha256="d" * 64)
    assert provenance.mixed_inputs_line(same) is None
    report.write_report(_grid(tmp_path), records, n_resamples=200, n_permutations=200)
    assert "**Mixed inputs" in (tmp_path / "report" / "results.md").read_text().split("\n\n")[0]
    assert "Mixed inputs" in _refused_by_ablate(tmp_path, monkeypatch, capsys, records)


def test_a_written_report_records_the_machine_it_was_written_on(tmp_path):
    full = report.write_report(_grid(tmp_path), _records(), n_resamples=200, n_permutations=200)
    assert full["report_provenance"]["machine"]["logical_cpus"] >= 1


def test_config_hash_ignores_seed_name_and_output_dir_only():
    a = {"name": "x-seed1", "output_dir": "r/1", "train": {"seed": 1, "lr": 1}, "model": {"k": 4}}
    b = {"name": "x-seed2", "output_dir": "r/2", "train": {"seed": 2, "lr": 1}, "model": {"k": 4}}
    assert provenance.config_hash(a) == provenance.config_hash(b)
    assert provenance.config_hash(a) != provenance.config_hash({**a, "model": {"k": 8}})


def test_per_sequence_losses_round_trip_and_tables_rebuilds_the_report(tmp_path):
    recs = _records()
    full = report.write_report(_grid(tmp_path), recs, n_resamples=300, n_permutations=300)
    out = tmp_path / "report"
    saved = json.loads((out / "results.json").read_text())
    assert "val_example_losses" not in saved["records"][0]  # they live in the npz
    per_seq = report.read_per_sequence(out / report.PER_SEQUENCE)
    assert per_seq[("asc", "2")]["val_example_losses"] == pytest.approx(recs[4]["val_example_losses"])
    assert per_seq[("gpt", "1")]["val_example_documents"] == recs[0]["val_example_documents"]
    per = {e["config"]: e for e in full["tables"]["per_example"]["gpt"]["configs"]}
    assert per["asc"]["unit"] == "document" and per["asc"]["n_documents"] == 4
    assert per["asc"]["comparison"]["interval"].startswith("document bootstrap")
    md = (out / "results.md").read_text()
    assert "all validation windows of a document drawn together" in md and "Holm" in md
    before = md[md.index("### "):]
    (out / "results.md").unlink()
    proc = subprocess.run([sys.executable, "-m", "ascender_dist.cli", "tables", str(out), "--n-resamples", "300"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = (out / "results.md").read_text()
    assert after[after.index("### "):] == before
    assert json.loads((out / "results.json").read_text())["tables"] == json.loads(json.dumps(
        report._json_safe(full["tables"])))


def test_tables_on_a_directory_without_results_is_one_line(tmp_path, capsys):
    assert ablate.main.tables_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "results.json" in err


def test_tables_refuses_a_missing_or_corrupt_per_sequence_file_without_rewriting(tmp_path, capsys):
    """A report directory without its per_sequence.npz was rebuilt without the per-sequence tables
    (results.json rewritten, exit 0: they were lost); a truncated one gave a zipfile traceback."""
    report.write_report(_grid(tmp_path), _records(), n_resamples=200, n_permutations=200)
    out = tmp_path / "report"
    npz = out / report.PER_SEQUENCE
    saved = {name: (out / name).read_bytes() for name in ("results.json", "results.md")}
    content = npz.read_bytes()
    npz.unlink()
    assert ablate.main.tables_main([str(out), "--n-resamples", "200"]) == 2
    assert capsys.readouterr().err == (f"error: {npz}: missing, but {out / 'results.json'} holds per-sequence "
                                       "results; restore it (nothing was rewritten)\n")
    npz.write_bytes(content[:1000])
    assert ablate.main.tables_main([str(out), "--n-resamples", "200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {npz}: unreadable (") and err.endswith("; nothing was rewritten\n")
    assert err.count("\n") == 1
    assert {name: (out / name).read_bytes() for name in saved} == saved
    with pytest.raises(SystemExit):
        ablate.main.tables_main([str(out), "--n-resamples", "0"])
    assert "--n-resamples must be >= 1 (got 0)" in capsys.readouterr().err


def test_tables_index_refuses_a_grids_folder_that_is_not_there(tmp_path, capsys):
    """--grids /nonexistent was ignored: the index then listed no grid as not run."""
    assert ablate.main.tables_main([str(tmp_path), "--index", "--grids", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: --grids {tmp_path / 'nope'}: not a directory of grid YAMLs\n"


def test_plotting_without_matplotlib_names_the_extra():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from ascender_dist.plotting import pyplot\npyplot()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: this command draws figures and needs matplotlib: pip install 'ascender-dist[research]'"]


def test_core_dependencies_leave_out_the_research_packages():
    from tests.helpers.project import pyproject

    project = pyproject()
    names = lambda deps: {d.split(">")[0].split("=")[0].strip() for d in deps}  # noqa: E731
    research = {"matplotlib", "scikit-learn", "scipy"}
    assert not research & names(project["dependencies"])
    assert names(project["optional-dependencies"]["research"]) == research
    dev = project["optional-dependencies"]["dev"]
    assert any(d.startswith("ascender-dist[") and "research" in d for d in dev)  # [dev] includes [research]


def test_core_commands_run_without_the_research_packages():
    """With matplotlib, scipy and scikit-learn unimportable, the training stack imports and the
    config and plan commands and the converters load; a plotting command says which extra it needs."""
    code = "\n".join([
        "import sys",
        "for name in ('matplotlib', 'scipy', 'sklearn'): sys.modules[name] = None",
        "import ascender_dist.training.trainer, ascender_dist.tools.convert, ascender_dist.tools.hf_export",
        "from ascender_dist.cli import main",
        "assert main(['print-config', '--config', 'configs/demo.yaml', '--vocab-size', '512']) == 0",
        "assert main(['plan', '--config', 'configs/demo.yaml', '--vocab-size', '512', '--gpus-per-node', '2']) == 0",
        "main(['inspect-connection', '--help'])",
    ])
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"# parameters: [\d,]+ total", proc.stdout) and "| layout " in proc.stdout


def test_connection_steps_histogram_and_slot_usage(tmp_path):
    recs = _records()
    for r in recs:  # asc: always 3 steps, gpt-named stand-in: half 1, half 2; loads favour one slot
        hist = [0, 0, 0, 8] if r["config"] == "asc" else [0, 4, 4, 0]
        r["connection"] = {"1": {"max_steps": 3, "steps_hist": hist, "slot_load": [1.0, 5.0, 2.0, 2.0]},
                           "2": {"max_steps": 3, "steps_hist": hist, "slot_load": [2.0, 2.0, 2.0, 4.0]}}
    full = report.write_report(_grid(tmp_path), recs, n_resamples=200, n_permutations=200)
    c = full["connection"]
    assert c["asc"]["steps_fraction"] == [0, 0, 0, 1] and c["asc"]["mean_steps"] == 3
    assert c["gpt"]["mean_steps"] == pytest.approx(1.5)
    # sorted within each layer, then averaged: (0.5 + 0.4) / 2 for the most loaded slot
    assert c["gpt"]["slot_share_sorted"][0] == pytest.approx(0.45)
    assert (tmp_path / "report" / "connection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| asc | 3 | 3.00 | 0.00 / 0.00 / 0.00 / 1.00 | 0.450 |" in (tmp_path / "report" / "results.md").read_text()


def test_validation_curve_panel_counts_the_sequences_its_curve_scored():
    """curves.png's validation curve scores the first train.eval_iters batches (bias grid: 8 x 8 = 64
    sequences), not the final validation's 256: the panel says so."""
    from ascender_dist.research.ablate.report import curve_sequences

    full = json.loads((REPO_ROOT / "benchmarks/results/research/bias/results.json").read_text())
    assert {r["val_sequences"] for r in full["records"]} == {256}
    assert curve_sequences(full["records"], full["grid"]) == [64]
    recorded = [{**r, "val_curve_sequences": 32} for r in full["records"][:2]]
    assert curve_sequences(recorded, full["grid"]) == [32]
    assert curve_sequences([{**r, "val_curve": []} for r in full["records"]], full["grid"]) == []
