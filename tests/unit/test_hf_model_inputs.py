"""What the exported (remote-code) model refuses instead of ignoring or computing outside its
training: positions past the trained context, a KV cache, inputs_embeds, a mask shaped unlike the
ids, an empty sequence; and the sentencepiece tokenizer's left padding and context length."""

import json
import re

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401  (fixtures)

MODEL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16}
EXTRA = {"gpt": {}, "ascender": {"ascender": {"d_z": 4, "d_a": 4, "k": 2, "window": 4}},
         "connection": {"num_layers": 2, "connection": {"num_slots": 4, "rank": 4, "causal_chunk_size": 8}},
         "gpt_learned": {"position_embedding_type": "learned_absolute"}}


def _model(kind: str):
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.hf_export import remote_code_config

    architecture = "gpt" if kind.startswith("gpt") else kind
    cfg = config_from_dict({"name": kind, "model": {**MODEL, "architecture": architecture, **EXTRA[kind]}})
    config = remote_code_config(cfg, {"step": 3, "architecture": architecture, "vocab_size": 64}, vocab_size=64,
                                tied=True)
    torch.manual_seed(0)
    return AscenderDistForCausalLM(config).eval()


@pytest.mark.parametrize("kind", list(EXTRA))
def test_positions_past_the_trained_context_are_refused(kind):
    """RoPE models returned logits for positions they never trained on; learned positions raised an
    IndexError from inside the embedding (mid-generation for generate())."""
    model = _model(kind)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert model(ids).logits.shape == (2, 16, 64)  # the whole trained context: fine
        message = re.escape("positions up to 17 but the model was trained on 16 (max_position_embeddings)")
        with pytest.raises(ValueError, match=message):
            model(torch.randint(0, 64, (2, 17)))
        with pytest.raises(ValueError, match=message):
            model(ids[:, :4], position_ids=torch.arange(13, 17).unsqueeze(0))
        with pytest.raises(ValueError, match="positions up to 17"):
            model.generate(ids[:1], max_new_tokens=2, do_sample=False)


def test_inputs_it_would_ignore_are_refused():
    """A cache passed with only the new token scored it as a whole sequence (logits off by 7.6 from
    the full forward, no error); inputs_embeds and a mask of another shape were ignored."""
    from transformers import DynamicCache

    model = _model("ascender")
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        reference = model(ids).logits
        cache = DynamicCache()
        cache.update(torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 5, 8), 0)
        with pytest.raises(ValueError, match="^past_key_values: this model keeps no KV cache"):
            model(ids[:, -1:], past_key_values=cache)
        assert torch.equal(model(ids, past_key_values=DynamicCache()).logits, reference)  # empty: nothing lost
        with pytest.raises(ValueError, match="^input_ids is required and inputs_embeds is not supported$"):
            model(ids, inputs_embeds=torch.zeros(2, 6, 32))
        with pytest.raises(ValueError, match=r"^attention_mask has shape \(2, 3\), input_ids \(2, 6\)"):
            model(ids, attention_mask=torch.ones(2, 3, dtype=torch.long))
        with pytest.raises(ValueError, match="^input_ids holds no token$"):
            model(ids[:, :0])
        out = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)  # generate() passes no cache
    assert out.shape == (1, 7) and torch.equal(out[:, :4], ids[:1, :4])


def test_the_sentencepiece_tokenizer_pads_left_to_the_trained_context(tmp_path, tiny_tokenizer):  # noqa: F811
    """An older export (tokenizer.model only) got a tokenizer padding on the right, which generate()
    refuses, and no context length, so truncation=True never truncated."""
    from ascender_dist.tools.lm_eval_adapter import load_tokenizer

    (tmp_path / "tokenizer.model").write_bytes(tiny_tokenizer.model_path.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 16}))
    tok = load_tokenizer(tmp_path)
    assert tok.padding_side == "left" and tok.model_max_length == 16
    batch = tok(["a", "a b c d e f"], padding=True)
    assert batch["attention_mask"][0][0] == 0 and batch["attention_mask"][0][-1] == 1
    assert len(tok("word " * 40, truncation=True)["input_ids"]) == 16

