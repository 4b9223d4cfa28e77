"""What a model builder is told about a launch besides the model section: how the model is cut
over ranks and how wide its vocabulary matrices are.

Model code (``ascender_dist.models`` and the megatron translation in
``ascender_dist.parallel.megatron_config``) takes ``(ModelConfig, ModelLayout, precision, seed)``,
never the run config; ``ascender_dist.training.engine.model_layout`` is the one place that maps a
run config and its derived values to a layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLayout:
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int  # the pipeline engine's topology needs it
    sequence_parallel: bool
    activation_checkpointing: bool
    padded_vocab_size: int  # rows of the embedding and output matrices (divisible by TP)
    vocab_size: int  # the tokenizer's ids; the loss ignores ids from here to padded_vocab_size
