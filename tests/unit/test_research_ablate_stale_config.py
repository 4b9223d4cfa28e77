"""A finished run is reused or reported only if it was trained with the config the grid asks for now.

Its result.json records ``provenance.config_sha256`` (``config_hash(to_dict(cfg))`` of the run's
config); a ``--set`` or an edited grid at the same commit changes the hash the grid asks for, and the
run is refused in one line naming its directory instead of being reported as the new config's."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from ascender_dist.config.loader import to_dict
from ascender_dist.research import ablate
from ascender_dist.research.ablate import load_grid
from ascender_dist.research.ablate.collect import collect_records
from ascender_dist.research.ablate.grid import RESULT, AblationError, run_config, run_dir
from ascender_dist.research.ablate.provenance import config_hash

BASE = {"model": {"architecture": "gpt", "preset": "debug", "vocab_size": 512},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "train_steps": 5},
        "optimizer": {"warmup_steps": 1},
        "data": {"manifest": "data/manifest.json", "tokenizer": "data/tok.model"}}


def _setup(tmp_path):
    """A grid of one run whose result.json was written by the grid as it is (no --set)."""
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"name": "g", "base": BASE, "seeds": [1], "baseline": "gpt",
                                    "variants": {"gpt": {}}}, sort_keys=False))
    runs = tmp_path / "runs"
    grid = load_grid(path)
    grid.runs_dir = runs
    v = grid.variant("gpt")
    d = run_dir(grid, v, 1)
    d.mkdir(parents=True)
    record = {"config": "gpt", "seed": 1, "val_loss": 5.0,
              "provenance": {"config_sha256": config_hash(to_dict(run_config(grid, v, 1)))}}
    (d / RESULT).write_text(json.dumps(record))
    return path, runs, d


def _with_set(path, runs):
    grid = load_grid(path, overrides=["optimizer.lr=5e-4"])
    grid.runs_dir = runs
    return grid


def test_report_refuses_a_run_trained_with_another_config(tmp_path):
    path, runs, d = _setup(tmp_path)
    same = load_grid(path)
    same.runs_dir = runs
    assert [r["val_loss"] for r in collect_records(same)] == [5.0]
    with pytest.raises(AblationError, match="config sha256") as exc:
        collect_records(_with_set(path, runs))
    assert str(d) in str(exc.value) and "\n" not in str(exc.value)


def test_launching_refuses_before_training_anything(tmp_path, monkeypatch):
    from ascender_dist.research.ablate import launch

    path, runs, d = _setup(tmp_path)
    grid = _with_set(path, runs)
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail("a run was launched"))
    with pytest.raises(AblationError, match=str(d)):
        launch.launch_run(grid, grid.variant("gpt"), 1, threads=1)
    with pytest.raises(AblationError, match=str(d)):
        launch.run_grid(grid, progress=False)
    assert (d / RESULT).exists()  # refused, not deleted


def test_cli_report_only_exits_2_with_one_line(tmp_path, capsys):
    path, runs, d = _setup(tmp_path)
    rc = ablate.ablate_main([str(path), "--set", "optimizer.lr=5e-4", "--report-only", "--runs-dir", str(runs),
                             "--report-dir", str(tmp_path / "report"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and str(d) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "report" / "results.json").exists()


def _older_schema_run(tmp_path, edit=None):
    """A run made before the schema grew: its config lacks a field added since (at its default), its
    record hashes that older config and its run directory keeps it as config.yaml (as launch_run
    writes it). ``edit``: changes that older config before it is hashed and saved (another run)."""
    from ascender_dist.config.loader import dump_yaml

    path, runs, d = _setup(tmp_path)
    grid = load_grid(path)
    grid.runs_dir = runs
    old = to_dict(run_config(grid, grid.variant("gpt"), 1))
    del old["train"]["exit_signals"]  # a field added after the run, at its default
    if edit:
        edit(old)
    record = json.loads((d / RESULT).read_text())
    record["provenance"]["config_sha256"] = config_hash(old)
    (d / RESULT).write_text(json.dumps(record))
    (d / "config.yaml").write_text(dump_yaml(old))
    return grid, d


def test_a_field_added_to_the_schema_since_the_run_does_not_refuse_it(tmp_path):
    grid, d = _older_schema_run(tmp_path)
    assert [r["val_loss"] for r in collect_records(grid)] == [5.0]
    (d / "config.yaml").unlink()  # nothing shows the settings are the same: refused
    with pytest.raises(AblationError, match="config sha256"):
        collect_records(grid)


def test_a_run_of_other_settings_is_refused_even_from_an_older_schema(tmp_path):
    grid, d = _older_schema_run(tmp_path, edit=lambda cfg: cfg["optimizer"].update(lr=5e-4))
    with pytest.raises(AblationError, match="config sha256"):
        collect_records(grid)
    (tmp_path / "edited").mkdir()
    grid, d = _older_schema_run(tmp_path / "edited")  # config.yaml edited after the run: not the hashed one
    text = (d / "config.yaml").read_text()
    assert "warmup_steps: 1\n" in text
    (d / "config.yaml").write_text(text.replace("warmup_steps: 1\n", "warmup_steps: 2\n"))
    with pytest.raises(AblationError, match="config sha256"):
        collect_records(grid)


def test_a_run_validated_over_other_eval_iters_is_refused(tmp_path):
    """eval_iters reaches the run as a flag, not through its config (not in the hash): the record's
    own eval_iters is checked against the grid's."""
    path, runs, d = _setup(tmp_path)
    grid = load_grid(path)
    grid.runs_dir = runs
    asked = run_config(grid, grid.variant("gpt"), 1).train.eval_iters
    record = json.loads((d / RESULT).read_text())
    (d / RESULT).write_text(json.dumps({**record, "eval_iters": asked}))
    assert len(collect_records(grid)) == 1
    grid.eval_iters = asked + 1
    with pytest.raises(AblationError, match="eval_iters") as exc:
        collect_records(grid)
    assert str(d) in str(exc.value) and "\n" not in str(exc.value)


