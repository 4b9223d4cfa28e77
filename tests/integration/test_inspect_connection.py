"""A trained Connection model's checkpoint -> consolidated -> heatmaps a person can look at."""

import json

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
    assert len(summary["tokens"]) == 20
    for number in ("02", "04"):
        for kind in ("connection", "slot_loads"):
            png = tmp_path / "png" / f"layer{number}_{kind}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
