"""Research surface end to end on CPU: a tiny ablation grid of real training runs (report, tables, PNGs),
then consolidated ASCender checkpoints -> Figure 1 / Figure 4 PNGs and the Table 4 cluster JSON."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers.data import make_tiny_dataset, tiny_run_config
from tests.helpers.multiproc import REPO_ROOT

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"
TINY_ASCENDER = {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 2, "chunk_size": 8}


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)  # as a user's shell
    return env


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """2 variants (gpt, ascender) x 2 seeds, 5 steps each, through `python -m ascender_dist.research.ablate`."""
    root = tmp_path_factory.mktemp("ablate")
    data = make_tiny_dataset(root / "data")
    base = tiny_run_config(data, root / "unused", train={"train_steps": 5}, optimizer={"warmup_steps": 1},
                           model={"ascender": TINY_ASCENDER})
    base.pop("output_dir"), base.pop("name")
    grid = {"name": "tiny", "base": base, "seeds": [1, 2], "baseline": "gpt", "eval_iters": 4,
            "variants": {"gpt": {"model.architecture": "gpt"}, "asc": {"model.architecture": "ascender"}},
            "runs_dir": str(root / "runs"), "report_dir": str(root / "report"), "jobs": 2}
    path = root / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    proc = _run("-m", "ascender_dist.research.ablate", str(path), "--n-resamples", "500", "--no-progress")
    return {"root": root, "grid": path, "proc": proc}


def test_grid_report_tables_json_and_pngs(grid_run):
    root = grid_run["root"]
    report = root / "report"
    for name in ("pareto.png", "ablation.png", "curves.png"):
        assert (report / name).read_bytes()[:8] == PNG
    md = (report / "results.md").read_text()
    assert "### val_loss vs gpt (paired by seed" in md and "| asc | 2 |" in md
    full = json.loads((report / "results.json").read_text())
    records = {(r["config"], r["seed"]): r for r in full["records"]}
    assert set(records) == {("gpt", 1), ("gpt", 2), ("asc", 1), ("asc", 2)}
    for (cfg, seed), r in records.items():
        result = json.loads((root / "runs" / cfg / f"seed{seed}" / "result.json").read_text())
        # Trainer.validate's loss is the mean of the per-sequence losses the hook kept
        assert r["val_loss"] == pytest.approx(np.mean(result["val_example_losses"]), rel=1e-5)
        assert result["val_sequences"] == 4 * 4 and r["steps"] == 5 and len(r["train_losses"]) == 5
        assert r["tokens"] == 5 * 16 * 32 and r["training_flops"] == pytest.approx(r["flops_per_token"] * r["tokens"])
        assert r["params"] == r["params_analytic"] > 0 and r["tokens_per_s"] > 0 and r["peak_rss_mib"] > 0
        assert bool(r["omega"]) == (cfg == "asc")
    # pairing: same data for both variants of a seed, different data for different seeds
    assert records[("gpt", 1)]["data_sha256"] == records[("asc", 1)]["data_sha256"]
    assert records[("gpt", 2)]["data_sha256"] == records[("asc", 2)]["data_sha256"]
    assert records[("gpt", 1)]["data_sha256"] != records[("gpt", 2)]["data_sha256"]
    assert all(p["identical"] for p in full["tables"]["data_pairing"].values())
    # the table's numbers are the records' numbers
    main = {e["config"]: e for e in full["tables"]["main"]["configs"]}
    asc_vals = [records[("asc", s)]["val_loss"] for s in (1, 2)]
    gpt_vals = [records[("gpt", s)]["val_loss"] for s in (1, 2)]
    assert main["asc"]["mean"] == pytest.approx(np.mean(asc_vals))
    assert main["asc"]["comparison"]["mean_diff"] == pytest.approx(np.mean(asc_vals) - np.mean(gpt_vals))
    # 2 seeds, exact sign-flip test: p = 2/4 when both differences have one sign (only the flip of both
    # ties the observed mean), else 4/4 (every flip's |mean| is at least the observed one)
    d1, d2 = (records[("asc", s)]["val_loss"] - records[("gpt", s)]["val_loss"] for s in (1, 2))
    assert main["asc"]["comparison"]["p_randomization"] == pytest.approx(0.5 if d1 * d2 > 0 else 1.0)
    assert full["missing_runs"] == []


def test_half_finished_grid_resumes_only_the_unfinished_run(grid_run):
    """A grid stopped mid-run (one run's directory without its result.json) resumes: the next
    invocation trains that run again from scratch and leaves every finished run alone."""
    runs = grid_run["root"] / "runs" / "gpt"
    finished, interrupted = runs / "seed1" / "result.json", runs / "seed2" / "result.json"
    before = finished.stat().st_mtime_ns
    old_record = json.loads(interrupted.read_text())
    interrupted.unlink()  # as a run killed before it wrote its result
    (runs / "seed2" / "partial.txt").write_text("left by the killed run")
    _run("-m", "ascender_dist.research.ablate", str(grid_run["grid"]), "--n-resamples", "200", "--no-progress",
         "--only", "gpt", "--report-dir", str(grid_run["root"] / "report-gpt"), timeout=300)
    assert finished.stat().st_mtime_ns == before
    record = json.loads(interrupted.read_text())
    assert not (runs / "seed2" / "partial.txt").exists()  # started again in a fresh directory
    assert record["val_loss"] == pytest.approx(old_record["val_loss"], abs=1e-4)  # same seed, same run


def test_figures_from_consolidated_checkpoints(grid_run, tmp_path):
    root = grid_run["root"]
    procs = []
    for cfg, seed in (("asc", 1), ("asc", 2), ("gpt", 1)):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ascender_dist.cli", "consolidate", "--checkpoint",
             str(root / "runs" / cfg / f"seed{seed}" / "checkpoints"), "--out", str(tmp_path / f"{cfg}{seed}")],
            cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=400)
        assert p.returncode == 0, out[-3000:]
    out = tmp_path / "figures"
    proc = _run("-m", "ascender_dist.research.figures", "--model", f"ascender={tmp_path / 'asc1'}",
                "--model", f"ascender={tmp_path / 'asc2'}", "--model", f"gpt={tmp_path / 'gpt1'}",
                "--out", str(out), "--max-tokens", "16", "--cluster-examples", "2")
    assert "Figure 4 for ['ascender']" in proc.stdout
    for layer in (1, 2):
        assert (out / f"fig1_ascender_ex0_layer{layer:02d}.png").read_bytes()[:8] == PNG
    assert (out / "fig4_ascender_omega.png").read_bytes()[:8] == PNG
    assert (out / "fig4_ascender_mass_moved.png").read_bytes()[:8] == PNG
    table = json.loads((out / "table4_clusters.json").read_text())
    assert set(table) >= {"metrics", "spectral", "argmax", "rows", "per_layer", "settings"}
    assert table["metrics"] == ["nmi", "ari", "calinski_harabasz", "silhouette"]
    configs = {e["config"]: e for e in table["spectral"]["configs"]}
    assert set(configs) == {"ascender", "gpt"} and configs["ascender"]["n"] == 2
    for row in table["rows"]:
        assert 0.0 <= row["nmi"] <= 1.0 and -1.0 <= row["ari"] <= 1.0
    summary = json.loads((out / "figures.json").read_text())
    prov = summary["provenance"]  # where the figures came from: commit, versions, command
    assert len(prov["git_commit"]) == 40 and prov["versions"]["torch"] and "figures" in " ".join(prov["command"])
    for model in summary["models"]:  # which trained models were scored: their config and weights
        assert len(model["config_sha256"]) == 64, model
        assert model["trained_at"]["code"]["git_commit"] == prov["git_commit"], model  # trained by this checkout
        assert model["weights_sha256"] == hashlib.sha256((Path(model["dir"]) / "model.safetensors").read_bytes()).hexdigest()
    fig4 = summary["figure4"]["ascender"]
    assert fig4["n_seeds"] == 2 and np.array(fig4["omega_per_run"]).shape == (2, 2, 4, 3)
    # Figure 4 shows each seed's learned omegas (read back from their runs), never a mean by head index
    omegas = [np.array([json.loads((root / "runs" / "asc" / f"seed{s}" / "result.json").read_text())["omega"][k]
                        for k in ("1", "2")]) for s in (1, 2)]
    np.testing.assert_allclose(np.array(fig4["omega_per_run"]), np.stack(omegas), atol=1e-6)
    assert "| ascender | 2 |" in (out / "table4_clusters.md").read_text()
