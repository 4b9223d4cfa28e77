"""Initialisation does not depend on the tensor-parallel size on a GPU either."""

import torch

from ascender_dist.config.layout import ModelLayout
from ascender_dist.config.resolve import config_from_dict


def test_weights_are_initialised_on_the_cpu_path_also_when_a_gpu_is_visible(monkeypatch):
    """megatron's GPU initialisation seeds each TP shard by (seed, tp_rank): a TP=2 model started from
    other weights than TP=1 on a GPU (the CPU path draws every weight whole, then keeps the shard)."""
    from ascender_dist.parallel.megatron_config import to_transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config_from_dict({"model": {"preset": "debug"}})
    layout = ModelLayout(tensor_parallel=2, pipeline_parallel=1, data_parallel=1, sequence_parallel=False,
                         activation_checkpointing=False, padded_vocab_size=128, vocab_size=128)
    assert to_transformer_config(cfg.model, layout, "bf16").use_cpu_initialization is True
