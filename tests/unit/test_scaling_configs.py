"""The committed scaling runs are exactly what their generator's stated rule produces."""

import importlib.util
from pathlib import Path

import pytest

from ascender_dist.config import load_config

SCALING = Path(__file__).resolve().parents[2] / "configs" / "scaling"


def _generator():
    spec = importlib.util.spec_from_file_location("make_configs", SCALING / "make_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
RUNS = [(a, s) for a in GEN.ARCHITECTURES for s in GEN.SIZES]


@pytest.mark.parametrize("architecture,size", RUNS)
def test_committed_yaml_matches_generator(architecture, size):
    path = SCALING / f"{architecture}-{size}.yaml"
    assert path.read_text() == GEN.render(architecture, size), f"re-run {SCALING / 'make_configs.py'}"


@pytest.mark.parametrize("architecture,size", RUNS)
def test_budget_is_20_tokens_per_parameter(architecture, size):
    from ascender_dist.models.counting import count_model

    cfg = load_config(SCALING / f"{architecture}-{size}.yaml")
    params = count_model(cfg.model, GEN.VOCAB, cfg.parallel.tensor_model_parallel_size).total_params
    tokens = cfg.train.train_steps * cfg.train.global_batch_size * cfg.model.seq_length
    assert 20 * params <= tokens < 20 * params + cfg.train.global_batch_size * cfg.model.seq_length
    assert cfg.train.global_batch_size * cfg.model.seq_length == 524288  # 0.5M tokens per step


def _readme_rows() -> dict[str, list[str]]:
    """README's scaling table: run name -> its cells (parameters, FLOPs/token, tokens, time at MFU 0.4,
    time at the measured MFU)."""
    text = (SCALING.parents[1] / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in {f"{a}-{s}" for a, s in RUNS}:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("architecture,size", RUNS)
def test_readme_table_matches_the_counts(architecture, size):
    """The README's parameters and FLOPs/token are what count_model gives now (its text says they
    come from print-config): a change to the counting must come with the table."""
    from ascender_dist.models.counting import count_model

    cells = _readme_rows()[f"{architecture}-{size}"]
    cfg = load_config(SCALING / f"{architecture}-{size}.yaml")
    counts = count_model(cfg.model, GEN.VOCAB, cfg.parallel.tensor_model_parallel_size)
    assert cells[0] == f"{counts.total_params / 1e6:.1f} M"
    mantissa, exponent = f"{counts.flops_per_token:.2e}".split("e")
    assert cells[1] == f"{mantissa}e{int(exponent)}"


def _hours(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"min": 1 / 60, "h": 1.0, "days": 24.0}[unit]


@pytest.mark.parametrize("architecture,size", RUNS)
def test_readme_times_are_the_plans_at_0_4_and_at_the_measured_mfu(architecture, size):
    """Both time columns are `plan`'s (time is 1 / MFU): at 0.4, and at the MFU of the tokens/s that
    benchmarks/results/gpu/training.json measured for the architecture, counted with today's
    FLOPs/token at that run's shape (the text states those)."""
    import json

    from ascender_dist.models.counting import count_model
    from ascender_dist.tools.plan import ClusterShape, plan

    measured = {}
    for row in json.loads((SCALING.parents[1] / "benchmarks/results/gpu/training.json").read_text())["rows"]:
        run = load_config(SCALING / f"{row['arch']}-{row['preset']}.yaml", [f"model.seq_length={row['seq_length']}"])
        flops = count_model(run.model, row["vocab_size"], 1).flops_per_token
        measured[row["arch"]] = row["tokens_per_s"] * flops / row["world"] / (row["peak_tflops"] * 1e12)
    cells = _readme_rows()[f"{architecture}-{size}"]
    text = (SCALING.parents[1] / "README.md").read_text()
    assert f"{architecture} {100 * measured[architecture]:.2f} %" in text
    cfg = load_config(SCALING / f"{architecture}-{size}.yaml")
    for cell, mfu in ((cells[3], 0.4), (cells[4], measured[architecture])):
        hours = plan(cfg, ClusterShape(), vocab_size=GEN.VOCAB, mfu=mfu).train_seconds / 3600
        assert abs(_hours(cell) - hours) <= 0.06 * hours, (cell, hours)


def test_the_nine_runs_read_one_set_of_shards():
    """One manifest for every run: every preset must have one context length (shards are written for one)."""
    configs = [load_config(SCALING / f"{a}-{s}.yaml") for a, s in RUNS]
    assert {c.data.manifest for c in configs} == {"data/shards/manifest.json"}
    assert {c.model.seq_length for c in configs} == {2048}


@pytest.mark.parametrize("size", list(GEN.SIZES))
def test_ascender_runs_turn_separation_on_after_a_tenth_of_training(size):
    cfg = load_config(SCALING / f"ascender-{size}.yaml")
    assert cfg.model.ascender.separation_start_step == cfg.train.train_steps // 10 > 0
