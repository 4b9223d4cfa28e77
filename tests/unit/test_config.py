"""Strict config loading: every shipped YAML validates; bad YAML fails in one line naming the field."""

from pathlib import Path

import pytest

from ascender_dist.config import ConfigError, load_config, validate
from ascender_dist.config.loader import dump_yaml, parse_yaml_text, to_dict
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


def test_bf16_needs_zero_1_or_more(tmp_path):
    """DeepSpeed's ZeRO-0 has no fp32 gradient accumulation for bf16 (its sanity check raises at
    start-up); refused at load instead, ZeRO-1 with bf16 is fine."""
    message = _error(tmp_path, "train:\n  precision: bf16\nparallel:\n  zero_stage: 0\n")
    assert message.split(": ", 1)[1].startswith("parallel.zero_stage: 0 with train.precision bf16")
    config_from_dict({"train": {"precision": "bf16"}, "parallel": {"zero_stage": 1}})


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
    with pytest.raises(ConfigError, match="world size 3 is not a multiple of tensor x pipeline = 2 x 1"):
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
    # named by its dotted path, however deep
    assert "run.yaml: model.ascender.k: duplicate key (line 4)" in _error(
        tmp_path, "model:\n  ascender:\n    k: 8\n    k: 16\n")
    assert "data.mixture[1].weight: duplicate key" in _error(
        tmp_path, "data:\n  mixture:\n    - {manifest: a.json}\n    - {manifest: b.json, weight: 1, weight: 2}\n")
    assert "invalid YAML" in _error(tmp_path, "model: [unclosed\n")


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/run.yaml")


def test_yaml_12_floats_but_strings_stay_strings():
    data = parse_yaml_text("a: 1e-3\nb: 3E5\nc: .5\nd: '1e-3'\ne: 12\nf: abc\n")
    assert data == {"a": 1e-3, "b": 3e5, "c": 0.5, "d": "1e-3", "e": 12, "f": "abc"}
    data = parse_yaml_text("a: -7\nb: 1_000\nc: 0\nd: 1.0e+20\ne: -.inf\n")
    assert data == {"a": -7, "b": 1000, "c": 0, "d": 1e20, "e": float("-inf")}


