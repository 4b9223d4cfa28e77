"""Conversion commands (consolidate, reshard, export-hf, evaluate) on bad input: one line naming the file."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from ascender_dist.cli import main
from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import to_dict
from ascender_dist.config.resolve import config_from_dict
from ascender_dist.tools.convert import (ConversionError, check_reshard_data, read_config, read_consolidated,
                                         read_meta, reshard_config)
from ascender_dist.training.weights import read_weights_file

from tests.helpers.errors import one_line as _one_line

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401

GOOD_META = {"format": 1, "step": 3, "architecture": "gpt", "world_size": 1, "vocab_size": 96,
             "padded_vocab_size": 128, "data": {"consumed_samples": 8, "seed": 1},
             "versions": {"megatron-core": "0.16.1", "deepspeed": "0.19.8"}}




@pytest.fixture
def consolidated(tmp_path):
    """A tiny fake consolidated directory (the weights do not fit any model: only reading is tested)."""
    out = tmp_path / "cons"
    out.mkdir()
    save_file({"embedding.word_embeddings.weight": torch.zeros(96, 4)}, str(out / "model.safetensors"))
    raw = to_dict(config_from_dict({"name": "tiny"}))
    (out / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (out / "meta.json").write_text(json.dumps(GOOD_META))
    return out


@pytest.fixture
def checkpoint(tmp_path):
    """A training checkpoint directory with one complete tag (meta.json only: read_meta is tested)."""
    ck = tmp_path / "ck"
    tag = ck / "step_00000003"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text("3\n")
    (ck / "latest").write_text("step_00000003")
    (tag / "meta.json").write_text(json.dumps(GOOD_META))
    return ck


def test_good_fixtures_read(consolidated, checkpoint):
    state, cfg, meta = read_consolidated(consolidated)
    assert cfg.name == "tiny" and meta["step"] == 3 and "embedding.word_embeddings.weight" in state
    assert read_meta(checkpoint / "step_00000003", "gpt")["world_size"] == 1


BAD_META = [
    ('{"format": 1, "archi', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"format": 1}', "no 'versions' field"),
    (json.dumps({k: v for k, v in GOOD_META.items() if k != "architecture"}), "no 'architecture' field"),
    (json.dumps({k: v for k, v in GOOD_META.items() if k != "world_size"}), "no 'world_size' field"),
    (json.dumps({**GOOD_META, "world_size": "2"}), "world_size: expected int"),
    (json.dumps({**GOOD_META, "world_size": 0}), "world_size: must be >= 1"),
    (json.dumps({**GOOD_META, "versions": ["x"]}), "versions: expected dict"),
]


@pytest.mark.parametrize("text,needle", BAD_META, ids=[n for _, n in BAD_META])
def test_checkpoint_meta_json_is_checked(checkpoint, text, needle):
    meta_file = checkpoint / "step_00000003" / "meta.json"
    meta_file.write_text(text)
    with pytest.raises(ConversionError) as info:
        read_meta(meta_file.parent, "gpt")
    _one_line(info.value, str(meta_file), needle)


def test_binary_meta_json(checkpoint):
    meta_file = checkpoint / "step_00000003" / "meta.json"
    meta_file.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConversionError) as info:
        read_meta(meta_file.parent)
    _one_line(info.value, str(meta_file), "not UTF-8")


def test_consolidate_command_with_keyless_meta_is_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    (checkpoint / "step_00000003" / "meta.json").write_text('{"format": 1, "versions": {}}')
    assert main(["consolidate", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "meta.json" in err and "\n" not in err


@pytest.mark.parametrize("text,needle", [("{", "invalid JSON"), ('"gpt"', "expected a JSON object"),
                                         ("{}", "no 'architecture' field")])
def test_consolidated_meta_json_is_checked(consolidated, text, needle):
    (consolidated / "meta.json").write_text(text)
    with pytest.raises(ConversionError) as info:
        read_consolidated(consolidated)
    _one_line(info.value, str(consolidated / "meta.json"), needle)


def test_config_yaml_is_read_by_the_strict_loader(consolidated):
    path = consolidated / "config.yaml"
    path.write_text("name: tiny\noptimizer:\n  lr: 1e-4\n  min_lr: 1e-5\n")
    assert read_config(consolidated).optimizer.lr == pytest.approx(1e-4)  # a float, not the string '1e-4'
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConversionError) as info:
        read_config(consolidated)
    _one_line(info.value, str(path), "invalid YAML")
    path.write_text("optimizer:\n  lr: -1\n")
    with pytest.raises(ConversionError) as info:
        read_config(consolidated)
    _one_line(info.value, str(path), "optimizer.lr: must be > 0")
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ConversionError) as info:
        read_config(consolidated)
    _one_line(info.value, str(path), "UTF-8")


def test_truncated_weights_file(consolidated):
    weights = consolidated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(ConversionError) as info:
        read_consolidated(consolidated)
    _one_line(info.value, str(weights), "truncated or corrupt")
    with pytest.raises(ConfigError) as info:  # the same file as checkpoint.init_from
        read_weights_file(weights)
    _one_line(info.value, "checkpoint.init_from", str(weights), "truncated or corrupt")


def test_a_consolidated_weights_file_changed_after_consolidate_is_refused(tmp_path):
    """A flipped byte in model.safetensors' tensor data loaded without an error (export-hf and
    evaluate then wrote NaN results); consolidate records the file's size and sha256 in meta.json."""
    from ascender_dist.tools.convert import write_consolidated

    out = tmp_path / "cons"
    write_consolidated(out, {"embedding.word_embeddings.weight": torch.ones(96, 4)}, config_from_dict({"name": "tiny"}),
                       dict(GOOD_META))
    weights, meta = out / "model.safetensors", json.loads((out / "meta.json").read_text())
    assert meta["weights_bytes"] == weights.stat().st_size and len(meta["weights_sha256"]) == 64
    assert read_consolidated(out)[0]["embedding.word_embeddings.weight"].sum() == 96 * 4
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # inside the tensor data: safetensors reads it without a complaint
    weights.write_bytes(bytes(data))
    with pytest.raises(ConversionError) as info:
        read_consolidated(out)
    _one_line(info.value, str(weights), "sha256 differs from", "weights_sha256", "corrupt or modified")
    weights.write_bytes(bytes(data) + b"\0")
    with pytest.raises(ConversionError) as info:
        read_consolidated(out)
    _one_line(info.value, str(weights), f"records {meta['weights_bytes']}", "truncated or replaced")


