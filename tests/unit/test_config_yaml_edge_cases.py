"""YAML edge cases the strict loader must refuse in one line (or read as YAML 1.2 does), never run silently wrong.

Each case here once loaded: a null section dropped the preset's values, ``off`` was a boolean, ``30_`` was 30,
an empty file was the default config, deep nesting was a RecursionError traceback, a huge rotary_base crashed
megatron at model build, and ``name: ..`` put the run's checkpoints outside its own directory.
"""


import pytest

from ascender_dist.config import ConfigError, load_config
from ascender_dist.config.loader import apply_override, dump_yaml, parse_yaml_text, read_yaml_file, to_dict

from tests.unit.test_config import _error, _write


# ------------------------------------------------------------------------------------ null sections

CONNECTION_SMALL = "model:\n  architecture: connection\n  preset: small\n"


@pytest.mark.parametrize("text,overrides,expected", [
    (CONNECTION_SMALL + "  connection:\n    # max_steps: 8\n", (), "run.yaml: model.connection: a section cannot be null"),
    ("model:\n  architecture: ascender\n  preset: large\n  ascender:\n    # k: 8\n", (),
     "run.yaml: model.ascender: a section cannot be null (write {} or remove the key)"),
    ("model:\n  architecture: ascender\n  preset: debug\n", ["model.ascender=null"],
     "--set model.ascender=null: model.ascender: a section cannot be null"),
    ("checkpoint:\n  # keep_last: 2\nname: x\n", (), "run.yaml: checkpoint: a section cannot be null"),
    ("logging:\n  wandb: ~\n", (), "run.yaml: logging.wandb: a section cannot be null"),
], ids=["connection-comment-only", "ascender-comment-only", "set-null", "top-level-section", "tilde"])
def test_a_null_section_is_refused_not_read_as_the_class_defaults(tmp_path, text, overrides, expected):
    """It replaced the preset's section when merged, so the run got the class defaults (rank 32, not 4)."""
    assert expected in _error(tmp_path, text, overrides)


def test_an_empty_mapping_section_keeps_the_presets_values(tmp_path):
    cfg = load_config(_write(tmp_path, CONNECTION_SMALL + "  connection: {}\n"))
    assert cfg.model.connection.rank == 4 and cfg.model.connection.max_steps == 4  # the small preset's


# -------------------------------------------------------------------------------- YAML 1.2 booleans

def test_only_yaml_12_booleans_are_booleans():
    words = ["yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF", "y", "Y", "n", "N"]
    data = parse_yaml_text("".join(f"k{i}: {w}\n" for i, w in enumerate(words)))
    assert list(data.values()) == words
    assert parse_yaml_text("[true, True, TRUE, false, False, FALSE]") == [True] * 3 + [False] * 3
    assert parse_yaml_text("{on: 1, off: 2}") == {"on": 1, "off": 2}  # keys too


@pytest.mark.parametrize("section,key,word", [("checkpoint", "auto_resume", "off"),
                                              ("parallel", "sequence_parallel", "yes")])
def test_a_bool_field_refuses_yaml_11_words(tmp_path, section, key, word):
    expected = f"{section}.{key}: expected bool (true/false), got {word!r}"
    assert expected in _error(tmp_path, f"{section}:\n  {key}: {word}\n")
    assert expected in _error(tmp_path, "name: x\n", [f"{section}.{key}={word}"])


def test_a_yaml_11_word_is_a_string_where_a_string_is_expected(tmp_path):
    assert load_config(_write(tmp_path, "name: no\n")).name == "no"
    cfg = load_config(_write(tmp_path, "name: 'off'\n"))
    assert load_config(_write(tmp_path, dump_yaml(to_dict(cfg)))).name == "off"  # written configs read back


def test_ablation_variants_named_on_and_off_keep_their_names(tmp_path):
    from ascender_dist.research.ablate import load_grid

    path = tmp_path / "grid.yaml"
    path.write_text("name: g\nbase:\n  model: {architecture: gpt, preset: debug, vocab_size: 512}\n"
                    "  train: {micro_batch_size: 2, global_batch_size: 4, train_steps: 5}\n"
                    "  optimizer: {warmup_steps: 1}\nseeds: [1]\nbaseline: off\ncompare_to: [on]\n"
                    "variants:\n  off: {model.architecture: gpt}\n  on: {model.architecture: ascender}\n")
    grid = load_grid(path)
    assert [v.name for v in grid.variants] == ["off", "on"] and grid.baseline == "off"


