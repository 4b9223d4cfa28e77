"""The custom layers refuse the megatron inputs they have no meaning for (packed THD batches,
KV-cache inference, an extra attention bias) with one line, instead of computing something else;
the None values megatron's TransformerLayer passes in training are accepted."""

import pytest
import torch

from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)
from tests.unit.test_model_causality import MODELS, _build

# what megatron's TransformerLayer passes to self_attention in training
TRAINING_KWARGS = dict(inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                       attention_bias=None, packed_seq_params=None, sequence_len_offset=None)


def _first(model, cls):
    return next(m for m in model.modules() if isinstance(m, cls))


@pytest.mark.parametrize("name", ["packed_seq_params", "inference_context", "inference_params", "attention_bias"])
def test_connection_layer_refuses_inputs_it_cannot_honour(single_rank_group, name):
    from ascender_dist.models.specs.connection import ConnectionSelfAttention

    layer = _first(_build(MODELS["connection"]), ConnectionSelfAttention)
    hidden = torch.randn(8, 2, 64)  # [s, b, h]
    out, bias = layer(hidden, None, **TRAINING_KWARGS)
    assert out.shape == hidden.shape and bias is None
    with pytest.raises(ValueError, match=f"Connection layer supports neither .*got {name}"):
        layer(hidden, None, **{**TRAINING_KWARGS, name: object()})


def test_ascender_core_attention_refuses_packed_sequences(single_rank_group):
    from ascender_dist.models.specs.ascender import AscenderCoreAttention

    core = _first(_build(MODELS["ascender"]), AscenderCoreAttention)
    with pytest.raises(ValueError, match="neither packed sequences"):
        core(None, None, None, None, packed_seq_params=object())
