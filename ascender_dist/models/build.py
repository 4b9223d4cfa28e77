"""Build the language model for this rank's pipeline stage from megatron-core pieces.

Embedding, TransformerBlock (through the architecture's ModuleSpec) and LM head are megatron-core's
GPTModel, so tensor and pipeline parallelism, sequence parallelism and dist-checkpointing come with it.
"""

from __future__ import annotations

from ascender_dist.config.resolve import Derived
from ascender_dist.config.schema import RunConfig
from ascender_dist.models.specs.block import block_spec
from ascender_dist.models.specs.norm import reduce_sequence_parallel_grads
from ascender_dist.parallel.megatron_config import to_transformer_config


def build_model(cfg: RunConfig, derived: Derived, pre_process: bool = True, post_process: bool = True):
    from megatron.core.models.gpt import GPTModel

    transformer_config = to_transformer_config(cfg, derived)
    spec = block_spec(cfg, transformer_config)
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=spec,
        vocab_size=derived.padded_vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
    )
    if cfg.parallel.sequence_parallel:
        reduce_sequence_parallel_grads(model)
    return model


def lm_loss(model, tokens):
    """Mean next-token cross entropy of ``tokens`` [b, s+1] (inputs and shifted labels from one sample)."""
    import torch

    inputs = tokens[:, :-1].contiguous()  # [b, s]
    labels = tokens[:, 1:].contiguous()  # [b, s]
    b, s = inputs.shape
    position_ids = torch.arange(s, device=inputs.device).unsqueeze(0).expand(b, s)
    per_token = model(inputs, position_ids, attention_mask=None, labels=labels)  # [b, s]
    return per_token.float().mean()
