"""What a resume checks before loading (training/resume_check.py), on hand-made checkpoint tags;
the same checks through a real 2-rank Trainer are in tests/distributed/test_checkpoint_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import to_dict
from ascender_dist.config.resolve import config_from_dict
from ascender_dist.training.resume_check import check_resume, data_fingerprint


def _cfg(manifest: Path, **model):
    return config_from_dict({"data": {"manifest": str(manifest)}, "model": {"hidden_size": 64, **model}})


def _tag(root: Path, cfg, **meta) -> Path:
    tag = root / "step_00000005"
    tag.mkdir(parents=True, exist_ok=True)
    (tag / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (tag / "meta.json").write_text(json.dumps({"step": 5, **meta}))
    return tag


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text('{"shards": []}')
    return path


def test_every_differing_model_field_is_named_the_first_with_both_values(tmp_path, manifest):
    _tag(tmp_path, _cfg(manifest))
    changed = _cfg(manifest, hidden_size=128, num_layers=3)
    with pytest.raises(ConfigError) as info:
        check_resume(changed, tmp_path, "step_00000005", log_it=False)
    assert str(info.value) == (f"model.num_layers: checkpoint {tmp_path / 'step_00000005'} has 2, the config has 3 "
                               f"(also differ: model.hidden_size); resume with the checkpoint's model, or start a "
                               f"new checkpoint.dir")


def test_dropout_and_init_changes_and_older_checkpoints_resume(tmp_path, manifest):
    _tag(tmp_path, _cfg(manifest))  # no data_fingerprint in meta.json: written before it existed
    record = check_resume(_cfg(manifest, hidden_dropout=0.1, init_method_std=0.01), tmp_path, "step_00000005",
                          log_it=False)
    assert record == {"data_fingerprint": data_fingerprint(_cfg(manifest)), "data_changes": []}


def test_the_fast_paths_tiling_and_a_vocab_size_0_for_none_resume(tmp_path, manifest):
    """A smaller model.ascender.max_tile_elems (or chunk_size) is how an out-of-memory job resumes:
    the same function in smaller tiles. vocab_size 0 acts like None (the tokenizer's size)."""
    _tag(tmp_path, _cfg(manifest))
    check_resume(_cfg(manifest, ascender={"chunk_size": 32, "max_tile_elems": 2**16}, vocab_size=0), tmp_path,
                 "step_00000005", log_it=False)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: checkpoint .* has None, the config has 1000; "):
        check_resume(_cfg(manifest, vocab_size=1000), tmp_path, "step_00000005", log_it=False)


FULL = {"window": 0, "num_global": 0}  # every visible key a candidate: k is bounded by seq_length alone


def test_a_run_saved_with_k_at_or_above_seq_length_resumes_with_seq_length_minus_one(tmp_path, manifest):
    """New configs must keep ASCender's k below seq_length (config.architectures.check_neighbour_count),
    checked where a user's config loads, not on saved ones: a run saved with k = 1000 at seq_length 128
    still reads (consolidate, export) and resumes with k = 127, the same neighbours; another k is refused."""
    from ascender_dist.config.resolve import load_config

    saved = config_from_dict({"data": {"manifest": str(manifest)}, "model": {"preset": "debug", "architecture":
                                                                              "ascender", "ascender": {**FULL, "k": 1000}}})
    seq = saved.model.seq_length
    assert saved.model.ascender.k == 1000 and seq < 1000
    _tag(tmp_path, saved)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(yaml.safe_dump({"data": {"manifest": str(manifest)},
                                         "model": {"preset": "debug", "architecture": "ascender", "ascender": FULL}}))
    with pytest.raises(ConfigError, match=rf"model\.ascender\.k: must be < model\.seq_length \({seq}\)"):
        load_config(yaml_path, ["model.ascender.k=1000"])
    check_resume(load_config(yaml_path, [f"model.ascender.k={seq - 1}"]), tmp_path, "step_00000005", log_it=False)
    with pytest.raises(ConfigError, match=rf"^model\.ascender\.k: checkpoint .* has 1000, the config has {seq - 2}; "):
        check_resume(load_config(yaml_path, [f"model.ascender.k={seq - 2}"]), tmp_path, "step_00000005", log_it=False)


@pytest.mark.parametrize("recorded", [5, "a note", [{"step": 2}, "x"]])
def test_a_damaged_data_changes_record_is_one_line_naming_meta_json(tmp_path, manifest, recorded):
    """An integer raised a raw TypeError; a string was carried on split into characters."""
    from ascender_dist.training.checkpoint import CheckpointError

    cfg = _cfg(manifest)
    _tag(tmp_path, cfg, data_fingerprint=data_fingerprint(cfg), data_changes=recorded)
    with pytest.raises(CheckpointError) as info:
        check_resume(cfg, tmp_path, "step_00000005", log_it=False)
    assert str(info.value).startswith(f"{tmp_path / 'step_00000005' / 'meta.json'}: data_changes: expected a list "
                                      "of records, got ") and "\n" not in str(info.value)


def test_other_data_is_refused_unless_allowed_and_then_recorded(tmp_path, manifest):
    cfg = _cfg(manifest)
    old = data_fingerprint(cfg)
    _tag(tmp_path, cfg, data_fingerprint=old)
    assert check_resume(cfg, tmp_path, "step_00000005-universal", log_it=False)["data_changes"] == []
    moved = tmp_path / "elsewhere" / "manifest.json"
    moved.parent.mkdir()
    moved.write_bytes(manifest.read_bytes())
    assert data_fingerprint(_cfg(moved)) == old  # by content, not path
    manifest.write_text('{"shards": [1]}')
    with pytest.raises(ConfigError, match=r"^data.manifest: .*manifest.json differs from the data checkpoint .*"
                                          r"step_00000005 was trained on \(manifest content sha256 \w{12} vs "
                                          rf"{old[:12]}\); set data.allow_change_on_resume: true"):
        check_resume(cfg, tmp_path, "step_00000005", log_it=False)
    allowed = config_from_dict({**to_dict(cfg), "data": {"manifest": str(manifest), "allow_change_on_resume": True}})
    record = check_resume(allowed, tmp_path, "step_00000005", log_it=True)
    assert record["data_changes"] == [{"step": 5, "from": old, "to": data_fingerprint(cfg),
                                       "manifests": str(manifest)}]
    weighted = config_from_dict({"data": {"mixture": [{"manifest": str(manifest), "weight": 2.0}]}})
    assert data_fingerprint(weighted) != data_fingerprint(cfg)  # the mixture weight is part of the data


def _tag_saved_with(directory, **layout):
    import json

    tag_dir = directory / "step_00000004"
    tag_dir.mkdir(parents=True)
    meta = {"step": 4, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "data_parallel_size": 2, "zero_stage": 1, **layout}
    (tag_dir / "meta.json").write_text(json.dumps(meta))
    (tag_dir / "COMPLETE").write_text("4\n")
    (directory / "latest").write_text("step_00000004")


@pytest.mark.parametrize("layout,run,message", [
    ({"zero_stage": 1}, dict(tp_size=1, pp_size=1, dp_size=2, zero_stage=0),
     r"^parallel\.zero_stage: .*step_00000004 was saved with ZeRO stage 1, this run uses 0: resume with "
     r"parallel\.zero_stage: 1"),
    ({"tensor_model_parallel_size": 1}, dict(tp_size=2, pp_size=1, dp_size=2, zero_stage=1),
     r"^parallel\.tensor_model_parallel_size: .*step_00000004 was saved at tp x pp = 1 x 1; resuming at 2 x 1 needs"),
    ({"pipeline_model_parallel_size": 2}, dict(tp_size=1, pp_size=1, dp_size=2, zero_stage=1),
     r"^parallel\.pipeline_model_parallel_size: .*step_00000004 was saved at tp x pp = 1 x 2; resuming at 1 x 1 "),
    ({"pipeline_model_parallel_size": 2}, dict(tp_size=1, pp_size=2, dp_size=1, zero_stage=1),
     r"^parallel: .*step_00000004 was saved at data-parallel size 2 with pipeline parallelism; resuming at 1 "
     r"is not supported .*tied embeddings.*resume at data-parallel size 2"),
])
def test_a_layout_that_cannot_be_bridged_is_named_before_loading(tmp_path, layout, run, message):
    """Checked on every resume, the data-parallel size unchanged too (DeepSpeed's own failures
    there are tracebacks from inside the optimizer or a misleading state-dict error)."""
    from types import SimpleNamespace

    from ascender_dist.training.run import resume_tag_for_layout

    _tag_saved_with(tmp_path, **layout)
    zero_stage = run.pop("zero_stage")
    with pytest.raises(ConfigError, match=message):
        resume_tag_for_layout(tmp_path, SimpleNamespace(is_logging_rank=True, **run), zero_stage)
    # the same layout resumes from the tag itself
    pp = layout.get("pipeline_model_parallel_size", 1)
    assert resume_tag_for_layout(tmp_path, SimpleNamespace(is_logging_rank=True, tp_size=1, pp_size=pp, dp_size=2),
                                 1) == "step_00000004"


def test_a_precision_change_is_named_before_loading(tmp_path):
    """bf16 and fp32 optimizers write different state files: without the check the checkpoint looked
    unreadable (FileNotFoundError inside DeepSpeed) although it is fine."""
    from types import SimpleNamespace

    from ascender_dist.training.run import resume_tag_for_layout

    _tag_saved_with(tmp_path, precision="bf16")
    pstate = SimpleNamespace(is_logging_rank=True, tp_size=1, pp_size=1, dp_size=2)
    with pytest.raises(ConfigError, match=r"^train\.precision: .*step_00000004 was saved with bf16, this run uses "
                                          r"fp32: resume with train\.precision: bf16"):
        resume_tag_for_layout(tmp_path, pstate, 1, precision="fp32")
    assert resume_tag_for_layout(tmp_path, pstate, 1, precision="bf16") == "step_00000004"


def test_a_run_that_does_not_resume_refuses_a_folder_with_checkpoints(tmp_path):
    """auto_resume: false over another run's checkpoints would move `latest` back and let pruning
    delete the new run's own checkpoints while keeping the old run's newer ones."""
    from ascender_dist.training.run import _refuse_fresh_start_over_checkpoints

    fresh = config_from_dict({"checkpoint": {"auto_resume": False}})
    _refuse_fresh_start_over_checkpoints(fresh, tmp_path)  # empty: fine
    _tag_saved_with(tmp_path)
    with pytest.raises(ConfigError, match=r"^checkpoint\.auto_resume: false, but .* holds checkpoints "
                                          r"\(newest step_00000004\)"):
        _refuse_fresh_start_over_checkpoints(fresh, tmp_path)
    _refuse_fresh_start_over_checkpoints(config_from_dict({}), tmp_path)  # auto_resume: true resumes there


# ----------------------------------------------------------------------------- found by a mutation audit
@pytest.mark.parametrize("section,name,value", [("ascender", "k", 8), ("connection", "num_slots", 16)])
def test_a_changed_layer_setting_is_named_by_its_dotted_path(tmp_path, manifest, section, name, value):
    """The architectures' own settings are nested mappings (model.ascender.*, model.connection.*):
    they shape the weights as much as hidden_size does, so a change there is refused by its full
    path with both values, not resumed into a model the checkpoint never trained."""
    cfg = _cfg(manifest)
    _tag(tmp_path, cfg)
    before = getattr(getattr(cfg.model, section), name)
    with pytest.raises(ConfigError) as info:
        check_resume(_cfg(manifest, **{section: {name: value}}), tmp_path, "step_00000005", log_it=False)
    assert str(info.value).startswith(f"model.{section}.{name}: checkpoint {tmp_path / 'step_00000005'} has "
                                      f"{before!r}, the config has {value!r}; ")


def test_a_second_change_of_data_keeps_the_first_in_the_record(tmp_path, manifest):
    """data_changes is the run's history: a resume on changed data appends to what the checkpoint
    recorded (oldest first), it does not replace it; else the first change is lost from every later
    checkpoint's meta.json."""
    cfg = config_from_dict({"data": {"manifest": str(manifest), "allow_change_on_resume": True},
                            "model": {"hidden_size": 64}})
    old = data_fingerprint(cfg)
    earlier = {"step": 2, "from": "0" * 64, "to": old, "manifests": str(manifest)}
    _tag(tmp_path, cfg, data_fingerprint=old, data_changes=[earlier])
    assert check_resume(cfg, tmp_path, "step_00000005", log_it=False)["data_changes"] == [earlier]  # unchanged data
    manifest.write_text('{"shards": [2]}')
    record = check_resume(cfg, tmp_path, "step_00000005", log_it=False)
    assert record["data_changes"] == [earlier, {"step": 5, "from": old, "to": data_fingerprint(cfg),
                                                "manifests": str(manifest)}]


# every ModelConfig field but these changes what the weights mean; a field added to the exempt set
# must be one of these (a test change, reviewed), never a weight-shaping one slipped in
_EXEMPT = {"preset", "hidden_dropout", "attention_dropout", "init_method_std"}
_NESTED = {"ascender", "connection"}  # compared field by field (the test above)
_BASE_MODEL = {"hidden_size": 64, "ascender": {"d_z": 8, "d_a": 8}}  # 16-wide heads: valid for every architecture
_ALTERNATIVES = {"architecture": "ascender", "layer_pattern": "AS", "num_layers": 4, "hidden_size": 128,
                 "num_attention_heads": 8, "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 64,
                 "vocab_size": 1000, "make_vocab_size_divisible_by": 64, "position_embedding_type": "learned_absolute",
                 "rotary_base": 500000, "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False,
                 "untie_embeddings_and_output_weights": True, "layernorm_epsilon": 1e-6}


def _weight_shaping_fields() -> list[str]:
    import dataclasses

    from ascender_dist.config.schema import ModelConfig

    return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _EXEMPT | _NESTED]


