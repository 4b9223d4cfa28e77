"""``ablate`` through the deepspeed launcher with 2 CPU ranks: one tiny grid (gpt and ascender, one seed,
4 steps), then the report rebuilt from the committed files by ``ascender-dist tables``."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.multiproc import REPO_ROOT

pytestmark = pytest.mark.slow

TINY_ASCENDER = {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 2, "chunk_size": 8}


def _run(*args: str, timeout: float = 500) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_two_rank_grid_records_provenance_documents_curves_and_rebuilds(tmp_path):
    data = make_tiny_dataset(tmp_path / "data")
    base = tiny_run_config(data, tmp_path / "unused", train={"train_steps": 4, "eval_interval": 2, "eval_iters": 2},
                           optimizer={"warmup_steps": 1}, model={"ascender": TINY_ASCENDER})
    base.pop("output_dir"), base.pop("name")
    grid = {"name": "tiny2", "base": base, "seeds": [1], "baseline": "gpt", "eval_iters": 4, "ranks": 2,
            "variants": {"gpt": {"model.architecture": "gpt"}, "asc": {"model.architecture": "ascender"}},
            "runs_dir": str(tmp_path / "runs"), "report_dir": str(tmp_path / "report"), "jobs": 1,
            "keep_checkpoints": False}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    proc = _run("-m", "ascender_dist.research.ablate", str(path), "--n-resamples", "200", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for cfg in ("gpt", "asc"):
        run = tmp_path / "runs" / cfg / "seed1"
        launch = (run / "launch.txt").read_text()
        assert "deepspeed" in launch.split()[0] and "--num_accelerators 2" in launch and "run_entry.py" in launch
        r = json.loads((run / "result.json").read_text())
        assert r["world_size"] == 2 and r["steps"] == 4
        # 4 validation micro-batches of 4 sequences in all, two on each of the 2 ranks, restored to the
        # loader's order: the split's first 16, as at one rank
        assert r["val_example_index"] == list(range(16)) and r["val_sequences"] == 16 and r["val_batches"] == 2
        assert r["val_curve_sequences"] == 8  # train.eval_iters: 2 in all, one micro-batch per rank
        assert r["val_loss"] == pytest.approx(np.mean(r["val_example_losses"]), rel=1e-5)
        docs = r["val_example_documents"]
        # ids count documents along the stream: non-decreasing, and the tiny corpus's short documents
        # give these 16 windows several (packed windows straddle boundaries; one id for all was a bug)
        assert len(docs) == 16 and docs == sorted(docs) and len(set(docs)) > 1
        assert [p[0] for p in r["val_curve"]] == [2, 4]
        prov = r["provenance"]
        assert len(prov["git_commit"]) == 40 and isinstance(prov["git_dirty"], bool)
        assert set(prov["versions"]) == {"torch", "megatron-core", "deepspeed", "ascender-dist", "sentencepiece",
                                         "numpy", "scipy", "scikit-learn"}
        assert r["eval_iters"] == 4  # what collect checks against the grid's eval_iters
        assert len(prov["config_sha256"]) == 64 and len(prov["data_manifest_sha256"]) == 64
    report = tmp_path / "report"
    full = json.loads((report / "results.json").read_text())
    hashes = {v["name"]: v["config_sha256"] for v in full["grid"]["variants"]}
    assert hashes["gpt"] != hashes["asc"] and full["grid"]["data_manifest_sha256"]
    assert full["mixed_commits"] is None and (report / "per_sequence.npz").exists()
    md = (report / "results.md").read_text()
    assert md.startswith("# Ablation `tiny2`") and "per validation sequence" in md
    # a copy of the committed files alone rebuilds the same tables
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("results.json", "per_sequence.npz"):
        shutil.copy(report / name, copy / name)
    proc = _run("-m", "ascender_dist.cli", "tables", str(copy), "--n-resamples", "200", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((copy / "results.json").read_text())
    assert again["tables"] == full["tables"]
    table = lambda text: text[text.index("### "):]  # noqa: E731  (the provenance line names the rebuild)
    assert table((copy / "results.md").read_text()) == table(md)
