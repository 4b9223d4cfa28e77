"""A finished run is reused or reported only if it was trained with the config the grid asks for now.

Its result.json records ``provenance.config_sha256`` (``config_hash(to_dict(cfg))`` of the run's
config); a ``--set`` or an edited grid at the same commit changes the hash the grid asks for, and the
run is refused in one line naming its directory instead of being reported as the new config's."""

from __future__ import annotations

import json

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