def test_tables_refuse_runs_scored_on_different_validation_sets():
    from ascender_dist.research.ablate.collect import check_same_validation

    same = [{"config": c, "seed": 1, "val_batches": 32, "val_sequences": 256} for c in ("gpt", "asc")]
    check_same_validation(same)
    # the same 256 sequences read at 2 ranks (16 micro-batches each): the same set
    check_same_validation([same[0], {**same[1], "val_batches": 16}])
    with pytest.raises(AblationError, match="different sets: gpt seed 1 on 256 sequences, asc seed 1 on 128"):
        check_same_validation([same[0], {**same[1], "val_batches": 16, "val_sequences": 128}])


def test_a_run_finished_on_other_ranks_or_device_is_not_reused(tmp_path, monkeypatch):
    """world size and device are not in the config hash: a grid run again at another --ranks (or on
    GPUs after CPU) reused the finished runs and reported them beside its own."""
    from ascender_dist.research.ablate import launch

    path, runs, d = _setup(tmp_path)
    record = json.loads((d / RESULT).read_text())
    (d / RESULT).write_text(json.dumps({**record, "world_size": 1, "device": "cpu"}))
    grid = load_grid(path)
    grid.runs_dir = runs
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail("a run was launched"))
    same = launch.Launcher(ranks=1, cuda=False)
    assert [r["val_loss"] for r in launch.run_grid(grid, progress=False, launcher=same)] == [5.0]
    for launcher, message in [(launch.Launcher(ranks=2, cuda=False), "finished on 1 cpu rank(s), this invocation "
                                                                     "trains on 2 cpu rank(s)"),
                              (launch.Launcher(ranks=1, cuda=True), "trains on 1 cuda rank(s)")]:
        with pytest.raises(AblationError, match=re.escape(message)) as exc:
            launch.run_grid(grid, progress=False, launcher=launcher)
        assert str(d) in str(exc.value) and "\n" not in str(exc.value)
        with pytest.raises(AblationError, match=re.escape(message)):
            launch.launch_run(grid, grid.variant("gpt"), 1, threads=1, launcher=launcher)
    assert (d / RESULT).exists()  # refused, not deleted
