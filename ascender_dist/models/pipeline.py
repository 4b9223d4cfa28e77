"""Pipeline parallelism: DeepSpeed's pipeline engine over megatron-core layers (the one PP path).

The model is the same as :func:`ascender_dist.models.build.build_model` (megatron's GPTModel),
cut into a sequence DeepSpeed's ``PipelineModule`` can partition:

    [EmbeddingPipe] + [TransformerLayerPipe] * num_layers + [FinalNormPipe, LMHeadPipe]

Layers are split by ``partition_method="type:TransformerLayerPipe"``, i.e. num_layers / PP
transformer layers per stage, embedding on the first stage and head on the last: exactly
megatron's own layer offsets, so each megatron TransformerLayer gets its true global number.
Tied input/output embeddings use DeepSpeed's ``TiedLayerSpec`` (DeepSpeed all-reduces the tied
weight's gradient between first and last stage).

Parameter names differ from GPTModel's; :func:`canonical_name` maps them back, so checkpoints
consolidate into one naming whatever the layout.
"""

from __future__ import annotations

import re
from contextlib import nullcontext

import torch
from torch import nn

from ascender_dist.config.architectures import expand_layer_pattern
from ascender_dist.config.layout import ModelLayout
from ascender_dist.config.schema import ModelConfig
from ascender_dist.models.build import poison
from ascender_dist.models.registry import layer_spec
from ascender_dist.parallel.megatron_config import to_transformer_config

TIED_KEY = "embed"


class EmbeddingPipe(nn.Module):
    """token ids [b, s] -> hidden [s, b, h]; on the last stage (tied) it also projects to logits."""

    def __init__(self, model: ModelConfig, layout: ModelLayout, config):
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.tensor_parallel import ColumnParallelLinear

        self.embedding = LanguageModelEmbedding(
            config=config, vocab_size=layout.padded_vocab_size, max_sequence_length=model.seq_length,
            position_embedding_type=model.position_embedding_type)
        # weightless projection used with the tied word embeddings on the last stage
        self.head = ColumnParallelLinear(config.hidden_size, layout.padded_vocab_size, config=config,
                                         init_method=config.init_method, bias=False, gather_output=False,
                                         skip_weight_param_allocation=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        return self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]


def tied_lm_head(module: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    logits, _ = module.head(hidden, weight=module.embedding.word_embeddings.weight)
    return logits  # [s, b, v/tp]


class TransformerLayerPipe(nn.Module):
    """One megatron TransformerLayer (any layer kind); computes its rotary embedding locally."""

    def __init__(self, model: ModelConfig, seed: int, config, global_layer_number: int):
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        letter = expand_layer_pattern(model)[global_layer_number - 1]
        local_number = global_layer_number - get_transformer_layer_offset(config)
        if not 1 <= local_number <= model.num_layers // config.pipeline_model_parallel_size:
            raise RuntimeError(f"layer {global_layer_number} is not on this pipeline stage")
        self.layer = build_module(layer_spec(letter, model, seed), config=config,
                                  layer_number=local_number)  # megatron adds the stage offset itself
        self.rotary = None
        if model.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                          rotary_base=model.rotary_base,
                                          use_cpu_initialization=config.use_cpu_initialization)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rotary = None
        if self.rotary is not None:
            seq = hidden.shape[0] * (self.layer.config.tensor_model_parallel_size
                                     if self.layer.config.sequence_parallel else 1)
            rotary = self.rotary(seq)
        with self._rng_context():
            output, _ = self.layer(hidden, attention_mask=None, rotary_pos_emb=rotary)
        # the pipeline sends a stage's last output as it is, and gloo and NCCL send only contiguous
        # tensors: a Connection layer's [s, b, h] is a transposed view of its [b, s, h] result, which
        # the residual add keeps in eval (no dropout), so a middle stage's validation failed there
        return output.contiguous()

    def _rng_context(self):
        """Under sequence parallelism each TP rank holds other tokens, so dropout draws from the
        model-parallel RNG stream (one per TP rank), as megatron's TransformerBlock does around its
        layers; consecutive forks continue one stream, so a stage's layers draw what the block's would."""
        if not self.layer.config.sequence_parallel:
            return nullcontext()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()


class FinalNormPipe(nn.Module):
    def __init__(self, config):
        super().__init__()
        from ascender_dist.models.specs.norm import TPSafeNorm

        self.final_layernorm = TPSafeNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(hidden)


