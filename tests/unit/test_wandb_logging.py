"""Weights & Biases beside TensorBoard: offline mode (no network) records the same scalars at the
same steps as the TensorBoard events, rollbacks included; config field and check."""

from __future__ import annotations

import json
import struct
import time

import pytest

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import from_dict
from ascender_dist.config.schema import RunConfig, WandbConfig
from ascender_dist.training.metrics import MetricLogger
from tests.helpers.tensorboard import read_scalars

import wandb  # noqa: E402,F401  in the [wandb] and [dev] extras: a missing one fails, not skips


def read_wandb_history(run_file) -> list[dict]:
    """History rows of an offline ``run-*.wandb`` file (a LevelDB-style log of protobuf Records:
    7-byte file header, 32 KiB blocks, 7-byte record headers crc/length/type, FULL=1 ... LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left  # zero padding to the block end
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def wait_for_history(run_file, rows: int, timeout_s: float = 30.0) -> list[dict]:
    """The run file's history once it holds ``rows`` rows (or what it holds after ``timeout_s``):
    wandb's service process writes the file, and on a loaded machine its last records were seen to
    land after ``finish()`` had returned (once in a full CI run)."""
    deadline = time.monotonic() + timeout_s
    history = read_wandb_history(run_file)
    while len(history) < rows and time.monotonic() < deadline:
        time.sleep(0.5)
        history = read_wandb_history(run_file)
    return history


def test_offline_wandb_matches_tensorboard(tmp_path):
    logger = MetricLogger(tmp_path / "tb", enabled=True, wandb=WandbConfig(project="p", mode="offline"),
                          run_dir=tmp_path, run_name="t", run_config={"train": {"lr": 1e-3}})
    steps = [(1, {"train/loss": 5.5, "train/lr": 1e-4}), (2, {"train/loss": 5.25, "train/lr": 2e-4}),
             (3, {"train/loss": 4.75, "val/loss": 5.0, "train/mfu": None}),
             (2, {"train/loss": 5.125, "train/rollbacks": 1.0}),  # a rollback logs step 2 again
             (3, {"train/loss": 4.5})]
    for step, values in steps:
        logger.scalars(step, values)
    logger.close()
    tb = {(tag, step): value for tag, rows in read_scalars(tmp_path / "tb").items() for step, value in rows}
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    wb = {(k, row["step"]): v for row in wait_for_history(run_file, len(steps)) for k, v in row.items()
          if not k.startswith("_") and k != "step"}
    expected = {(k, s): v for s, vals in steps for k, v in vals.items() if v is not None}
    assert wb == expected
    assert set(tb) == set(wb) and all(abs(tb[k] - wb[k]) < 1e-6 * abs(wb[k]) for k in wb)


def test_online_jobs_of_one_output_directory_resume_one_run(tmp_path, monkeypatch):
    """Online, two jobs in one output directory (a crash and an auto-resume) log into one W&B run: the
    id is kept in <output_dir>/wandb/run_id and passed with resume="allow" (wandb itself is replaced
    by a recorder: online needs the network)."""
    import sys
    import types

    from ascender_dist.training.wandb_sink import WandbSink

    calls = []

    class FakeRun:
        def define_metric(self, *args, **kwargs):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or FakeRun(), Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):
        WandbSink(WandbConfig(project="p", mode="online"), tmp_path, "t")
    saved = (tmp_path / "wandb" / "run_id").read_text().strip()
    assert [(c["id"], c["resume"]) for c in calls] == [(saved, "allow")] * 2
    WandbSink(WandbConfig(project="p", mode="online"), tmp_path / "other", "t")
    assert calls[-1]["id"] != saved  # another output directory is another run
    WandbSink(WandbConfig(project="p", mode="offline"), tmp_path, "t")
    assert "id" not in calls[-1] and "resume" not in calls[-1]  # offline: a run per job
    (tmp_path / "wandb" / "run_id").write_text("not/an id\n")
    with pytest.raises(ConfigError, match=r"run_id: 'not/an id' is not a W&B run id"):
        WandbSink(WandbConfig(project="p", mode="online"), tmp_path, "t")


def test_wandb_config_field_and_check():
    cfg = from_dict(RunConfig, {"logging": {"wandb": {"project": "ascender", "entity": "lab", "mode": "offline"}}})
    assert cfg.logging.wandb == WandbConfig("ascender", "lab", "offline")
    assert from_dict(RunConfig, {}).logging.wandb.project == ""  # off by default
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        from_dict(RunConfig, {"logging": {"wandb": {"project": "p", "mode": "sometimes"}}})
    from ascender_dist.config.checks import check_wandb
    with pytest.raises(ConfigError, match="logging.wandb.project: must be set"):
        check_wandb(from_dict(RunConfig, {"logging": {"wandb": {"entity": "lab"}}}))


def test_logger_without_wandb_or_on_other_ranks_starts_nothing(tmp_path):
    assert MetricLogger(tmp_path / "tb", enabled=True, wandb=WandbConfig()).wandb is None
    assert MetricLogger(None, enabled=False, wandb=WandbConfig(project="p", mode="offline")).wandb is None
    assert not (tmp_path / "wandb").exists()


def test_a_failing_wandb_init_is_one_line_naming_the_field(tmp_path, monkeypatch):
    """W&B's own exception types (network, authentication) were tracebacks on the logging rank only;
    as a ConfigError, build_run raises it on every rank (guard.on_every_rank)."""
    import sys
    import types

    from ascender_dist.training.wandb_sink import WandbSink

    class CommError(Exception):
        pass

    def init(**kwargs):
        raise CommError("Network error (ConnectionError), entering retry loop.\nmore detail")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    with pytest.raises(ConfigError) as info:
        WandbSink(WandbConfig(project="p", mode="online"), tmp_path, "t")
    assert str(info.value) == ("logging.wandb: wandb.init failed (CommError: Network error (ConnectionError), "
                               "entering retry loop.); mode: offline logs without a network")
