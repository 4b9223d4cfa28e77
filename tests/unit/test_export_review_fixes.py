"""Six review findings on export and evaluation, one test each (each failed before its fix):
the lm-eval export cache follows new weights whatever their mtime; a full disk while writing the
tokenizer is one line; weights missing a trained ASCender parameter are refused; evaluate names an
export whose weights do not fit its config.json in one line; the remote-code model's RoPE follows
``position_ids``; ``evaluate --no-val`` reports an export's parameter count."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict
from ascender_dist.tools.convert import ConversionError
from tests.helpers.errors import one_line
from tests.unit.export_fixtures import run_with_tokenizer, two_tokenizers, write_run  # noqa: F401  (fixtures)

ASCENDER = {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 1}
SMALL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 64}


def _marker(out: Path) -> dict:
    return json.loads((out / "ascender_dist.json").read_text())


def _age(path: Path, seconds: int) -> None:
    """Set ``path``'s mtime ``seconds`` into the past, as ``rsync -a`` / ``cp -p`` keep a source's."""
    old = path.stat().st_mtime_ns - seconds * 10**9
    os.utime(path, ns=(old, old))


# ----------------------------------------------------------------------------- 1: export cache identity
def _embedding(weights: Path) -> torch.Tensor:
    """The word embedding of a consolidated or exported weights file (whatever its naming)."""
    from safetensors.torch import load_file

    state = load_file(str(weights))
    return next(t for name, t in state.items() if name.endswith(("word_embeddings.weight", "embed_in.weight")))


def test_lm_eval_cache_follows_new_weights_with_an_older_mtime(two_tokenizers, tmp_path):  # noqa: F811
    """New weights of the same size copied in with an mtime older than the cached export (``rsync -a``)
    are exported again: the cache records the weights' size and mtime and requires equality."""
    from ascender_dist.tools.lm_eval_adapter import hf_directory

    torch.manual_seed(1)
    run = write_run(tmp_path / "cons", two_tokenizers[0])
    torch.manual_seed(2)
    newer = write_run(tmp_path / "newer", two_tokenizers[0])
    # a directory consolidated before meta.json recorded the weights' sha256 (read_consolidated would
    # now refuse weights that are not the recorded ones): only the file's identity tells new weights
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if not k.startswith("weights_")}))
    out = hf_directory(run)
    assert hf_directory(run) == out and torch.equal(_embedding(out / "model.safetensors"),
                                                    _embedding(run / "model.safetensors"))
    shutil.copy2(newer / "model.safetensors", run / "model.safetensors")
    _age(run / "model.safetensors", 3600)  # older than the cache, same size: only its identity changed
    assert torch.equal(_embedding(hf_directory(run) / "model.safetensors"), _embedding(newer / "model.safetensors"))


def test_lm_eval_cache_follows_a_new_meta_json_with_an_older_mtime(run_with_tokenizer):  # noqa: F811
    from ascender_dist.tools.lm_eval_adapter import hf_directory

    run = run_with_tokenizer
    assert _marker(hf_directory(run))["step"] == 3
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "step": 7}))
    _age(run / "meta.json", 3600)
    assert _marker(hf_directory(run))["step"] == 7


