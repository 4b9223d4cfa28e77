"""Strict config loading: every shipped YAML validates; bad YAML fails in one line naming the field."""

from pathlib import Path

import pytest

from ascender_dist.config import ConfigError, load_config, validate
from ascender_dist.config.loader import parse_yaml_text
from ascender_dist.config.presets import MODEL_PRESETS
from ascender_dist.config.resolve import config_from_dict, derive, pad_vocab_size

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"
GRIDS = sorted((CONFIG_ROOT / "ablations").glob("*.yaml"))  # ablation grids, not run configs
CONFIGS = sorted(p for p in CONFIG_ROOT.rglob("*.yaml") if p not in GRIDS)


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _error(tmp_path, text: str, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text), overrides)
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    return message


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    validate(cfg)


def test_configs_directory_is_not_empty():
    assert len(CONFIGS) >= 10 and len(GRIDS) >= 1


@pytest.mark.parametrize("path", GRIDS, ids=[p.name for p in GRIDS])
def test_every_ablation_grid_loads_and_every_run_validates(path):
    from ascender_dist.research.ablate import load_grid, run_config

    grid = load_grid(path)  # checks every override path and variant config
    assert grid.variants and grid.seeds
    for variant in grid.variants:
        run_config(grid, variant, grid.seeds[0])


def test_scientific_notation_is_a_float(tmp_path):
    cfg = load_config(_write(tmp_path, "optimizer:\n  lr: 1e-3\n  min_lr: 1E-5\n"))
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == pytest.approx(1e-5)


def test_int_is_accepted_for_float_but_not_the_reverse(tmp_path):
    assert load_config(_write(tmp_path, "optimizer:\n  grad_clip: 2\n")).optimizer.grad_clip == 2.0
    message = _error(tmp_path, "train:\n  train_steps: 10.5\n")
    assert "train.train_steps" in message and "expected int" in message


def test_unknown_key_names_dotted_path(tmp_path):
    message = _error(tmp_path, "model:\n  hiden_size: 64\n")
    assert message.startswith(str(tmp_path / "run.yaml") + ": model.hiden_size: unknown key")
    assert "hidden_size" in message  # lists the allowed keys


def test_unknown_top_level_section(tmp_path):
    assert "optimiser: unknown key" in _error(tmp_path, "optimiser:\n  lr: 1.0\n")


def test_wrong_type_names_field_and_expected_type(tmp_path):
    message = _error(tmp_path, "train:\n  micro_batch_size: four\n")
    assert "train.micro_batch_size: expected int, got str 'four'" in message
    message = _error(tmp_path, "checkpoint:\n  auto_resume: 1\n")
    assert "checkpoint.auto_resume: expected bool" in message


def test_choice_field_lists_allowed_values(tmp_path):
    message = _error(tmp_path, "model:\n  architecture: bert\n")
    assert "model.architecture" in message and "'gpt'" in message


def test_tensor_parallel_must_divide_heads(tmp_path):
    message = _error(tmp_path, "model:\n  num_attention_heads: 6\n  hidden_size: 96\nparallel:\n  tensor_model_parallel_size: 4\n")
    assert "parallel.tensor_model_parallel_size: 4 does not divide model.num_attention_heads=6" in message


def test_zero_2_and_3_refused_with_pipeline_parallel(tmp_path):
    for stage in (2, 3):
        message = _error(tmp_path, f"parallel:\n  pipeline_model_parallel_size: 2\n  zero_stage: {stage}\n")
        assert message.split(": ", 1)[1].startswith("parallel.zero_stage: ZeRO-")


def test_batch_arithmetic_checked_against_world_size():
    cfg = config_from_dict({"train": {"micro_batch_size": 4, "global_batch_size": 8}})
    assert derive(cfg, world_size=2, tokenizer_vocab_size=100).gradient_accumulation_steps == 1
    assert derive(cfg, world_size=1, tokenizer_vocab_size=100).gradient_accumulation_steps == 2
    with pytest.raises(ConfigError, match="train.global_batch_size: 8 is not a multiple of micro_batch_size x data-parallel size = 4 x 4"):
        derive(cfg, world_size=4, tokenizer_vocab_size=100)
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        config_from_dict({"train": {"micro_batch_size": 3, "global_batch_size": 8}})


def test_world_size_must_fit_model_parallel():
    cfg = config_from_dict({"parallel": {"tensor_model_parallel_size": 2}})
    with pytest.raises(ConfigError, match="world size 3 is not a multiple of tensor x pipeline = 2"):
        derive(cfg, world_size=3, tokenizer_vocab_size=100)


def test_overrides_are_parsed_as_yaml(tmp_path):
    cfg = load_config(_write(tmp_path, "name: x\n"), ["optimizer.lr=2e-4", "train.train_steps=17", "model.preset=small"])
    assert cfg.optimizer.lr == pytest.approx(2e-4) and cfg.train.train_steps == 17
    assert cfg.model.hidden_size == MODEL_PRESETS["small"]["hidden_size"]


def test_preset_fields_can_be_overridden(tmp_path):
    cfg = load_config(_write(tmp_path, "model:\n  preset: small\n  num_layers: 3\n"))
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 768


def test_unknown_preset(tmp_path):
    assert "model.preset: unknown preset 'huge'" in _error(tmp_path, "model:\n  preset: huge\n")


def test_duplicate_key_and_bad_yaml_are_one_line(tmp_path):
    assert "duplicate key" in _error(tmp_path, "name: a\nname: b\n")
    assert "invalid YAML" in _error(tmp_path, "model: [unclosed\n")


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/run.yaml")


def test_yaml_12_floats_but_strings_stay_strings():
    data = parse_yaml_text("a: 1e-3\nb: 3E5\nc: .5\nd: '1e-3'\ne: 12\nf: abc\n")
    assert data == {"a": 1e-3, "b": 3e5, "c": 0.5, "d": "1e-3", "e": 12, "f": "abc"}


def test_vocab_padding_divisible_by_tensor_parallel():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 8) % (128 * 8) == 0
    assert pad_vocab_size(1024, 128, 2) == 1024


def test_mixture_weight_must_be_positive(tmp_path):
    text = "data:\n  mixture:\n    - {manifest: a/manifest.json, weight: 2}\n    - {manifest: b/manifest.json, weight: 0}\n"
    assert "data.mixture[1].weight: must be > 0 (got 0.0)" in _error(tmp_path, text)


def test_mixture_entry_unknown_key(tmp_path):
    text = "data:\n  mixture:\n    - {manifest: a/manifest.json, wieght: 2}\n"
    assert "data.mixture[0].wieght: unknown key" in _error(tmp_path, text)


def test_mixture_and_manifest_are_exclusive(tmp_path):
    text = "data:\n  manifest: m.json\n  mixture:\n    - {manifest: a/manifest.json}\n"
    assert "data.mixture: set either data.manifest or data.mixture" in _error(tmp_path, text)


def test_share_omega_across_heads_is_a_strict_bool(tmp_path):
    head = "model:\n  architecture: ascender\n  preset: debug\n"
    text = head + "  ascender:\n    share_omega_across_heads: {}\n"
    assert load_config(_write(tmp_path, text.format("true"))).model.ascender.share_omega_across_heads is True
    assert load_config(_write(tmp_path, head)).model.ascender.share_omega_across_heads is False
    message = _error(tmp_path, text.format("1"))
    assert "model.ascender.share_omega_across_heads: expected bool" in message
    message = _error(tmp_path, text.format("shared"))
    assert "model.ascender.share_omega_across_heads: expected bool" in message