def test_a_consolidated_directory_as_init_from_names_the_file_in_it(consolidated, tmp_path):
    """checkpoint.init_from naming the directory consolidate wrote said 'weights file not found'."""
    with pytest.raises(ConfigError) as info:
        read_weights_file(consolidated)
    assert str(info.value) == (f"checkpoint.init_from: {consolidated}: is a directory; pass "
                               f"{consolidated / 'model.safetensors'}")
    with pytest.raises(ConfigError) as info:
        read_weights_file(tmp_path)
    assert str(info.value) == f"checkpoint.init_from: {tmp_path}: is a directory, not a weights file"


def test_reshard_overrides_go_through_the_config_checks(consolidated, tmp_path):
    _, cfg, _ = read_consolidated(consolidated)
    source = consolidated / "config.yaml"
    for overrides, data_parallel, needle in [
        (["parallel=5"], 1, "--set parallel=5: parallel: expected a mapping"),
        (["parallel.tensor_model_parallel_size=abc"], 1, "parallel.tensor_model_parallel_size: expected int"),
        (["parallel.tensor_model_parallel_size=3"], 1, "does not divide model.num_attention_heads"),
        ([], 0, "--data-parallel: must be >= 1"),
        ([], 3, f"{source}: train.global_batch_size"),  # the file whose setting does not fit
    ]:
        with pytest.raises(ConfigError) as info:
            reshard_config(cfg, tmp_path / "out", overrides, source, data_parallel=data_parallel)
        _one_line(info.value, needle)
    assert str(info.value).endswith("(at --data-parallel 3)")  # and the flag that made the layout
    good = reshard_config(cfg, tmp_path / "out", ["parallel.tensor_model_parallel_size=2"], source, data_parallel=2)
    assert good.parallel.tensor_model_parallel_size == 2 and good.checkpoint.dir == str(tmp_path / "out")