# ------------------------------------------------------------------------------ digit underscores

def test_an_underscore_only_separates_two_digits():
    good = parse_yaml_text("a: 1_000\nb: -2_5\nc: 1_000.000_5\nd: .5_0\ne: 1_0e3\n")
    assert good == {"a": 1000, "b": -25, "c": 1000.0005, "d": 0.5, "e": 1e4}
    bad = ["30_", "1__0", "1_", "+3_", "1_.5", "1._5", "1.5_", "1_e5", "._5", "1__0.0"]
    assert parse_yaml_text("[" + ", ".join(bad) + "]") == bad


@pytest.mark.parametrize("text,expected", [
    ("train:\n  train_steps: 30_\n", "train.train_steps: expected int, got str '30_'"),
    ("train:\n  train_steps: 1__0\n", "train.train_steps: expected int, got str '1__0'"),
    ("optimizer:\n  lr: 1_.5\n", "optimizer.lr: expected float, got str '1_.5'"),
    ("optimizer:\n  lr: 3.0e-4_\n", "optimizer.lr: expected float, got str '3.0e-4_'"),
], ids=["30_", "1__0", "1_.5", "3.0e-4_"])
def test_a_number_with_a_stray_underscore_is_refused_by_its_field(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


# ------------------------------------------------------------------------------------- empty files

@pytest.mark.parametrize("text", ["", "\n\n", "# a comment only\n", "---\n", "null\n", "~\n"],
                         ids=["empty", "blank-lines", "comment", "document-marker", "null", "tilde"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = _write(tmp_path, text)
    message = _error(tmp_path, text)
    assert message == f"{path}: empty config file (write {{}} to run with every default)"
    with pytest.raises(ConfigError, match="empty config file"):
        read_yaml_file(path)


def test_an_explicit_empty_mapping_is_the_default_config(tmp_path):
    assert load_config(_write(tmp_path, "{}\n")).name == "run"


# ---------------------------------------------------------------------------------- deep nesting

@pytest.mark.parametrize("text", [
    "name: " + "[" * 3000 + "]" * 3000 + "\n",
    "name: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
], ids=["lists", "mappings"])
def test_deeply_nested_yaml_is_one_line_not_a_recursion_error(tmp_path, text):
    assert _error(tmp_path, text) == f"{tmp_path / 'run.yaml'}: invalid YAML: nested too deeply"
    with pytest.raises(ConfigError, match="nested too deeply"):
        apply_override({}, "name=" + text[len("name: "):])


# ----------------------------------------------------------------------------------- rotary_base

def test_rotary_base_beyond_64_bits_is_refused(tmp_path):
    assert "model.rotary_base: must be < 2**63 (got 1" in _error(tmp_path, "model:\n  rotary_base: " + "1" + "0" * 30)
    assert "model.rotary_base: must be < 2**63" in _error(tmp_path, f"model:\n  rotary_base: {2**63}\n")
    assert load_config(_write(tmp_path, f"model:\n  rotary_base: {2**63 - 1}\n")).model.rotary_base == 2**63 - 1


def test_the_largest_rotary_base_allowed_keeps_megatrons_frequencies_finite():
    torch = pytest.importorskip("torch")
    rotary = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    emb = rotary.RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=2**63 - 1,
                                 use_cpu_initialization=True)
    assert torch.isfinite(emb.inv_freq).all() and (emb.inv_freq > 0).all()


# -------------------------------------------------------------------------------------- run name

@pytest.mark.parametrize("text,overrides,expected", [
    ("name: x\n", ["name="], "--set name=: name: must name one directory under runs/ (got '')"),
    ("name: .\n", (), "run.yaml: name: must name one directory under runs/ (got '.')"),
    ("name: '..'\n", (), "name: must name one directory under runs/ (got '..')"),
    ("name: x\n", ["name=../other"], "--set name=../other: name: must not contain a path separator"),
    ("name: team/run\n", (), "run.yaml: name: must not contain a path separator (got 'team/run')"),
], ids=["empty", "dot", "dot-dot", "parent", "slash"])
def test_a_run_name_must_be_one_directory_under_the_runs_root(tmp_path, text, overrides, expected):
    """runs/<name> with name '' or '.' is the shared root; with auto_resume a run would resume another's checkpoint."""
    assert expected in _error(tmp_path, text, overrides)


def test_ordinary_run_names_still_load(tmp_path):
    for name in ("x y", "gpt-small.v2", "...x", "a,b-seed1"):
        assert load_config(_write(tmp_path, "name: x\n"), [f"name={name}"]).name == name


# ------------------------------------------------------------- found in review: sizes, float range, '#', names, signals

@pytest.mark.parametrize("text,expected", [
    ("model:\n  num_layers: 100000000000000000000000\n", "model.num_layers: must be <= 2**16 (got 1"),
    ("model:\n  num_layers: 2000000000\n", "model.num_layers: must be <= 2**16 (got 2000000000)"),
    ("model:\n  seq_length: 100000000000000000000\n", "model.seq_length: must be < 2**31"),
    ("model:\n  make_vocab_size_divisible_by: 10000000000000\n", "model.make_vocab_size_divisible_by: must be < 2**31"),
    ("train:\n  micro_batch_size: 4294967296\n  global_batch_size: 4294967296\n", "train.micro_batch_size: must be < 2**31"),
], ids=["layers-huge", "layers-2e9", "seq", "divisible-by", "micro-batch"])
def test_sizes_beyond_what_the_libraries_index_with_are_one_line(tmp_path, text, expected):
    """They crashed in expand_layer_pattern (OverflowError), or built multi-GB strings for minutes."""
    assert expected in _error(tmp_path, text)


@pytest.mark.parametrize("text,field", [
    ("model:\n  init_method_std: 1.0e39\n", "model.init_method_std"),
    ("model:\n  architecture: ascender\n  ascender:\n    tau_sep: 1.0e39\n", "model.ascender.tau_sep"),
    ("optimizer:\n  lr: -1.0e39\n", "optimizer.lr"),
])
def test_floats_beyond_float32_are_refused(tmp_path, text, field):
    """Finite in float64, inf in the float32 / bf16 tensors they reach (a NaN loss, or a torch error)."""
    assert f"{field}: must be within float32's range, |x| <= 3.4e38" in _error(tmp_path, text)


def test_a_hash_in_an_override_value_must_be_quoted(tmp_path):
    """YAML reads '#' after a space as a comment: the rest of the value was dropped silently."""
    message = _error(tmp_path, "name: x\n", ["name=demo #2"])
    assert message.startswith("--set name=demo #2: '#' starts a YAML comment"), message
    assert "output_dir=#scratch: '#' starts a YAML comment" in _error(tmp_path, "name: x\n", ["output_dir=#scratch"])
    assert load_config(_write(tmp_path, "name: x\n"), ['name="demo #2"']).name == "demo #2"
    assert load_config(_write(tmp_path, "name: x\n"), ["name=a#b"]).name == "a#b"  # not a comment in YAML


def test_nul_and_control_characters_are_refused_in_names_and_paths(tmp_path):
    assert "name: must not contain a NUL character" in _error(tmp_path, 'name: "a\\0b"\n')
    assert "name: must not contain control characters" in _error(tmp_path, 'name: "a\\tb"\n')
    assert "output_dir: must not contain a NUL character" in _error(tmp_path, 'output_dir: "runs/\\0x"\n')


def test_only_stop_signals_are_exit_signals(tmp_path):
    """SIGCHLD arrives whenever a subprocess or loader worker ends: the run would stop at once."""
    message = _error(tmp_path, "train:\n  exit_signals: [SIGTERM, SIGCHLD]\n")
    assert "train.exit_signals: 'SIGCHLD' is not a stop signal; use some of SIGTERM, SIGINT" in message
    assert load_config(_write(tmp_path, "train:\n  exit_signals: [SIGUSR2, SIGHUP]\n")).train.exit_signals == [
        "SIGUSR2", "SIGHUP"]


# ---------------------------------------------- found in review (2026-11-30): bytes, sizes, blame, empty paths

def test_a_control_character_yaml_forbids_is_one_line_naming_the_source(tmp_path):
    """PyYAML's reader refuses them while the loader is built, which was outside the error handling:
    a traceback for ESC pasted from a coloured terminal, from the file or from --set."""
    path = tmp_path / "run.yaml"
    path.write_bytes(b"name: x\ndata:\n  manifest: a\x1b[0mb\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: invalid YAML line 3: the character '\\x1b' is not allowed"
    message = _error(tmp_path, "name: x\n", ["name=x\x01y"])
    assert message == "--set 'name=x\\x01y': invalid YAML line 1: the character '\\x01' is not allowed"


def test_a_value_in_an_error_is_shown_bounded(tmp_path):
    """Eight levels of YAML aliases nine wide (303 bytes) expand to 43 million items: the message
    printed them all (254 MB, 1.5 GB of memory)."""
    levels = ["&a [l, l, l, l, l, l, l, l, l]"] + [
        f"&{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(7)]
    message = _error(tmp_path, "name: [" + ", ".join(levels) + "]\n")
    assert "run.yaml: name: expected str, got list [" in message and len(message) < 1000, len(message)
    assert _error(tmp_path, "name: [1, 2]\n").endswith("expected str, got list [1, 2]")  # short values in full


@pytest.mark.parametrize("override,field", [
    ("optimizer.eps=1e-46", "optimizer.eps"),
    ("model.ascender.kappa_init=1e-46", "model.ascender.kappa_init"),
    ("model.ascender.tau_coh=-1e-40", "model.ascender.tau_coh"),
])
def test_floats_that_float32_rounds_to_zero_or_a_denormal_are_refused(tmp_path, override, field):
    """eps = 1e-46 passed "> 0" and is 0 in float32: NaN weights from step 1, every later step skipped,
    exit 0; kappa_init 1e-46 gave a NaN loss, tau_coh a conversion error inside the fast path."""
    message = _error(tmp_path, "model:\n  architecture: ascender\n", [override])
    assert f"{field}: must be 0 or of magnitude >= 1.2e-38" in message, message
    cfg = load_config(_write(tmp_path, "optimizer:\n  weight_decay: 0.0\n  eps: 1.0e-30\n"))
    assert cfg.optimizer.weight_decay == 0.0 and cfg.optimizer.eps == 1e-30


@pytest.mark.parametrize("override", ["model.ascender.window=100000000000000000000", "model.ascender.k=2147483648",
                                      "model.connection.num_slots=4294967296"])
def test_the_layers_integer_settings_are_bounded_too(tmp_path, override):
    """They passed print-config and overflowed inside the neighbour search at the first step."""
    field = override.split("=")[0]
    arch = field.split(".")[1]
    assert f"{field}: must be < 2**31" in _error(tmp_path, f"model:\n  architecture: {arch}\n", [override])


def test_a_layer_seed_keeps_the_range_a_torch_generator_takes(tmp_path):
    """slot_seed is a seed, not a size: a hashed 64-bit seed (and every run saved with one) stays loadable."""
    text = "model:\n  architecture: connection\n  seq_length: 256\n"
    path = _write(tmp_path, text)
    for seed in (2**31, 3_000_000_000, 2**64 - 1):
        assert load_config(path, [f"model.connection.slot_seed={seed}"]).model.connection.slot_seed == seed
    too_big = _error(tmp_path, text, [f"model.connection.slot_seed={2**64}"])
    assert "model.connection.slot_seed: must be in [-2**63, 2**64)" in too_big, too_big


@pytest.mark.parametrize("field", ["checkpoint.init_from", "checkpoint.dir", "output_dir"])
def test_an_empty_path_is_refused_not_read_as_the_default(tmp_path, field):
    """`--set checkpoint.init_from=$W` with W unset trained from random weights (exit 0)."""
    assert f"--set {field}=: {field}: is empty ('')" in _error(tmp_path, "name: x\n", [f"{field}="])
    assert load_config(_write(tmp_path, "name: x\n"), [f"{field}=null"]) is not None


def test_an_error_only_the_overrides_bring_about_names_them(tmp_path):
    """It named the file alone, which holds no such setting."""
    message = _error(tmp_path, "train:\n  global_batch_size: 32\n  micro_batch_size: 4\n", ["train.micro_batch_size=5"])
    assert ("run.yaml with --set train.micro_batch_size=5: train.global_batch_size: 32 is not a multiple of"
            in message), message
    own = _error(tmp_path, "train:\n  global_batch_size: 30\n  micro_batch_size: 4\n", ["name=x"])
    assert "run.yaml: train.global_batch_size: 30" in own, own  # the file's own error: the file alone


# ------------------------------------------------------------------------ keys a terminal acts on

@pytest.mark.parametrize("text,expected", [
    ('model:\n  "hidden\\nsize": 3\n', "run.yaml: model.hidden\\nsize: unknown key"),
    ('model:\n  "a\\nb": 3\n  "a\\nb": 4\n', "run.yaml: model.a\\nb: duplicate key (line 3)"),
    ('model:\n  "\\e[31m": 3\n', "run.yaml: model.\\x1b[31m: unknown key"),
], ids=["newline", "duplicate-newline", "escape"])
def test_a_key_holding_a_newline_or_escape_stays_one_printable_line(tmp_path, text, expected):
    """A quoted key with a newline split the error over two lines; an escape reached the terminal."""
    message = _error(tmp_path, text)
    assert expected in message and message.isprintable()


def test_a_bare_equals_sign_or_double_angle_value_is_a_string_and_merge_keys_still_merge():
    """YAML 1.1's `value` tag and the merge tag on a value were PyYAML errors naming a tag, no field."""
    assert parse_yaml_text("name: =\nx: <<\n", source="run.yaml") == {"name": "=", "x": "<<"}
    assert parse_yaml_text("a: &A {b: 1}\nc:\n  <<: *A\n  d: 2\n", source="run.yaml")["c"] == {"b": 1, "d": 2}


def test_a_config_path_that_cannot_be_checked_is_one_line(tmp_path):
    """stat() failing otherwise than "not found" (a name too long; a folder this user may not enter)
    was an OSError traceback from Path.is_dir()."""
    path = tmp_path / ("a" * 300 + ".yaml")
    with pytest.raises(ConfigError) as info:
        read_yaml_file(path)
    assert str(info.value) == f"{path}: cannot read (File name too long)"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: cannot read (File name too long)"


# ------------------------------------------------------------------------ who is named for an error

def test_the_files_own_error_names_the_file_even_where_a_set_touches_that_field(tmp_path):
    """The --set was named for an error the file has without it."""
    text = "model:\n  preset: debug\n  hidden_size: 100\n"
    message = _error(tmp_path, text, ["model.num_attention_heads=4"])
    assert message.startswith(str(tmp_path / "run.yaml") + ": "), message
    assert "--set" not in message


def test_a_dotted_key_in_a_file_says_it_is_set_syntax_and_a_typo_gets_the_closest_field(tmp_path):
    assert "a dotted key is --set syntax: in a file, nest it under its section" in _error(
        tmp_path, "model.hidden_size: 64\n")
    assert "model.hiden_size: unknown key (did you mean 'hidden_size'?)" in _error(
        tmp_path, "model:\n  hiden_size: 64\n")


def test_a_preset_chosen_on_the_command_line_that_sets_nothing_is_refused(tmp_path):
    """``--set model.preset=large`` on a config giving every size it sets built the config's
    model under the preset's name, silently; a file naming such a preset stays allowed (the demo's
    preset gives the other architectures' layer sizes)."""
    text = ("model:\n  preset: debug\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n"
            "  ffn_hidden_size: 256\n  seq_length: 128\n")
    assert load_config(_write(tmp_path, text)).model.hidden_size == 64
    message = _error(tmp_path, text, ["model.preset=large"])
    assert message.startswith("--set model.preset=large: model.preset: 'large' sets nothing here"), message
    partial = text.replace("  seq_length: 128\n", "")
    assert load_config(_write(tmp_path, partial), ["model.preset=small"]).model.seq_length == 2048  # small's
    # the same preset set through its section (a review: only the literal key model.preset was checked)
    message = _error(tmp_path, text, ["model={preset: large}"])
    assert "model.preset: 'large' sets nothing here" in message, message


@pytest.mark.parametrize("key", ["name", "output_dir", "checkpoint.dir", "checkpoint.init_from", "data.tokenizer"])
def test_a_path_with_a_name_longer_than_a_file_system_allows_is_one_line(tmp_path, key):
    """Python's Path.exists raises 'File name too long' instead of answering False: a 300-byte name (or
    directory of a path) stopped train / print-config with that traceback at the first file operation
    (found by a review)."""
    long = "a" * 300
    value = long if key == "name" else f"/tmp/{long}/x"
    message = _error(tmp_path, "model:\n  preset: debug\n", [f"{key}={value}"])
    assert f"{key}: has a file or directory name of 300 bytes, over the 255 a file system allows" in message, message
    assert load_config(_write(tmp_path, "model:\n  preset: debug\n"), [f"output_dir=/tmp/{'b' * 255}"])


@pytest.mark.parametrize("key", ["data.shuffle_buffer", "optimizer.warmup_steps", "data.num_workers",
                                 "checkpoint.save_interval"])
def test_counts_a_library_cannot_hold_are_refused_at_load(tmp_path, key):
    """data.shuffle_buffer = 2**63 loaded and failed at the first step (OverflowError in the loader); at
    2**62 + 1 a run saved checkpoints its own resume refused; optimizer.warmup_steps = 10**309 overflowed
    the schedule's float (found by a review)."""
    message = _error(tmp_path, "model:\n  preset: debug\n", [f"{key}={2**62 + 1}"])
    assert f"{key}: must be < 2**31 (got {2**62 + 1})" in message, message


def test_a_config_error_the_trainer_finds_names_the_config_file(tmp_path, monkeypatch, capsys):
    """Checks made once the launch is known (the data-parallel size) raised without the file."""
    from ascender_dist.cli import main
    from ascender_dist.training import preemption, trainer

    def refuse(cfg):
        err = ConfigError("train.global_batch_size", "8 is not a multiple of micro_batch_size x data-parallel "
                                                     "size = 2 x 3")
        err.rank = 0
        raise err

    monkeypatch.setattr(trainer, "Trainer", refuse)
    monkeypatch.setattr(preemption, "watch_signals", lambda signals: None)
    path = _write(tmp_path, "name: x\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: train.global_batch_size: 8 is not a multiple" in err, err


@pytest.mark.parametrize("window", [0, 4096])
def test_ascender_k_is_below_the_sequence_length(tmp_path, window):
    """k = 10**6 with window 0 loaded and built [b, np, s, k] neighbour indices at the first step; a row
    has at most seq_length - 1 other keys to choose from."""
    text = "model:\n  architecture: ascender\n  preset: debug\n"
    seq = load_config(_write(tmp_path, text)).model.seq_length
    sets = [f"model.ascender.window={window}", "model.ascender.num_global=0"]
    assert load_config(_write(tmp_path, text), sets + [f"model.ascender.k={seq - 1}"]).model.ascender.k == seq - 1
    message = _error(tmp_path, text, sets + [f"model.ascender.k={seq}"])
    assert f"model.ascender.k: must be < model.seq_length ({seq})" in message, message


# ------------------------------------------------------------------------------------ found by a review (2026-12-02)

def _mapping_bomb(levels: int) -> str:
    """``levels`` levels of mappings holding the level below twice: 2^levels leaf paths under model.j<levels>."""
    return "".join(["  j0: &a0 {x: 1, y: 1}\n"] + [f"  j{i}: &a{i} {{x: *a{i - 1}, y: *a{i - 1}}}\n"
                                                   for i in range(1, levels + 1)])


@pytest.mark.timeout(60)
def test_a_preset_set_over_an_alias_bomb_is_the_unknown_key_line_not_a_hang(tmp_path):
    """check_preset_takes_effect listed every leaf path of the model section: 2^40 of them here."""
    text = "model:\n" + _mapping_bomb(40)
    assert "model.j0: unknown key" in _error(tmp_path, text)
    assert "model.j0: unknown key" in _error(tmp_path, text, ["model.preset=small"])


@pytest.mark.parametrize("value", ["0.٠٠١", "1.٥e-3", "١e-3"])
def test_digits_of_other_scripts_are_not_a_number(tmp_path, value):
    """YAML 1.2 numbers are ASCII digits; the float pattern's \\d took Arabic-Indic ones (0.٠٠١ was 0.001)."""
    assert "optimizer.lr: expected float, got str" in _error(tmp_path, f"optimizer:\n  lr: {value}\n")