@pytest.mark.parametrize("text,expected", [
    ("model:\n  num_layers: 010\n", "model.num_layers: expected int, got str '010'"),  # YAML 1.1: octal 8
    ("train:\n  train_steps: 1:30\n", "train.train_steps: expected int, got str '1:30'"),  # YAML 1.1: 90
    ("model:\n  hidden_size: 0x40\n", "model.hidden_size: expected int, got str '0x40'"),
    ("optimizer:\n  lr: 1:30.5\n", "optimizer.lr: expected float, got str '1:30.5'"),
])
def test_yaml_11_number_forms_are_not_numbers(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


@pytest.mark.parametrize("text,expected", [
    ("model:\n  ascender:\n    lambda_align: .nan\n", "model.ascender.lambda_align: must be a finite number (got nan)"),
    ("model:\n  ascender:\n    omega_init: -.inf\n", "model.ascender.omega_init: must be a finite number (got -inf)"),
    ("model:\n  ascender:\n    delta_init: .nan\n", "model.ascender.delta_init: must be a finite number"),
    ("model:\n  connection:\n    threshold: .nan\n", "model.connection.threshold: must be a finite number"),
    ("model:\n  connection:\n    connection_init_scale: .inf\n", "model.connection.connection_init_scale: must be a fin"),
])
def test_every_float_field_must_be_finite(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


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


# ----------------------------------------------------------------------------- bad input (audit B)
def test_list_valued_preset_and_architecture_are_one_line(tmp_path):
    assert "model.preset: expected str, got list ['small']" in _error(tmp_path, "model:\n  preset: [small]\n")
    message = _error(tmp_path, "model:\n  architecture: [gpt]\n  preset: small\n")
    assert "model.architecture: expected str, got list ['gpt']" in message
    message = _error(tmp_path, "name: x\n", ["model.preset=[a]"])
    assert message.startswith("--set model.preset=[a]: model.preset: expected str")


def test_mixture_entry_without_manifest_names_the_field(tmp_path):
    message = _error(tmp_path, "data:\n  mixture:\n    - weight: 1.0\n")
    assert message.endswith("data.mixture[0].manifest: required field missing")
    assert "data.mixture[0].manifest: must name" in _error(tmp_path, "data:\n  mixture:\n    - {manifest: ''}\n")


@pytest.mark.parametrize("text,expected", [
    ("name: !!int abc\n", "invalid YAML value (ValueError"),        # an explicit tag PyYAML cannot build
    ("optimizer:\n  lr: !!float x\n", "invalid YAML value (ValueError"),
    ("name: !!timestamp nope\n", "invalid YAML value"),
    ("model: &x {ascender: *x}\n", "model.ascender: recursive alias"),
    ("data:\n  mixture: &m [*m]\n", "data.mixture[0]: recursive alias"),
])
def test_yaml_values_pyyaml_cannot_build_are_one_line(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


def test_dates_stay_strings_and_merge_keys_work():
    assert parse_yaml_text("name: 2024-13-45\n") == {"name": "2024-13-45"}  # YAML 1.1 read a date: ValueError
    assert parse_yaml_text("b: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n") == {"b": {"x": 1}, "c": {"x": 1, "y": 2}}


def _alias_levels(levels: int) -> str:
    """``levels`` levels of ten aliases each of the level below: 10^levels paths from the last to the first."""
    return "a0: &a0 [1, 2]\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n"
                                        for i in range(1, levels + 1))


def test_nested_aliases_are_checked_in_linear_time(monkeypatch):
    """Seven levels of ten aliases each: checking (or building) every path would visit 10^7 nodes. Counted,
    not timed: the duplicate-key check and PyYAML's constructor each visit a number of nodes that grows by
    the same amount per level (linear in the file), and the document is still built correctly."""
    import yaml

    from ascender_dist.config import loader

    visits = {"check": 0, "build": 0}
    check, build = loader._reject_duplicate_keys, yaml.constructor.BaseConstructor.construct_object

    def counted_check(*args, **kwargs):  # the recursion calls the module global: every node it visits counts
        visits["check"] += 1
        return check(*args, **kwargs)

    def counted_build(self, node, deep=False):
        visits["build"] += 1
        return build(self, node, deep)

    monkeypatch.setattr(loader, "_reject_duplicate_keys", counted_check)
    monkeypatch.setattr(loader._StrictLoader, "construct_object", counted_build)
    counts = []
    for levels in range(1, 8):
        visits.update(check=0, build=0)
        doc = parse_yaml_text(_alias_levels(levels))
        counts.append((visits["check"], visits["build"]))
        assert doc["a1"] == [[1, 2]] * 10 and len(doc) == levels + 1
    steps = {(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts, counts[1:])}
    assert len(steps) == 1, counts  # the same number of extra visits per level: linear, not 10x per level
    (check_step, build_step), (check_7, build_7) = steps.pop(), counts[-1]
    assert 0 < check_step <= 20 and 0 < build_step <= 20 and check_7 < 200 and build_7 < 200, counts


def test_written_configs_read_back_unchanged(tmp_path):
    """A string that YAML 1.2 reads as a number ('3e-4') is quoted when the project writes a config."""
    cfg = load_config(_write(tmp_path, "name: '3e-4'\ndata:\n  tokenizer: '1_000'\n"))
    again = load_config(_write(tmp_path, dump_yaml(to_dict(cfg))))
    assert to_dict(again) == to_dict(cfg) and again.name == "3e-4"


@pytest.mark.parametrize("text,expected", [
    ("train:\n  seed: 18446744073709551616\n", "train.seed: must be in [0, 2**63"),
    ("train:\n  seed: -1\n", "train.seed: must be in [0, 2**63"),
    ("parallel:\n  distributed_timeout_minutes: 99999999999999\n", "parallel.distributed_timeout_minutes: must be <="),
])
def test_integers_a_library_cannot_hold_are_refused(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


def test_a_fifo_or_device_is_not_a_config_file_and_a_missing_one_is_not_found(tmp_path):
    """/dev/null or a FIFO was reported as 'config file not found', although it exists."""
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null")):
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == f"{path}: not a regular file"
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: config file not found"


def test_a_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        load_config(tmp_path)


def test_complex_yaml_key_and_non_utf8_file(tmp_path):
    assert "line 1: mapping keys must be plain names" in _error(tmp_path, "? [a, b]\n: 1\n")
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: not a UTF-8 text file")


def test_override_errors_name_the_override(tmp_path):
    message = _error(tmp_path, "name: x\n", ["optimizer.lr=-1"])
    assert message == "--set optimizer.lr=-1: optimizer.lr: must be > 0 (got -1.0)"
    assert _error(tmp_path, "name: x\n", ["parallel=5"]).startswith("--set parallel=5: parallel: expected a mapping")
    assert "override must look like dotted.key=value" in _error(tmp_path, "name: x\n", ["a..b=1"])
    # an error about a field the YAML set still names the YAML file
    message = _error(tmp_path, "optimizer:\n  min_lr: 5.0\n", ["train.train_steps=20"])
    assert message.startswith(str(tmp_path / "run.yaml") + ": optimizer.min_lr")


MIXTURE = "name: x\ndata:\n  mixture:\n    - {manifest: a/manifest.json, weight: 2}\n    - {manifest: b/manifest.json}\n"


def test_a_list_item_can_be_overridden_by_its_index(tmp_path):
    cfg = load_config(_write(tmp_path, MIXTURE), ["data.mixture[1].weight=0.25", "data.mixture[0].manifest=c/m.json"])
    assert [(m.manifest, m.weight) for m in cfg.data.mixture] == [("c/m.json", 2.0), ("b/manifest.json", 0.25)]
    cfg = load_config(_write(tmp_path, MIXTURE), ["data.mixture[1]={weight: 3}"])  # a mapping merges into the item
    assert (cfg.data.mixture[1].manifest, cfg.data.mixture[1].weight) == ("b/manifest.json", 3.0)


@pytest.mark.parametrize("override,expected", [
    ("data.mixture[2].weight=1", "--set data.mixture[2].weight=1: data.mixture has 2 item(s): there is no item [2]"),
    ("data.manifest[0]=x", "--set data.manifest[0]=x: the config has no list data.manifest (add it in the file)"),
    ("name[0]=x", "--set name[0]=x: name is not a list here (got 'x')"),
    ("data.mixture.weight=1", "--set data.mixture.weight=1: data.mixture is not a mapping here"),
    ("data.mixture[1].weight=0", "--set data.mixture[1].weight=0: data.mixture[1].weight: must be > 0 (got 0.0)"),
    ("data.mixture[1].wieght=1", "--set data.mixture[1].wieght=1: data.mixture[1].wieght: unknown key"),
    ("data.mixture[-1].weight=1", "--set data.mixture[-1].weight=1: override must look like dotted.key=value (a list item: dotted.key[i].field=value)"),
    ("data.mixture[x]=1", "--set data.mixture[x]=1: override must look like dotted.key=value (a list item: dotted.key[i].field=value)"),
])
def test_a_bad_list_item_override_is_one_line_naming_it(tmp_path, override, expected):
    message = _error(tmp_path, MIXTURE, [override])
    assert message.startswith(expected) and "\n" not in message, message


def test_an_override_leaves_the_read_config_as_it_was():
    from ascender_dist.config.loader import apply_override

    tree = {"data": {"mixture": [{"manifest": "a", "weight": 1.0}]}, "train": {"seed": 1}}
    out = apply_override(apply_override(tree, "data.mixture[0].weight=2"), "train.seed=3")
    assert tree == {"data": {"mixture": [{"manifest": "a", "weight": 1.0}]}, "train": {"seed": 1}}
    assert out == {"data": {"mixture": [{"manifest": "a", "weight": 2}]}, "train": {"seed": 3}}


@pytest.mark.parametrize("text,expected", [
    ("model:\n  vocab_size: -5\n", "model.vocab_size: must be >= 1, or null/0"),
    ("model:\n  ffn_hidden_size: -4\n", "model.ffn_hidden_size: must be >= 1"),
    ("model:\n  init_method_std: .nan\n", "model.init_method_std: must be a finite number"),
    ("model:\n  init_method_std: -0.1\n", "model.init_method_std: must be > 0"),
    ("model:\n  layernorm_epsilon: 0\n", "model.layernorm_epsilon: must be > 0"),
    ("model:\n  rotary_base: -1\n", "model.rotary_base: must be >= 1"),
    ("optimizer:\n  weight_decay: -1\n", "optimizer.weight_decay: must be >= 0"),
    ("optimizer:\n  eps: -1e-8\n", "optimizer.eps: must be > 0"),
    ("optimizer:\n  eps: 0\n", "optimizer.eps: must be > 0"),  # AdamW: 0/0 where a gradient is exactly 0
    ("optimizer:\n  lr: 1" + "0" * 400 + "\n", "optimizer.lr: must be a finite number (got an integer of 401 digits)"),
    ("model:\n  hidden_size: 60\n  num_attention_heads: 4\n",
     "model.num_attention_heads: hidden_size / num_attention_heads must be even for rope"),
    ("model:\n  seq_length: 33\nparallel:\n  tensor_model_parallel_size: 2\n  sequence_parallel: true\n",
     "parallel.sequence_parallel: needs model.seq_length (33) divisible by tensor_model_parallel_size (2)"),
    ("optimizer:\n  grad_clip: -5\n", "optimizer.grad_clip: must be >= 0"),
    ("optimizer:\n  grad_clip: .nan\n", "optimizer.grad_clip: must be a finite number"),
    ("optimizer:\n  lr: .inf\n", "optimizer.lr: must be a finite number"),
    ("optimizer:\n  lr: .nan\n", "optimizer.lr: must be a finite number"),
    ("train:\n  loss_spike_factor: .nan\n", "train.loss_spike_factor: must be a finite number"),
    ("train:\n  eval_iters: 0\n  eval_interval: 5\n", "train.eval_iters: must be >= 1"),
    ("train:\n  eval_interval: -1\n", "train.eval_interval: must be >= 0"),
    ("train:\n  max_rollbacks: -1\n", "train.max_rollbacks: must be >= 0"),
    ("checkpoint:\n  keep_last: -1\n", "checkpoint.keep_last: must be >= 1"),
    ("checkpoint:\n  keep_last: 0\n", "checkpoint.keep_last: must be >= 1"),
    ("checkpoint:\n  save_interval: -5\n", "checkpoint.save_interval: must be >= 0"),
    ("logging:\n  peak_tflops_per_device: 0\n", "logging.peak_tflops_per_device: must be > 0"),
    ("data:\n  mixture:\n    - {manifest: a.json, weight: .inf}\n", "data.mixture[0].weight: must be a finite"),
    ("data:\n  url_template: 'pipe:cat {nam}'\n", "data.url_template: must contain {name}"),
    ("data:\n  url_template: 'pipe:cat {name'\n", "data.url_template:"),
    ("data:\n  url_template: 'pipe:cat data.tar'\n", "data.url_template: must contain {name}"),
    ("data:\n  mixture:\n    - {manifest: a.json, url_template: 'pipe:cat a.tar'}\n",
     "data.mixture[0].url_template: must contain {name}"),
], ids=lambda v: v.split(":")[0] if v.startswith(("model.", "optimizer.", "train.", "checkpoint.", "logging.", "data.")) else None)
def test_numeric_ranges_are_named_checks(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


def test_zero_means_off_or_from_tokenizer(tmp_path):
    cfg = load_config(_write(tmp_path, "model:\n  vocab_size: 0\ntrain:\n  eval_interval: 0\ncheckpoint:\n"
                                       "  save_interval: 0\noptimizer:\n  grad_clip: 0\n  weight_decay: 0\n"
                                       "data:\n  url_template: 'pipe:cat s3/{name} -'\n"))
    assert derive(cfg, 1, tokenizer_vocab_size=100).padded_vocab_size == 128  # 0 acts like null


def test_attention_dropout_is_refused_when_no_layer_applies_it(tmp_path):
    """Connection layers have no attention dropout: with a pattern of only 'C' layers the value was
    accepted and recorded, and no layer used it."""
    text = ("model:\n  architecture: connection\n  seq_length: 64\n  layer_pattern: {}\n  attention_dropout: 0.1\n"
            "  connection:\n    causal_chunk_size: 16\n")
    assert _error(tmp_path, text.format("C")) == (f"{tmp_path / 'run.yaml'}: model.attention_dropout: Connection "
                                                  "layers have no attention dropout (it applies to 'A' layers only, "
                                                  "and the pattern has none); set 0.0")
    assert load_config(_write(tmp_path, text.format("AC"))).model.attention_dropout == 0.1  # the A layers use it


def test_ascender_attention_dropout_follows_the_same_rule(tmp_path):
    """ASCender refused attention dropout whenever an 'S' layer was present, even when 'A' layers
    apply it (Connection allowed the same mix)."""
    text = "model:\n  preset: debug\n  architecture: ascender\n  layer_pattern: {}\n  attention_dropout: 0.1\n"
    assert _error(tmp_path, text.format("S")) == (f"{tmp_path / 'run.yaml'}: model.attention_dropout: ASCender "
                                                  "attention has no attention dropout (it applies to 'A' layers only, "
                                                  "and the pattern has none); set 0.0")
    assert load_config(_write(tmp_path, text.format("AS"))).model.attention_dropout == 0.1


def test_an_empty_layer_pattern_is_refused_not_the_default(tmp_path):
    """`--set model.layer_pattern=$P` with P unset trained the architecture's default pattern."""
    text = "model:\n  preset: debug\n  architecture: ascender\n  layer_pattern: '{}'\n"
    for empty in ("", " "):
        assert _error(tmp_path, text.format(empty)) == (f"{tmp_path / 'run.yaml'}: model.layer_pattern: is empty; "
                                                        "leave it out (or null) for the architecture's default 'S'")


def test_connection_chunk_must_leave_a_reasoned_prefix(tmp_path):
    """One causal chunk per sequence: every token would read only the bare slots, never a reasoned
    state. The bare defaults (seq_length 128, causal_chunk_size 128) are such a model; every preset
    sets a chunk below its context."""
    text = "model:\n  architecture: connection\n  seq_length: 64\n  connection:\n    causal_chunk_size: {}\n"
    message = _error(tmp_path, text.format(64))
    assert "run.yaml: model.connection.causal_chunk_size: must be < model.seq_length (64; got 64)" in message
    validate(load_config(_write(tmp_path, text.format(32))))
    assert "must be < model.seq_length (128; got 128)" in _error(tmp_path, "model:\n  architecture: connection\n")
    for preset in MODEL_PRESETS:
        validate(load_config(_write(tmp_path, f"model:\n  architecture: connection\n  preset: {preset}\n")))


def test_a_mixed_layer_pattern_gets_every_kinds_preset_fields():
    from ascender_dist.config.presets import ARCHITECTURE_PRESETS

    large_asc, large_conn = ARCHITECTURE_PRESETS["ascender"]["large"], ARCHITECTURE_PRESETS["connection"]["large"]
    by_connection = config_from_dict({"model": {"preset": "large", "architecture": "connection", "layer_pattern": "SC"}})
    by_ascender = config_from_dict({"model": {"preset": "large", "architecture": "ascender", "layer_pattern": "SC"}})
    for cfg in (by_connection, by_ascender):  # the same model whichever architecture names it
        assert cfg.model.ascender.d_z == large_asc["ascender"]["d_z"] and cfg.model.ascender.k == large_asc["ascender"]["k"]
        assert cfg.model.connection.rank == large_conn["connection"]["rank"]
        assert cfg.model.connection.causal_chunk_size == large_conn["connection"]["causal_chunk_size"]
    # debug: the ASCender fields fit the 16-wide heads (the defaults, d_z = 32, were refused)
    cfg = config_from_dict({"model": {"preset": "debug", "architecture": "gpt", "layer_pattern": "AS"}})
    assert cfg.model.ascender.d_z == ARCHITECTURE_PRESETS["ascender"]["debug"]["ascender"]["d_z"]
    # a pure-GPT pattern gets neither kind's fields changed from their defaults
    plain = config_from_dict({"model": {"preset": "large", "architecture": "gpt"}})
    assert plain.model.ascender.d_z != large_asc["ascender"]["d_z"]


def test_warmups_that_a_run_never_finishes_are_named():
    from ascender_dist.config.architectures import unreached_warmups

    def lines(**ascender):
        cfg = config_from_dict({"model": {"architecture": "ascender", "ascender": {"d_z": 8, "d_a": 8, **ascender}},
                                "train": {"train_steps": 20}})
        return unreached_warmups(cfg)

    assert lines(separation_start_step=19, aux_start_step=0, aux_compactness_weight=0.1) == []
    (line,) = lines(separation_start_step=20)
    assert line.startswith("model.ascender.separation_start_step = 20 >= train.train_steps = 20")
    assert lines(separation_start_step=50, use_sep=False) == []  # off anyway: nothing to warn about
    assert lines(aux_start_step=30, aux_compactness_weight=0.0, aux_crowding_weight=0.0,
                 aux_alignment_weight=0.0) == []
    assert [s.split(" ")[0] for s in lines(aux_start_step=30, aux_crowding_weight=0.1, separation_start_step=0)] == [
        "model.ascender.aux_start_step"]
    gpt = config_from_dict({"model": {"architecture": "gpt"}, "train": {"train_steps": 20}})
    assert unreached_warmups(gpt) == []
    # the learning rate's warm-up longer than the run (a smoke run of a scaling config: `--set
    # train.train_steps=20` was refused there): the ramp lr * s / W runs to the end, logged
    short = config_from_dict({"model": {"architecture": "gpt"}, "train": {"train_steps": 20},
                              "optimizer": {"lr": 3e-4, "warmup_steps": 41}})
    assert unreached_warmups(short) == [
        "optimizer.warmup_steps = 41 > train.train_steps = 20: the learning rate never reaches optimizer.lr = 0.0003 "
        "in this run"]
    # validation only every 25 steps of a 20-step run: none (the run gave no val/loss, silently)
    unvalidated = config_from_dict({"model": {"architecture": "gpt"}, "train": {"train_steps": 20, "eval_interval": 25}})
    assert unreached_warmups(unvalidated) == ["train.eval_interval = 25 > train.train_steps = 20: no periodic "
                                              "validation in this run (no val/loss curve)"]
    # settings of a layer kind the pattern lacks (often a base config's): named, not an error
    unread = config_from_dict({"model": {"architecture": "gpt", "ascender": {"k": 8}, "connection": {"rank": 9}},
                               "train": {"train_steps": 20}})
    assert unreached_warmups(unread) == [
        "model.ascender.k = 8: no effect, no ASCender layer ('S') in the layer pattern AA",
        "model.connection.rank = 9: no effect, no Connection layer ('C') in the layer pattern AA"]
    linear = config_from_dict({"model": {"architecture": "connection", "preset": "debug",
                                         "connection": {"connection": "linear"}}, "train": {"train_steps": 20}})
    assert unreached_warmups(linear) == []  # the preset's rank under linear: not the user's, not logged


# ----------------------------------------------------------------------------- boundaries found unpinned
@pytest.mark.parametrize("text,path", [
    ("train:\n  micro_batch_size: true\n", "train.micro_batch_size"),
    ("model:\n  vocab_size: true\n", "model.vocab_size"),  # Optional[int]: the inner int refuses it too
])
def test_a_bool_is_not_an_int(tmp_path, text, path):
    """YAML `true` is a Python int subclass: without the bool guard `micro_batch_size: true` trained
    with a micro-batch of 1 and `vocab_size: true` with one token, no error."""
    message = _error(tmp_path, text)
    assert f"{path}: expected int" in message and "True" in message


def test_an_override_value_may_hold_an_equals_sign():
    """Only the first '=' separates the key: a URL template with a query string (?a=b) is the value."""
    from ascender_dist.config.loader import apply_override

    assert apply_override({}, "data.url_template=a?b=c") == {"data": {"url_template": "a?b=c"}}
    assert apply_override({}, "name=x=y=z") == {"name": "x=y=z"}


@pytest.mark.parametrize("path", [
    "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.seq_length",
    "train.micro_batch_size", "train.global_batch_size", "train.train_steps",
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "model.make_vocab_size_divisible_by", "logging.log_interval", "parallel.distributed_timeout_minutes",
])
def test_a_size_of_zero_is_refused_by_name(tmp_path, path):
    """0 is the boundary: a size of 0 passed on to a ZeroDivisionError or an empty model deep inside
    the build, instead of one line naming the field."""
    section, name = path.split(".")
    assert _error(tmp_path, f"{section}:\n  {name}: 0\n") == f"{tmp_path / 'run.yaml'}: {path}: must be >= 1 (got 0)"


@pytest.mark.parametrize("text,expected", [
    ("optimizer:\n  beta1: 1.0\n", "optimizer.beta1: must be in [0, 1) (got 1.0)"),  # Adam's bias correction 1/(1-1)
    ("optimizer:\n  beta2: 1.0\n", "optimizer.beta2: must be in [0, 1) (got 1.0)"),
    ("model:\n  hidden_dropout: 1.0\n", "model.hidden_dropout: must be in [0, 1) (got 1.0)"),  # drops everything
    ("model:\n  attention_dropout: 1.0\n", "model.attention_dropout: must be in [0, 1) (got 1.0)"),
    # 1.0: every step above the running mean would skip
    ("train:\n  loss_spike_factor: 1.0\n", "train.loss_spike_factor: must be 0 (off) or > 1 (got 1.0)"),
    ("train:\n  seed: 9223372036854775000\n", "train.seed: must be in [0, 2**63 - 2**20)"),  # megatron adds offsets
    ("data:\n  url_template: 'pipe:cat {name}.{x}'\n", "data.url_template: must contain {name} (the shard file name) "
                                                         "and no other field"),
    ("data:\n  url_template: '{name}{0}'\n", "data.url_template: must contain {name} (the shard file name) and no "
                                              "other field"),
    # a format spec or conversion failed per shard ({name:d}), quoted the name ({name!r}) or padded it
    # with characters the shard-name rule keeps out of a pipe: command ({name:;<60})
    ("data:\n  url_template: 'file:///x/{name:d}'\n", "data.url_template: {name} takes no format spec or conversion"),
    ("data:\n  url_template: 'file:///x/{name!r}'\n", "data.url_template: {name} takes no format spec or conversion"),
    ("data:\n  url_template: 'pipe:cat {name:;<60}'\n", "data.url_template: {name} takes no format spec or "
                                                         "conversion"),
    ("data:\n  mixture:\n    - manifest: m.json\n      url_template: '{name!s}'\n",
     "data.mixture[0].url_template: {name} takes no format spec or conversion"),
], ids=lambda v: v.split(":")[0] if isinstance(v, str) and not v.endswith("\n") else None)
def test_the_edge_values_of_ranges_are_refused(tmp_path, text, expected):
    """Each bound is exactly where the check says: the first value outside it is refused by name (a
    second field in a URL template is a KeyError per shard at load time, not one line at start-up)."""
    assert expected in _error(tmp_path, text)


@pytest.mark.parametrize("field", ["checkpoint.init_from", "checkpoint.dir", "output_dir"])
@pytest.mark.parametrize("blank", [" ", "\t"])
def test_a_blank_path_is_as_empty_as_an_empty_one(tmp_path, field, blank):
    """`--set checkpoint.init_from="$W "` with W unset is only whitespace: no file of that name is
    meant, and the run would otherwise train from random weights or write into the default folder."""
    import json

    *sections, name = field.split(".")
    value = json.dumps(blank)  # a YAML double-quoted string: " " or "\\t"
    text = f"{sections[0]}:\n  {name}: {value}\n" if sections else f"{name}: {value}\n"
    assert f"{field}: is empty ({blank!r})" in _error(tmp_path, text)


@pytest.mark.parametrize("field", ["output_dir", "checkpoint.dir", "checkpoint.init_from", "data.manifest",
                                   "data.tokenizer"])
def test_a_path_starting_with_a_tilde_is_refused_not_made_a_directory_named_tilde(tmp_path, field):
    """output_dir=~/run (YAML or --set: no shell expands it) made a directory literally named '~' in
    the working directory; a later `rm -rf ~` to clean it up would remove the home directory."""
    *sections, name = field.split(".")
    text = f"{sections[0]}:\n  {name}: ~/run\n" if sections else f"{name}: ~/run\n"
    assert f"{field}: '~/run' starts with '~', which is not expanded here: write the full path" in _error(tmp_path, text)


def test_a_tilde_set_on_the_command_line_names_the_override_and_a_saved_config_still_reads(tmp_path):
    """The check is on what a user writes: an older run's saved config.yaml with output_dir: ~/run
    (made before the check) must still be read by consolidate, evaluate and reshard."""
    message = _error(tmp_path, "name: x\n", ["output_dir=~/run"])
    assert message == ("--set output_dir=~/run: output_dir: '~/run' starts with '~', which is not expanded here: "
                       "write the full path")
    assert config_from_dict({"output_dir": "~/run"}).output_dir == "~/run"


def test_wandb_offline_without_a_project_is_refused(tmp_path):
    """Accepted before and without effect: W&B without a project logs nothing."""
    assert ("logging.wandb.project: must be set when logging.wandb.mode is 'offline'"
            in _error(tmp_path, "logging:\n  wandb:\n    mode: offline\n"))


def test_a_setting_that_does_nothing_here_is_logged_not_refused():
    """A constant schedule has no floor and learned positions no rotary base; both values often come
    from a base config (a grid variant switching the schedule or the positions), so they are legal."""
    from ascender_dist.config.architectures import unreached_warmups

    constant = config_from_dict({"optimizer": {"lr_schedule": "constant", "min_lr": 1e-5}})
    assert unreached_warmups(constant) == ["optimizer.min_lr = 1e-05 has no effect: lr_schedule constant stays "
                                           "at optimizer.lr"]
    assert unreached_warmups(config_from_dict({"optimizer": {"lr_schedule": "constant"}})) == []
    learned = config_from_dict({"model": {"position_embedding_type": "learned_absolute", "rotary_base": 500000}})
    assert unreached_warmups(learned) == ["model.rotary_base = 500000 has no effect: the positions are "
                                          "learned_absolute"]


def test_a_constant_schedule_below_the_default_floor_is_not_refused_for_it(tmp_path):
    """The default min_lr (3e-5) is no floor of a constant schedule: lr 1e-5 was refused for it."""
    from ascender_dist.config.resolve import config_from_dict

    assert config_from_dict({"optimizer": {"lr": 1e-5, "lr_schedule": "constant"}}).optimizer.lr == 1e-5


@pytest.mark.parametrize("architecture,expected", [
    ("ascender", "model.ascender.d_z: must be <= head dim 16 (got 32) (no model.preset is set"),
    ("connection", "model.connection.causal_chunk_size: must be < model.seq_length (128; got 128)"),
])
def test_an_architecture_without_a_preset_says_why_its_defaults_do_not_fit(tmp_path, architecture, expected):
    """`model: {architecture: ascender}` was refused for a field the user never wrote."""
    message = _error(tmp_path, f"model:\n  architecture: {architecture}\n")
    assert expected in message and "choose a preset, e.g. model.preset: debug" in message
    assert "no model.preset" not in _error(tmp_path, f"model:\n  architecture: {architecture}\n  preset: debug\n"
                                                     "  seq_length: 0\n")
    # sizes written out: the refusal is about them, not about a missing preset
    sized = _error(tmp_path, "model:\n  architecture: ascender\n  hidden_size: 256\n  ascender:\n    d_z: 128\n")
    assert "model.ascender.d_z: must be <= head dim 64 (got 128)" in sized and "no model.preset" not in sized
