"""Consolidated gpt weights -> a Hugging Face model directory of an architecture transformers ships.

Our GPT is megatron's: pre-norm, non-interleaved RoPE (rotate-half, as Hugging Face), exact GELU.
Two standard architectures express it without custom code:
  * GPT-NeoX: LayerNorm, GELU, biases, multi-head attention (QKV laid out per head as [q, k, v],
    which is megatron's per-group layout when every head is its own group), sequential residual;
  * Llama: RMSNorm, SwiGLU, no biases, grouped-query attention allowed (q/k/v split per group).
Anything else is refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ascender_dist.tools.convert import ConversionError, read_consolidated


def pick_hf_architecture(cfg) -> str:
    m = cfg.model
    if m.position_embedding_type != "rope":
        raise ConversionError("model.position_embedding_type", "Hugging Face export needs rope")
    groups = m.num_query_groups or m.num_attention_heads
    if m.normalization == "LayerNorm" and m.activation == "gelu" and m.add_bias_linear and groups == m.num_attention_heads:
        return "gpt_neox"
    if m.normalization == "RMSNorm" and m.activation == "swiglu" and not m.add_bias_linear:
        return "llama"
    raise ConversionError("model", "no standard Hugging Face architecture matches: use LayerNorm + gelu + biases + "
                                   "multi-head attention (GPT-NeoX) or RMSNorm + swiglu + no biases (Llama)")


def _layer(state, i: int, name: str) -> torch.Tensor:
    return state[f"decoder.layers.{i}.{name}"]


def _lm_head(state) -> torch.Tensor:
    return state.get("output_layer.weight", state["embedding.word_embeddings.weight"])


def neox_state(state: dict, cfg) -> dict:
    out = {"gpt_neox.embed_in.weight": state["embedding.word_embeddings.weight"],
           "gpt_neox.final_layer_norm.weight": state["decoder.final_layernorm.weight"],
           "gpt_neox.final_layer_norm.bias": state["decoder.final_layernorm.bias"],
           "embed_out.weight": _lm_head(state)}
    pairs = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
             "attention.query_key_value": "self_attention.linear_qkv", "attention.dense": "self_attention.linear_proj",
             "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
    for i in range(cfg.model.num_layers):
        for hf, ours in pairs.items():
            for kind in ("weight", "bias"):
                out[f"gpt_neox.layers.{i}.{hf}.{kind}"] = _layer(state, i, f"{ours}.{kind}")
    return out


def neox_config(cfg, vocab_size: int, tied: bool):
    from transformers import GPTNeoXConfig

    m = cfg.model
    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
        hidden_act="gelu", rotary_pct=1.0, rope_theta=float(m.rotary_base), max_position_embeddings=m.seq_length,
        layer_norm_eps=m.layernorm_epsilon, use_parallel_residual=False, tie_word_embeddings=tied,
        attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
    )


def llama_state(state: dict, cfg) -> dict:
    m = cfg.model
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    hn = m.hidden_size // heads
    per_group = heads // groups
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"], "lm_head.weight": _lm_head(state)}
    for i in range(m.num_layers):
        qkv = _layer(state, i, "self_attention.linear_qkv.weight").view(groups, (per_group + 2) * hn, m.hidden_size)
        q, k, v = torch.split(qkv, [per_group * hn, hn, hn], dim=1)  # each [ng, rows, h]
        fc1 = _layer(state, i, "mlp.linear_fc1.weight")  # [gate; up]
        prefix = f"model.layers.{i}"
        out.update({
            f"{prefix}.input_layernorm.weight": _layer(state, i, "input_layernorm.weight"),
            f"{prefix}.post_attention_layernorm.weight": _layer(state, i, "pre_mlp_layernorm.weight"),
            f"{prefix}.self_attn.q_proj.weight": q.reshape(heads * hn, m.hidden_size),
            f"{prefix}.self_attn.k_proj.weight": k.reshape(groups * hn, m.hidden_size),
            f"{prefix}.self_attn.v_proj.weight": v.reshape(groups * hn, m.hidden_size),
            f"{prefix}.self_attn.o_proj.weight": _layer(state, i, "self_attention.linear_proj.weight"),
            f"{prefix}.mlp.gate_proj.weight": fc1[:ffn], f"{prefix}.mlp.up_proj.weight": fc1[ffn:],
            f"{prefix}.mlp.down_proj.weight": _layer(state, i, "mlp.linear_fc2.weight"),
        })
    return out


def llama_config(cfg, vocab_size: int, tied: bool):
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size, hidden_act="silu", rms_norm_eps=m.layernorm_epsilon,
        rope_theta=float(m.rotary_base), max_position_embeddings=m.seq_length, tie_word_embeddings=tied,
        attention_bias=False, mlp_bias=False,
    )


def export_hf(consolidated_dir: Path, out_dir: Path, tokenizer: str | None = None) -> Path:
    """Write ``out_dir`` (config.json + model.safetensors [+ tokenizer.model]) for ``from_pretrained``."""
    import shutil

    from safetensors.torch import save_file

    state, cfg, meta = read_consolidated(consolidated_dir, expect_architecture="gpt")
    kind = pick_hf_architecture(cfg)
    tied = not cfg.model.untie_embeddings_and_output_weights
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    hf_state = neox_state(state, cfg) if kind == "gpt_neox" else llama_state(state, cfg)
    config = (neox_config if kind == "gpt_neox" else llama_config)(cfg, vocab, tied)
    if tied:  # transformers re-ties on load; storing the head twice would fail its shared-tensor check
        hf_state.pop("embed_out.weight" if kind == "gpt_neox" else "lm_head.weight")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer:
        shutil.copy(tokenizer, tmp / "tokenizer.model")
    (tmp / "ascender_dist.json").write_text(json.dumps({"source": str(consolidated_dir), "architecture": kind,
                                                        "step": meta.get("step")}, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