# ----------------------------------------------------------------------------- 2: full disk in the tokenizer
def test_a_full_disk_while_writing_the_tokenizer_is_one_line(run_with_tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """The tokenizers library raises a bare Exception for ENOSPC: export-hf still says it in one line
    naming the output, and leaves neither the output nor its staging directory."""
    from transformers import PreTrainedTokenizerFast

    from ascender_dist.tools.hf_export import export_hf

    def full_disk(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    with pytest.raises(ConversionError) as info:
        export_hf(run_with_tokenizer, tmp_path / "hf")
    one_line(info.value, str(tmp_path / "hf"), "No space left on device (os error 28)", "nothing was replaced")
    assert not [p.name for p in tmp_path.iterdir() if "hf" in p.name]


def test_an_os_error_while_writing_the_tokenizer_stays_itself(two_tokenizers, tmp_path, monkeypatch):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    from ascender_dist.tools.hf_tokenizer import write_hf_tokenizer

    error = PermissionError(13, "Permission denied")

    def refused(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", refused)
    with pytest.raises(PermissionError) as info:
        write_hf_tokenizer(two_tokenizers[0], tmp_path, 64)
    assert info.value is error


# ----------------------------------------------------------------------------- 3: a missing trained parameter
def _ascender_run(out: Path, drop: str | None = None) -> Path:
    """A consolidated ascender run (trained parameters, no persistent buffers: what checkpoints hold),
    without the tensor ``drop``."""
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.convert import write_consolidated
    from ascender_dist.tools.hf_export import remote_code_config

    cfg = config_from_dict({"name": "asc", "model": {**SMALL, "architecture": "ascender", "ascender": ASCENDER}})
    meta = {"format": 1, "step": 3, "architecture": "ascender", "world_size": 1, "vocab_size": 64}
    model = AscenderDistForCausalLM(remote_code_config(cfg, meta, 64, tied=True))
    buffers = {name for name, _ in model.named_buffers()}
    state = {name.removeprefix("model."): t for name, t in model.state_dict().items()
             if name not in buffers and name != "lm_head.weight"}
    assert "decoder.layers.0.self_attention.core_attention.params.delta" in state  # trained by default
    state.pop(drop, None)
    write_consolidated(out, state, cfg, meta)
    return out


def test_weights_missing_a_trained_ascender_parameter_are_refused(tmp_path):
    from ascender_dist.tools.convert import read_consolidated
    from ascender_dist.tools.hf_export import check_weights_fit_config, export_hf

    whole = _ascender_run(tmp_path / "whole")
    check_weights_fit_config(*read_consolidated(whole), whole)  # the fixed buffers are filled in
    name = "decoder.layers.1.self_attention.core_attention.params.delta"
    run = _ascender_run(tmp_path / "cons", drop=name)
    with pytest.raises(ConversionError) as info:
        check_weights_fit_config(*read_consolidated(run), run)
    one_line(info.value, str(run / "model.safetensors"), "missing", name, str(run / "config.yaml"))
    with pytest.raises(ConversionError):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- 4: export not fitting config.json
def test_evaluate_names_an_export_whose_weights_do_not_fit_its_config_in_one_line(two_tokenizers, tmp_path,  # noqa: F811
                                                                                   capsys):
    from ascender_dist.tools import evaluate as ev
    from ascender_dist.tools.hf_export import export_hf

    hf = export_hf(write_run(tmp_path / "cons", two_tokenizers[0]), tmp_path / "hf", remote_code=True)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "ffn_hidden_size": config["ffn_hidden_size"] // 2}))
    with pytest.raises(ev.EvaluationError) as info:
        ev.load_model(ev.parse_run(str(hf), None))
    one_line(info.value, str(hf), "cannot load the Hugging Face export", "ignore_mismatched_sizes")
    code = ev.evaluate_main([str(hf), "--manifest", str(tmp_path / "m.json"), "--out", str(tmp_path / "ev"),
                             "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {hf}: cannot load the Hugging Face export")


# ----------------------------------------------------------------------------- 5: RoPE at position_ids
def _rope_model():
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.hf_export import remote_code_config

    cfg = config_from_dict({"name": "rope", "model": {**SMALL, "layer_pattern": "AS", "ascender": ASCENDER}})
    torch.manual_seed(0)
    return AscenderDistForCausalLM(remote_code_config(cfg, {"step": 3, "architecture": "gpt"}, 64, tied=True)).eval()


def _logits_at(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The logits of ``ids`` (every row) at ``positions`` [s], computed by hand: the layers run with
    those rows of megatron's RoPE table, in its [s, 1, 1, d] layout."""
    from ascender_dist.hf.modeling_ascender_dist import _linear, rotary_cos_sin

    config, inner = model.config, model.model
    cos, sin = rotary_cos_sin(int(positions.max()) + 1, config.head_dim, float(config.rotary_base), ids.device)
    hidden = inner.embedding(ids, positions[None])  # rope: no learned positions
    for layer in inner.decoder.layers:
        hidden = layer(hidden, (cos[positions], sin[positions]))
    return _linear(inner.decoder.final_layernorm(hidden).transpose(0, 1), model.lm_head)


def test_rope_follows_position_ids():
    """arange is the default bit for bit; an offset (arange + 5) rotates by those table rows (the
    same logits up to rounding: RoPE scores depend on distances only); positions with gaps (packed
    or skipped tokens) change the logits, each batch row at its own positions."""
    model = _rope_model()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    arange = torch.arange(12)
    close = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        default = model(ids).logits
        assert torch.equal(model(ids, position_ids=arange[None].expand(2, 12)).logits, default)
        offset = model(ids, position_ids=(arange + 5)[None].expand(2, 12)).logits
        torch.testing.assert_close(offset, _logits_at(model, ids, arange + 5), **close)
        torch.testing.assert_close(offset, default, **close)
        gaps = model(ids, position_ids=(3 * arange)[None]).logits  # [1, s]: every row
        torch.testing.assert_close(gaps, _logits_at(model, ids, 3 * arange), **close)
        assert (gaps - default).abs().max() > 1e-3
        per_row = model(ids, position_ids=torch.stack([arange, 3 * arange])).logits
        torch.testing.assert_close(per_row[0], default[0], **close)
        torch.testing.assert_close(per_row[1], gaps[1], **close)
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        model(ids, position_ids=arange - 1)


# ----------------------------------------------------------------------------- 6: --no-val parameter count
def test_evaluate_no_val_reports_an_exports_parameter_count(two_tokenizers, tmp_path, capsys):  # noqa: F811
    from safetensors import safe_open

    from ascender_dist.tools import evaluate as ev
    from ascender_dist.tools.hf_export import export_hf

    hf = export_hf(write_run(tmp_path / "cons", two_tokenizers[0]), tmp_path / "hf")
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert ev.evaluate_main([str(hf), "--no-val", "--out", str(tmp_path / "ev"), "--device", "cpu"]) == 0
    row = json.loads((tmp_path / "ev" / "results.json").read_text())["runs"][0]
    assert row["parameters"] == stored > 0
    assert ev._params(stored) in (tmp_path / "ev" / "results.md").read_text()


@pytest.mark.parametrize("connection", ["linear", "bilinear"])
def test_the_hf_model_draws_a_connection_it_lacks_as_the_training_layer_does(connection):
    """Every missing Connection parameter was drawn with init_std, ignoring connection_init_scale:
    src 6x smaller than the layer's at hidden 64, a model fine-tuned from scratch reasoned less."""
    from ascender_dist.hf.configuration_ascender_dist import AscenderDistConfig
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM

    torch.manual_seed(0)
    cfg = AscenderDistConfig(hidden_size=64, num_hidden_layers=1, layer_pattern="C",
                             connection=dict(num_slots=8, connection=connection, rank=4, causal_chunk_size=16))
    layer = AscenderDistForCausalLM(cfg).model.decoder.layers[0].self_attention.layer
    stds = layer.init_stds()
    for name in ("c",) if connection == "linear" else ("src", "tgt"):
        drawn = float(getattr(layer, name).std())
        assert abs(drawn / stds[name] - 1) < 0.2, (name, drawn, stds[name])
    assert abs(float(layer.w_v_out.std()) / stds["w_v_out"] - 1) < 0.2
