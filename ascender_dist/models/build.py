"""Build the language model for this rank's pipeline stage from megatron-core pieces.

Embedding, TransformerBlock (through the architecture's ModuleSpec) and LM head are megatron-core's
GPTModel, so tensor and pipeline parallelism, sequence parallelism and dist-checkpointing come with it.
"""

from __future__ import annotations

import torch

from ascender_dist.config.layout import ModelLayout
from ascender_dist.config.schema import ModelConfig
from ascender_dist.models.specs.block import block_spec
from ascender_dist.models.specs.norm import reduce_sequence_parallel_grads
from ascender_dist.parallel.megatron_config import to_transformer_config


def build_model(model: ModelConfig, layout: ModelLayout, precision: str, seed: int,
                pre_process: bool = True, post_process: bool = True):
    """This rank's GPTModel of the model section ``model`` cut as ``layout`` says; ``precision``
    is ``train.precision`` and ``seed`` seeds what a layer initialises outside megatron's RNG
    (:func:`ascender_dist.models.registry.layer_spec`)."""
    from megatron.core.models.gpt import GPTModel

    transformer_config = to_transformer_config(model, layout, precision)
    spec = block_spec(model, seed, transformer_config)
    gpt = GPTModel(
        config=transformer_config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
    )
    if layout.sequence_parallel:
        reduce_sequence_parallel_grads(gpt)
    return gpt


def vocab_cross_entropy(logits, labels, vocab_size: int):
    """Per-token cross entropy [...] of vocab-parallel ``logits`` [..., v/tp] (this TP rank's slice of
    the padded vocabulary) against ``labels`` [...], normalised over the first ``vocab_size`` ids only.

    Megatron's loss would normalise over the padding ids too, so the loss would depend on the
    padding rows of the output layer: rows the tokenizer never emits, which exports strip and which
    a reshard to another padded size cannot carry. Their logits are set to -inf instead (zero
    probability, zero gradient), so training, exports and resharded runs compute one function."""
    import torch
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    upcast = logits.float()
    local = upcast.shape[-1]
    first = mps.get_tensor_model_parallel_rank() * local  # global id of this slice's first column
    if first + local > vocab_size:
        padding = torch.arange(first, first + local, device=upcast.device) >= vocab_size  # [v/tp]
        # in place into our own fp32 copy of bf16 logits (one logits-sized fp32 tensor less at the
        # peak: GiBs at long sequences and large vocabularies); fp32 logits are the model's own
        upcast = upcast.masked_fill_(padding, float("-inf")) if upcast is not logits else \
            upcast.masked_fill(padding, float("-inf"))
    logits = upcast
    return vocab_parallel_cross_entropy(logits.contiguous(), labels.contiguous())


def poison(loss):
    """The same loss value with NaN gradients: the optimizer's non-finite check will skip this step
    (how a step the loss guard judged bad is dropped on every rank; see training.guard). The value
    is kept so that what the pipeline engine reports for the step is the loss that was judged bad
    (a spike's size), not NaN."""
    return PoisonGradient.apply(loss)


class PoisonGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by NaN."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def lm_loss(model, tokens, vocab_size: int):
    """Mean next-token cross entropy of ``tokens`` [b, s+1] (inputs and shifted labels from one
    sample) over the first ``vocab_size`` ids (see :func:`vocab_cross_entropy`)."""
    import torch

    inputs = tokens[:, :-1].contiguous()  # [b, s]
    labels = tokens[:, 1:].contiguous()  # [b, s]
    b, s = inputs.shape
    position_ids = torch.arange(s, device=inputs.device).unsqueeze(0).expand(b, s)
    logits = model(inputs, position_ids, attention_mask=None)  # [b, s, v/tp]
    return vocab_cross_entropy(logits, labels, vocab_size).mean()