@pytest.mark.parametrize("field", _weight_shaping_fields())
def test_every_weight_shaping_model_field_is_compared_on_resume(tmp_path, manifest, field):
    """A resume with another position embedding, norm, activation, ... would load tensors into a
    model that uses them differently (or not at all) and train on silently; each such field of
    ModelConfig (listed from the dataclass, so a new field is covered too) is refused by name."""
    from ascender_dist.config import validate

    assert field in _ALTERNATIVES, f"give model.{field} a valid alternative value in _ALTERNATIVES"
    base = config_from_dict({"data": {"manifest": str(manifest)}, "model": _BASE_MODEL})
    changed = config_from_dict({"data": {"manifest": str(manifest)},
                                "model": {**_BASE_MODEL, field: _ALTERNATIVES[field]}})
    validate(changed)  # a real config, not one refused for another reason
    _tag(tmp_path, base)
    with pytest.raises(ConfigError) as info:
        check_resume(changed, tmp_path, "step_00000005", log_it=False)
    assert str(info.value).startswith(f"model.{field}: checkpoint {tmp_path / 'step_00000005'} has "
                                      f"{getattr(base.model, field)!r}, the config has {_ALTERNATIVES[field]!r}")


@pytest.mark.parametrize("content", [None, "", "name: x\n"], ids=["missing", "empty", "no-model"])
def test_a_checkpoint_without_its_config_is_refused_before_loading(tmp_path, manifest, content):
    """With config.yaml missing or empty the model check was skipped: a resume into another model
    shape failed later inside DeepSpeed's load, reported as 'unreadable (RuntimeError: Error(s) in
    loading state_dict for LanguageModel:)' with the mismatch itself cut off."""
    from ascender_dist.training.checkpoint import CheckpointError

    cfg = _cfg(manifest)
    tag = _tag(tmp_path, cfg)
    if content is None:
        (tag / "config.yaml").unlink()
    else:
        (tag / "config.yaml").write_text(content)
    with pytest.raises(CheckpointError) as info:
        check_resume(cfg, tmp_path, "step_00000005", log_it=False)
    assert str(info.value).startswith(f"{tag / 'config.yaml'}: ")
    assert "the model this checkpoint was trained with cannot be checked" in str(info.value)


def test_a_load_error_keeps_the_line_that_says_what_failed():
    from ascender_dist.training.checkpoint import _first_line

    exc = RuntimeError("Error(s) in loading state_dict for LanguageModel:\n\tsize mismatch for embedding.weight: "
                       "copying a param with shape torch.Size([512, 64]) from checkpoint, the shape in current model "
                       "is torch.Size([512, 128]).")
    assert _first_line(exc) == ("RuntimeError: Error(s) in loading state_dict for LanguageModel: size mismatch for "
                                "embedding.weight: copying a param with shape torch.Size([512, 64]) from checkpoint, "
                                "the shape in current model is torch.Size([512, 128]).")
    assert _first_line(ValueError("one line\nmore")) == "ValueError: one line"