class LMHeadPipe(nn.Module):
    """Untied output projection (GPTModel's ``output_layer``)."""

    def __init__(self, layout: ModelLayout, config):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear

        self.output_layer = ColumnParallelLinear(config.hidden_size, layout.padded_vocab_size, config=config,
                                                 init_method=config.init_method, bias=False, gather_output=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, _ = self.output_layer(hidden)
        return logits


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean next-token cross entropy over the vocab-parallel logits [s, b, v/tp]; labels [b, s];
    normalised over the first ``vocab_size`` ids like :func:`ascender_dist.models.build.lm_loss`."""
    from ascender_dist.models.build import vocab_cross_entropy

    return vocab_cross_entropy(logits, labels.transpose(0, 1), vocab_size).mean()


class GuardedPipelineLoss:
    """The pipeline's loss function; a bad micro-batch loss (``guard.is_bad``) is poisoned so the
    optimizer skips the step on every rank (see :mod:`ascender_dist.training.guard`). Only in
    training: DeepSpeed's eval_batch runs the same function under no_grad, and a validation loss is
    reported as it is."""

    def __init__(self, vocab_size: int, guard=None):
        self.vocab_size = vocab_size
        self.guard = guard

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            # eval_batch(return_logits=True) hands these logits back to its caller, and megatron's
            # loss works in place on fp32 logits (leaving probabilities): the loss gets a copy
            logits = logits.clone()
        loss = pipeline_loss(logits, labels, self.vocab_size)
        if self.guard is not None and torch.is_grad_enabled() and self.guard.is_bad(loss.item()):
            return poison(loss)
        return loss


def recompute_layers(function, *args):
    """Activation checkpointing of the pipeline's layers through megatron's checkpoint, which
    restores megatron's model-parallel RNG tracker for the recompute (DeepSpeed's default restores
    only its own): the dropout drawn from that tracker (megatron's attention dropout, every dropout
    under sequence parallelism) then draws the forward's masks again and the gradients are exact."""
    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(function, False, *args)


def build_pipeline_module(model: ModelConfig, layout: ModelLayout, precision: str, seed: int, guard=None):
    """The PipelineModule of the model section ``model`` cut as ``layout`` says; ``precision`` and
    ``seed`` as in :func:`ascender_dist.models.build.build_model`."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    config = to_transformer_config(model, layout, precision)
    tied = not model.untie_embeddings_and_output_weights
    weight = "embedding.word_embeddings.weight"
    specs = [TiedLayerSpec(TIED_KEY, EmbeddingPipe, model, layout, config, tied_weight_attr=weight) if tied
             else LayerSpec(EmbeddingPipe, model, layout, config)]
    specs += [LayerSpec(TransformerLayerPipe, model, seed, config, n) for n in range(1, model.num_layers + 1)]
    specs.append(LayerSpec(FinalNormPipe, config))
    specs.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, model, layout, config, forward_fn=tied_lm_head,
                               tied_weight_attr=weight) if tied else LayerSpec(LMHeadPipe, layout, config))
    topology = PipeModelDataParallelTopology(num_pp=layout.pipeline_parallel,
                                             num_mp=layout.tensor_parallel,
                                             num_dp=layout.data_parallel)
    module = PipelineModule(
        layers=specs, topology=topology, loss_fn=GuardedPipelineLoss(layout.vocab_size, guard), partition_method="type:TransformerLayerPipe",
        activation_checkpoint_interval=1 if layout.activation_checkpointing else 0,
        activation_checkpoint_func=recompute_layers,
        checkpointable_layers=["TransformerLayerPipe"],
    )
    if layout.sequence_parallel:
        from ascender_dist.models.specs.norm import reduce_sequence_parallel_grads

        reduce_sequence_parallel_grads(module)
    return module


_LAYER_RE = re.compile(r"^(\d+)\.(.*)$")


def canonical_name(name: str, num_layers: int) -> str:
    """PipelineModule parameter name -> GPTModel's name (the checkpoint-independent naming)."""
    if name.startswith(f"tied_modules.{TIED_KEY}."):
        return name[len(f"tied_modules.{TIED_KEY}."):]
    match = _LAYER_RE.match(name)
    if not match:
        raise KeyError(f"unexpected pipeline parameter name {name!r}")
    index, rest = int(match.group(1)), match.group(2)
    if index == 0:
        return rest  # embedding.*
    if index <= num_layers:
        return f"decoder.layers.{index - 1}.{rest.removeprefix('layer.')}"
    if rest.startswith("final_layernorm."):
        return f"decoder.{rest}"
    return rest  # output_layer.*
