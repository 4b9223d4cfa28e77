"""A trained Connection model's checkpoint -> consolidated -> heatmaps a person can look at."""

import json
import shutil

import pytest

from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import assert_check, run_ranks
from tests.integration.test_conversion import cli

pytestmark = pytest.mark.slow


def test_inspect_connection_writes_heatmaps_and_summary(tmp_path):
    data = make_tiny_dataset(tmp_path / "data")
    args = {"data": data, "root": str(tmp_path / "runs")}
    assert_check(run_ranks("tests.distributed.workers.conversion:train_connection", world_size=1, timeout=300,
                           args=args), "connection")
    cli("consolidate", "--checkpoint", str(tmp_path / "runs" / "connection" / "checkpoints"),
        "--out", str(tmp_path / "consolidated"), "--architecture", "connection")
    proc = cli("inspect-connection", "--consolidated", str(tmp_path / "consolidated"), "--out", str(tmp_path / "png"),
               "--max-tokens", "20")
    assert "layer 2: steps mean" in proc.stdout
    summary = json.loads((tmp_path / "png" / "summary.json").read_text())
    assert list(summary["layers"]) == ["2", "4"]  # pattern "AC" over 4 layers
    for layer in summary["layers"].values():
        assert len(layer["matrix"]) == 4 and all(len(row) == 4 for row in layer["matrix"])
        assert abs(sum(layer["slot_load_totals"]) - 20) < 1e-3  # each token's loads sum to 1
        assert 1 <= layer["steps_mean"] <= layer["max_steps"]
        # 20 tokens in chunks of 8: three reasoning states, the first (the bare slots) reported apart
        assert len(layer["steps_per_chunk"]) == 3 and layer["causal_chunk_size"] == 8
        assert layer["steps_first_chunk"] == layer["steps_per_chunk"][0]
    # an input within the first chunk reaches no reasoning state: its steps are not reported as the input's
    proc = cli("inspect-connection", "--consolidated", str(tmp_path / "consolidated"), "--out", str(tmp_path / "one"),
               "--max-tokens", "8")
    assert "steps not shown: the 8 input tokens fit in the first chunk of 8" in proc.stdout
    assert all(layer["steps_mean"] is None for layer in
               json.loads((tmp_path / "one" / "summary.json").read_text())["layers"].values())
    # a config.yaml that no longer describes the weights (edited by hand) is refused in one line
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "consolidated", edited)
    config = edited / "config.yaml"
    config.write_text(config.read_text().replace("num_layers: 4", "num_layers: 2"))
    proc = cli("inspect-connection", "--consolidated", str(edited), "--out", str(tmp_path / "x"), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert str(edited / "model.safetensors") in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert len(summary["tokens"]) == 20
    for number in ("02", "04"):
        for kind in ("connection", "slot_loads"):
            png = tmp_path / "png" / f"layer{number}_{kind}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
