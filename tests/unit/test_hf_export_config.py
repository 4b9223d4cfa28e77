"""The Hugging Face configs an export writes: what a loaded model reads back from them."""

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict

MODEL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 64}


def test_neox_export_keeps_a_non_default_rope_base(tmp_path):
    """transformers 5 reads GPT-NeoX's RoPE base from rope_parameters: a config carrying only
    rope_theta loads with base 10000 and other logits, without an error."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from ascender_dist.tools.hf_export import neox_config

    cfg = config_from_dict({"model": {**MODEL, "rotary_base": 500000}})
    neox_config(cfg, vocab_size=64, tied=True).save_pretrained(tmp_path)
    model = GPTNeoXForCausalLM(GPTNeoXConfig.from_pretrained(tmp_path))
    head_dim = 32 // 4
    expected = 1.0 / 500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert torch.allclose(model.gpt_neox.rotary_emb.inv_freq.double(), expected, rtol=1e-6)


@pytest.mark.parametrize("saved_step, expected", [(0, 0), (1, 0), (5, 4)])
def test_remote_code_export_runs_the_step_the_weights_last_trained_with(saved_step, expected):
    """A save at step N follows training steps 0 .. N - 1 (the trainer counts a step after running
    it): with separation_start_step = N the weights never ran with Separation, nor did the
    validation at N, so the export must not switch it on."""
    from ascender_dist.tools.hf_export import remote_code_config

    cfg = config_from_dict({"model": {**MODEL, "architecture": "ascender",
                                      "ascender": {"separation_start_step": saved_step, "d_z": 4, "d_a": 4}}})
    config = remote_code_config(cfg, {"step": saved_step, "architecture": "ascender"}, vocab_size=64, tied=True)
    assert config.ascender_step == expected
    assert cfg.model.ascender.separation_active(config.ascender_step) == (saved_step == 0)


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_remote_code_export_stores_the_fixed_buffers_the_run_trained_with(precision, dtype):
    """A bf16 run held the Connection slots and ASCender's fixed per-head constants in bf16: the export
    stores those rounded values (in fp32), not freshly computed fp32 ones (1e-3 apart in the logits)."""
    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams
    from ascender_dist.models.connection import make_fixed_slots
    from ascender_dist.tools.hf_export import remote_code_config, remote_code_state

    cfg = config_from_dict({"model": {**MODEL, "layer_pattern": "CSA", "num_layers": 3,
                                      "ascender": {"d_z": 4, "d_a": 4, "lambda_sep": 0.3},
                                      "connection": {"causal_chunk_size": 16}},
                            "train": {"precision": precision}})
    config = remote_code_config(cfg, {"step": 3, "architecture": "gpt"}, vocab_size=64, tied=True)
    state = remote_code_state({}, config)
    hp = cfg.model.connection
    slots = state["model.decoder.layers.0.self_attention.layer.slots"]
    assert slots.dtype == torch.float32
    assert torch.equal(slots, make_fixed_slots(hp.num_slots, 32, hp.slot_seed, dtype).float())
    assert (precision == "fp32") == torch.equal(slots, make_fixed_slots(hp.num_slots, 32, hp.slot_seed))
    lambdas = state["model.decoder.layers.1.self_attention.core_attention.params.lambdas"]
    fixed = AscenderHeadParams(AscenderHParams(d_z=4, d_a=4, lambda_sep=0.3), 4, dtype=dtype)
    assert torch.equal(lambdas, fixed.lambdas.float())


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_exported_model_uses_the_alibi_slopes_the_run_trained_with(tmp_path, precision, dtype):
    """The slopes are not stored (a non-persistent buffer): the loaded model recomputes them. A bf16
    run trained with bf16-rounded slopes (AscenderHeadParams in the params dtype), so the export,
    loaded in fp32, must use those values, not fresh fp32 ones (12 heads: up to 8e-5 apart)."""
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams
    from ascender_dist.tools.convert import write_consolidated
    from ascender_dist.tools.hf_export import export_hf, remote_code_config

    ascender = {"d_z": 4, "d_a": 4, "other_bias": "alibi"}
    cfg = config_from_dict({"name": "alibi", "model": {**MODEL, "architecture": "ascender", "hidden_size": 48,
                                                       "num_attention_heads": 12, "ascender": ascender},
                            "train": {"precision": precision}})
    meta = {"step": 3, "architecture": "ascender", "vocab_size": 64}
    built = AscenderDistForCausalLM(remote_code_config(cfg, meta, vocab_size=64, tied=True))
    state = {k.removeprefix("model."): v for k, v in built.state_dict().items() if k != "lm_head.weight"}
    write_consolidated(tmp_path / "cons", state, cfg, meta)
    model = AscenderDistForCausalLM.from_pretrained(str(export_hf(tmp_path / "cons", tmp_path / "hf")))
    model(torch.arange(8)[None])  # the slopes are computed before the first forward
    slopes = model.model.decoder.layers[0].self_attention.core_attention.params.alibi_slope
    trained = AscenderHeadParams(AscenderHParams(**ascender), 12, dtype=dtype).alibi_slope
    assert slopes.dtype == torch.float32 and torch.equal(slopes, trained.float())


@pytest.mark.parametrize("architecture, section, field", [("ascender", "ascender", "lambda_sep"),
                                                          ("connection", "connection", "threshold")])
def test_a_config_json_with_a_non_finite_hyperparameter_is_refused_in_one_line(architecture, section, field):
    """config.json is read by Python's json (NaN / Infinity parse) and reaches the layers without the
    YAML loader's finiteness check: the remote-code model validates the hyper-parameters itself."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.hf_export import remote_code_config

    extra = {"hidden_size": 48, "num_attention_heads": 12, "ascender": {"d_z": 4, "d_a": 4}} if architecture == "ascender" \
        else {"num_layers": 2, "seq_length": 256}  # the connection pattern AC, several chunks
    cfg = config_from_dict({"name": "nan", "model": {**MODEL, "architecture": architecture, **extra}})
    config = remote_code_config(cfg, {"step": 3, "architecture": architecture, "vocab_size": 64}, vocab_size=64,
                                tied=True)
    AscenderDistForCausalLM(config)  # as exported: valid
    getattr(config, section)[field] = float("nan")
    with pytest.raises(ConfigError, match=rf"^{section}\.{field}: must be a finite number \(got nan\)$"):
        AscenderDistForCausalLM(config)
