"""The Connection Transformer layer wired into megatron-core as a self-attention replacement.

megatron's TransformerLayer calls ``self_attention(hidden [s, b, h], attention_mask, ...)`` and
expects ``(output, bias)``; :class:`ConnectionSelfAttention` adapts the pure-torch
:class:`~ascender_dist.models.connection.ConnectionLayer` to that, passing megatron's TP
collectives as its communication hooks and tagging each sharded weight with its partition dim
(so DeepSpeed's grad-norm and our consolidation treat it as sharded).

Initialisation is TP-invariant: every rank draws the FULL layer from a generator seeded by
(seed, layer number) and keeps its shard, so a model has the same weights at any TP size.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ascender_dist.models.connection import TP_SHARD_DIM, ConnectionHParams, ConnectionLayer, shard_state_dict
from ascender_dist.models.specs.norm import local_layer_spec

# inputs megatron's TransformerLayer may pass that the Connection layer has no meaning for: packed
# (THD) batches, KV-cache inference and an extra attention bias
UNSUPPORTED_INPUTS = ("packed_seq_params", "inference_context", "inference_params", "attention_bias")
from ascender_dist.models.specs.step_stats import accumulate_stats
from ascender_dist.parallel.mappings import copy_to_tp, reduce_from_tp


class ConnectionSelfAttention(MegatronModule):
    def __init__(self, config, submodules=None, layer_number: int = 1, attn_mask_type=None, cp_comm_type=None,
                 pg_collection=None, *, hp: ConnectionHParams, init_seed: int = 1234):
        super().__init__(config=config)
        if config.sequence_parallel:
            raise ValueError("the Connection layer does not support sequence parallelism")
        self.layer_number = layer_number
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.random.fork_rng(devices=[]):  # its draws are overwritten below: they must not use the global stream
            self.layer = ConnectionLayer(
                hp, config.hidden_size, tp_size=tp_size, tp_rank=tp_rank,
                reduce_fn=reduce_from_tp,
                copy_fn=copy_to_tp,
                gather_fn=gather_from_tensor_model_parallel_region,
                dtype=config.params_dtype,
            )
        # the global stream moves by two full layers' draws at every TP size (this one, and the unsharded
        # copy _init_tp_invariant builds before reseeding it), so the layers built after this one get
        # the same initial weights at any TP size
        ConnectionLayer(hp, config.hidden_size, dtype=config.params_dtype)
        self._init_tp_invariant(hp, config.hidden_size, tp_size, tp_rank, init_seed + 1000 * layer_number)
        for name, param in self.layer.named_parameters():
            dim = TP_SHARD_DIM[name]
            if dim is not None and tp_size > 1:
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
        # protocol of ascender_dist.training.layer_stats
        self.collect_stats = False
        self.last_stats: dict = {}
        self.stats_forwards = 0
        self.stats_prefix = "connection"
        self.stats_per_head = False

    @torch.no_grad()
    def _init_tp_invariant(self, hp, hidden_size: int, tp_size: int, tp_rank: int, seed: int) -> None:
        full = ConnectionLayer(hp, hidden_size, dtype=torch.float32)
        full.reset_parameters(generator=torch.Generator().manual_seed(seed))
        shards = shard_state_dict({k: v for k, v in full.state_dict().items()}, tp_size, tp_rank)
        for name, param in self.layer.named_parameters():
            param.copy_(shards[name])

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        refused = [name for name in UNSUPPORTED_INPUTS if kwargs.get(name) is not None]
        if refused:  # the layer would silently compute something else for them
            raise ValueError(f"the Connection layer supports neither packed sequences, KV-cache inference nor an "
                             f"extra attention bias (got {', '.join(refused)})")
        output = self.layer(hidden_states)  # [s, b, h]
        if self.collect_stats and self.layer.last_stats is not None:
            steps = self.layer.last_stats.input_steps().float()  # a causal layer's bare-slot state left out
            new = {"steps_mean": steps.mean(), "steps_max": steps.max()}
            self.last_stats = accumulate_stats(self.last_stats, new, self.stats_forwards)
            self.stats_forwards += 1
        return output, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = self.state_dict(prefix="", keep_vars=True)
        axis = {name: TP_SHARD_DIM[name.split(".")[-1]] for name in state
                if TP_SHARD_DIM.get(name.split(".")[-1]) is not None}
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)


def connection_layer_spec(hp: ConnectionHParams, normalization: str, init_seed: int) -> ModuleSpec:
    """megatron's local GPT layer with self-attention replaced by the Connection layer."""
    spec = local_layer_spec(normalization)
    spec.submodules.self_attention = ModuleSpec(module=ConnectionSelfAttention,
                                                params={"hp": hp, "init_seed": init_seed})
    return spec