@pytest.mark.parametrize("args,needle", [
    (["--set", "parallel=5"], "parallel: expected a mapping"),
    (["--set", "parallel.tensor_model_parallel_size=abc"], "expected int"),
    (["--data-parallel", "0"], "--data-parallel: must be >= 1"),
])
def test_reshard_command_refuses_bad_layout_before_launching(consolidated, tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("ascender_dist.cli._relaunch", lambda *a: pytest.fail("launched"))
    assert main(["reshard", "--consolidated", str(consolidated), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err


def test_reshard_data_is_checked_before_launching(consolidated, tmp_path, capsys, monkeypatch):
    """Without a manifest (or with one missing here) every launched rank failed alone after the
    DeepSpeed launch; now one line before it, naming the field and config.yaml."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("ascender_dist.cli._relaunch", lambda *a: pytest.fail("launched"))
    # the fixture's weights fit no model (only reading is tested): that check comes first
    monkeypatch.setattr("ascender_dist.tools.hf_export.check_weights_fit_config", lambda *a, **k: None)
    source = consolidated / "config.yaml"
    assert main(["reshard", "--consolidated", str(consolidated), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {source}: data.manifest: not set; reshard builds the run's data loader (pass --set data.manifest=PATH)"
    missing = tmp_path / "gone" / "manifest.json"
    assert main(["reshard", "--consolidated", str(consolidated), "--out", str(tmp_path / "o"),
                 "--set", f"data.manifest={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {missing}: data.manifest of {source} not found here") and "\n" not in err
    (tmp_path / "emptydir").mkdir()  # a directory as the manifest: its manifest.json is what is read
    assert main(["reshard", "--consolidated", str(consolidated), "--out", str(tmp_path / "o"),
                 "--set", f"data.manifest={tmp_path / 'emptydir'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'emptydir' / 'manifest.json'}: data.manifest of {source} not found here")
    _, cfg, _ = read_consolidated(consolidated)
    mixture = reshard_config(cfg, tmp_path / "o", [f"data.mixture=[{{manifest: {missing}, weight: 1}}]"], source)
    with pytest.raises(ConversionError) as info:
        check_reshard_data(mixture, source)
    _one_line(info.value, f"{missing}: data.mixture[0].manifest of {source} not found here")


def test_export_hf_out_is_an_existing_file(consolidated, tmp_path):
    from ascender_dist.tools.hf_export import export_hf

    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, target)
    _one_line(info.value, str(target), "existing file")
    assert target.read_text() == "x"


def test_export_hf_tokenizer_must_be_the_models_sentencepiece_model(consolidated, tmp_path, tiny_tokenizer):
    from ascender_dist.tools.hf_export import export_hf

    model = tiny_tokenizer.model_path  # 400 pieces
    vocab_file = model.with_suffix(".vocab")
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, tmp_path / "hf", tokenizer=str(vocab_file))
    _one_line(info.value, str(vocab_file), "not a sentencepiece model")
    with pytest.raises(ConversionError) as info:  # meta.json says 96
        export_hf(consolidated, tmp_path / "hf", tokenizer=str(model))
    _one_line(info.value, str(model), "vocab size", "96")
    assert not (tmp_path / "hf").exists()


def test_evaluate_reads_metadata_in_one_line(consolidated, tmp_path):
    from ascender_dist.tools.evaluate import EvaluationError, parse_run

    assert parse_run(str(consolidated), None).parameters == 96 * 4
    (consolidated / "meta.json").write_text('{"step": ')
    with pytest.raises(ConversionError) as info:
        parse_run(str(consolidated), None)
    _one_line(info.value, "meta.json", "invalid JSON")
    (consolidated / "meta.json").write_text(json.dumps(GOOD_META))
    (consolidated / "model.safetensors").write_bytes(b"\x08\x00")
    with pytest.raises(EvaluationError) as info:  # a UserError: the CLI prints one line, no traceback
        parse_run(str(consolidated), None)
    _one_line(info.value, "model.safetensors", "truncated or corrupt")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    save_file({"w": torch.zeros(1)}, str(hf / "model.safetensors"))
    with pytest.raises(ConversionError) as info:
        parse_run(str(hf), None)
    _one_line(info.value, "config.json", "invalid JSON")


def _consolidated_model(out, raw_config: dict, untied_weights: bool = False):
    """A consolidated directory whose weights fit the model of ``raw_config`` (a fresh HF model's,
    with a trained-looking output layer when ``untied_weights``); returns its state."""
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.convert import write_consolidated
    from ascender_dist.tools.hf_export import remote_code_config

    cfg = config_from_dict(raw_config)
    model = AscenderDistForCausalLM(remote_code_config(cfg, GOOD_META, 96, tied=not untied_weights))
    state = {("output_layer.weight" if n == "lm_head.weight" else n.removeprefix("model.")): t
             for n, t in model.state_dict().items()
             if untied_weights or n != "lm_head.weight"}
    state = {n: t for n, t in state.items() if ".core_attention.params." not in n or "omega" in n}
    write_consolidated(out, state, cfg, GOOD_META)
    return state


def test_a_sequence_parallel_runs_consolidation_is_readable(tmp_path):
    """Consolidation lays the run out on one device: sequence parallelism (which needs TP > 1) goes off
    too, or no consumer could read the directory; old directories that kept it read the same way."""
    from ascender_dist.tools.hf_export import export_hf

    _consolidated_model(tmp_path / "cons", {"name": "sp", "parallel": {"tensor_model_parallel_size": 2,
                                                                       "sequence_parallel": True},
                                            "train": {"micro_batch_size": 4, "global_batch_size": 4}})
    _, cfg, _ = read_consolidated(tmp_path / "cons")
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel) == (1, False)
    raw = yaml.safe_load((tmp_path / "cons" / "config.yaml").read_text())
    raw["parallel"]["sequence_parallel"] = True  # as written before the fix
    (tmp_path / "cons" / "config.yaml").write_text(yaml.safe_dump(raw))
    assert read_consolidated(tmp_path / "cons")[1].parallel.sequence_parallel is False
    assert (export_hf(tmp_path / "cons", tmp_path / "hf") / "model.safetensors").is_file()


def test_a_trained_output_layer_under_a_tied_config_is_refused(tmp_path):
    """The exports would drop output_layer.weight and use the embedding as the head: wrong logits."""
    from ascender_dist.tools.hf_export import export_hf

    state = _consolidated_model(tmp_path / "cons", {"name": "t"}, untied_weights=True)
    assert "output_layer.weight" in state
    for remote_code in (None, True):
        with pytest.raises(ConversionError) as info:
            export_hf(tmp_path / "cons", tmp_path / "hf", remote_code=remote_code)
        _one_line(info.value, "model.safetensors", "output_layer.weight", "config.yaml", "ties")
    assert not (tmp_path / "hf").exists()


def test_remote_code_false_refuses_a_gpt_with_other_layers(tmp_path):
    from ascender_dist.tools.hf_export import export_hf

    _consolidated_model(tmp_path / "cons", {"name": "g", "model": {
        "layer_pattern": "AS", "ascender": {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 1}}})
    with pytest.raises(ConversionError) as info:
        export_hf(tmp_path / "cons", tmp_path / "hf", remote_code=False)
    _one_line(info.value, "config.yaml", "model.layer_pattern 'AS'", "remote code")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("out", [".", ".."])
def test_export_to_the_current_directory_is_one_line(consolidated, tmp_path, monkeypatch, capsys, out):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["export-hf", "--consolidated", str(consolidated), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "name the output directory itself" in err and "\n" not in err
    assert not any(work.iterdir())


def test_evaluate_names_a_truncated_hf_export_in_one_line(tmp_path):
    from ascender_dist.tools.evaluate import EvaluationError, parse_run
    from ascender_dist.tools.hf_export import export_hf

    _consolidated_model(tmp_path / "cons", {"name": "t"})
    weights = export_hf(tmp_path / "cons", tmp_path / "hf") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(EvaluationError) as info:
        parse_run(str(tmp_path / "hf"), None)
    _one_line(info.value, str(weights), "truncated or corrupt")


def test_lm_eval_adapter_names_weights_that_do_not_fit_in_one_line(consolidated, tiny_tokenizer, capsys):
    """The adapter exports a consolidated directory on the fly: the export's errors are one line, exit 2."""
    from ascender_dist.tools.lm_eval_adapter import main as adapter_main

    raw = yaml.safe_load((consolidated / "config.yaml").read_text())
    raw["data"]["tokenizer"] = str(tiny_tokenizer.model_path)  # the adapter exports only with a tokenizer
    (consolidated / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (consolidated / "meta.json").write_text(json.dumps({**GOOD_META, "vocab_size": tiny_tokenizer.vocab_size}))
    assert adapter_main(["--model", "ascender-dist", "--model_args", f"pretrained={consolidated}",
                         "--tasks", "lambada_openai"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the fixture's weights have fewer vocabulary rows than the tokenizer's ids: the first misfit found
    assert err[-1].startswith("error: ") and f"says vocab_size {tiny_tokenizer.vocab_size}" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_export_refuses_embedding_rows_other_than_the_meta_vocabulary(consolidated, tmp_path):
    """Consolidated weights that kept the vocabulary's padding rows (or another run's embedding) would
    export with untrained rows inside the softmax: refused in one line naming both files."""
    from ascender_dist.tools.hf_export import export_hf

    state = read_weights_file(consolidated / "model.safetensors")
    rows = state["embedding.word_embeddings.weight"].shape[0]
    (consolidated / "meta.json").write_text(json.dumps({**GOOD_META, "vocab_size": rows - 2}))
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, tmp_path / "hf")
    _one_line(info.value, str(consolidated / "model.safetensors"), f"has {rows} rows",
              f"{consolidated / 'meta.json'} says vocab_size {rows - 2}")


def test_conversion_in_a_shell_with_rank_variables_still_relaunches(tmp_path, monkeypatch):
    """RANK / WORLD_SIZE in the user's shell (a Kubeflow pod, a torchrun job) do not make the command
    act as a relaunched rank: it checks, pins the tag and relaunches; the ranks it starts carry the
    explicit marker."""
    import ascender_dist.cli as cli

    tag = tmp_path / "ckpt" / "step_00000001"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text("1\n")
    (tmp_path / "ckpt" / "latest").write_text("step_00000001")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv(cli.RELAUNCHED, raising=False)
    monkeypatch.setattr("ascender_dist.tools.convert.read_meta", lambda tag_dir, arch=None: {"world_size": 2})
    monkeypatch.setattr("ascender_dist.tools.convert.consolidate", lambda *a: pytest.fail("ran as a rank"))
    started = []
    monkeypatch.setattr(cli, "_run_launcher", lambda cmd, env: started.append((cmd, env)) or 0)
    args = ["consolidate", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    assert main(args) == 0
    (cmd, env), = started
    assert cmd[-2:] == ["--tag", "step_00000001"] and env[cli.RELAUNCHED] == "1"
    monkeypatch.setenv(cli.RELAUNCHED, "1")  # what the started ranks see
    assert cli._under_launcher()


def test_consolidate_ranks_read_the_tag_the_command_resolved(tmp_path, monkeypatch):
    """Without --tag every relaunched rank read `latest` itself: a save landing between two ranks'
    starts (the run still training) made them load different steps and merge them into one file."""
    for step in (1, 2):
        tag = tmp_path / "ckpt" / f"step_{step:08d}"
        tag.mkdir(parents=True)
        (tag / "COMPLETE").write_text(f"{step}\n")
    (tmp_path / "ckpt" / "latest").write_text("step_00000002")
    launched = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("ascender_dist.tools.convert.read_meta", lambda tag_dir, arch=None: {"world_size": 2})
    monkeypatch.setattr("ascender_dist.cli._relaunch", lambda world, argv: launched.append((world, argv)))
    args = ["consolidate", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    assert main(args) == 0
    assert launched == [(2, [*args, "--tag", "step_00000002"])]
    launched.clear()
    assert main([*args, "--tag", "step_00000001"]) == 0  # a tag given is passed on as it is
    assert launched == [(2, [*args, "--tag", "step_00000001"])]
