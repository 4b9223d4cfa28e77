"""ASCender attention wired into megatron-core through a ModuleSpec.

Three pieces, each replacing one submodule of megatron's SelfAttention:

* :class:`AscenderQKVLinear` - the fused column-parallel QKV projection grows the per-head latent
  (``z = x U``, ``d_z``) and semantic (``h = x P``, ``d_a``) projections. Its output is laid out
  per query group, ``[q_g | k_g | v_g | z_g | h_g]``, so tensor parallelism (which splits the
  output dim into contiguous blocks of whole groups) shards whole heads together with their U, P.
* :class:`AscenderSelfAttention` - splits that output and hands the core attention a query tensor
  ``[sq, b, np, hn + d_z + d_a]`` (q | z | h). RoPE rotates only the first ``hn`` channels and
  passes the rest through, so z and h reach the core attention unrotated.
* :class:`AscenderCoreAttention` - the pure-torch ASCender math
  (:func:`ascender_dist.models.ascender.ascender_attention`) on the TP-local heads, owning the
  per-head learned parameters (tagged for TP and sharded in dist-checkpointing along the head dim;
  a shared omega is replicated instead, its gradient summed over TP).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ascender_dist.models.ascender import AscenderHParams, AscenderHeadParams, ascender_attention
from ascender_dist.models.specs.norm import local_layer_spec, sum_grad_over_tp
from ascender_dist.models.specs.step_stats import accumulate_stats


class AscenderQKVLinear(ColumnParallelLinear):
    """QKV projection whose output also carries ``num_attention_heads * (d_z + d_a)`` channels."""

    def __init__(self, input_size: int, output_size: int, *, config, extra_per_head: int, **kwargs):
        self.extra_per_head = extra_per_head
        super().__init__(input_size, output_size + config.num_attention_heads * extra_per_head,
                         config=config, **kwargs)


class AscenderSelfAttention(SelfAttention):
    """SelfAttention whose query carries z and h for the ASCender core attention."""

    def __init__(self, config, submodules, *args, extra_dims: tuple[int, int], **kwargs):
        self.d_z, self.d_a = extra_dims
        super().__init__(config, submodules, *args, **kwargs)
        if not isinstance(self.q_layernorm, (IdentityOp, type(None))) or not isinstance(
                self.k_layernorm, (IdentityOp, type(None))):
            raise ValueError("ASCender attention does not support q/k layernorm")

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                    split_qkv=True):
        if output_gate or not split_qkv:
            raise ValueError("ASCender attention needs split_qkv=True and no output gate")
        mixed, _ = self.linear_qkv(hidden_states)  # [sq, b, ng * per_group]
        heads = self.num_attention_heads_per_partition
        groups = self.num_query_groups_per_partition
        per_group_heads = heads // groups
        hn = self.hidden_size_per_attention_head
        sizes = [per_group_heads * hn, hn, hn, per_group_heads * self.d_z, per_group_heads * self.d_a]
        mixed = mixed.view(*mixed.shape[:-1], groups, sum(sizes))  # [sq, b, ng, per_group]
        q, k, v, z, h = torch.split(mixed, sizes, dim=3)
        sq, b = mixed.shape[:2]
        q = q.reshape(sq, b, heads, hn)  # [sq, b, np, hn]
        z = z.reshape(sq, b, heads, self.d_z)  # [sq, b, np, d_z]
        h = h.reshape(sq, b, heads, self.d_a)  # [sq, b, np, d_a]
        query = torch.cat([q, z, h], dim=-1)  # [sq, b, np, hn + d_z + d_a]
        return query, k, v  # k, v: [sq, b, ng, hn]


class AscenderCoreAttention(MegatronModule):
    """Core attention: ASCender over the TP-local heads. Input/output as megatron's DotProductAttention."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, *, hp: AscenderHParams,
                 impl: str = "auto"):
        super().__init__(config=config)
        self.hp = hp
        self.impl = impl
        self.layer_number = layer_number
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = config.num_query_groups // tp_size
        self.head_dim = config.kv_channels
        scale = 1.0 / math.sqrt(self.head_dim)
        if softmax_scale is not None and not math.isclose(softmax_scale, scale):
            raise ValueError("ASCender attention scales scores by 1/sqrt(head_dim)")
        self.params = AscenderHeadParams(hp, self.num_heads, global_num_heads=config.num_attention_heads,
                                         head_offset=tp_rank * self.num_heads, dtype=config.params_dtype)
        for name, param in self.params.named_parameters():
            param.no_weight_decay = True  # gains per head (or per layer), not matrices
            if name in AscenderHeadParams.SHARED_TENSORS:
                # shared omega [1, 3]: the same tensor on every TP rank (not partitioned: checkpoint
                # consolidation copies it once), each rank's gradient covers only its own heads
                sum_grad_over_tp(param)
            else:
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
        # protocol of ascender_dist.training.layer_stats (set by the trainer)
        self.training_step = 0  # Separation joins after its warm-up step
        self.collect_stats = False  # on logging steps: omega and attention mass moved per head
        self.last_stats: dict = {}
        self.stats_forwards = 0
        self.stats_prefix = "ascender"
        self.stats_per_head = True

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ASCender attention supports neither packed sequences nor an extra attention_bias")
        hn, dz = self.head_dim, self.hp.d_z
        q, z, h = torch.split(query, [hn, dz, self.hp.d_a], dim=-1)  # each [sq, b, np, .]
        repeat = self.num_heads // self.num_groups
        if repeat > 1:  # grouped-query attention: each query head reads its group's k, v
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731  [sq, b, np, d] -> [b, np, sq, d]
        result = ascender_attention(
            to_bhsd(q), to_bhsd(key), to_bhsd(value), to_bhsd(z), to_bhsd(h), self.params, self.hp,
            step=self.training_step, return_decomposition=self.collect_stats, impl=self.impl,
        )
        if self.collect_stats:
            out, info = result
            self.last_stats = accumulate_stats(self.last_stats, info["stats"], self.stats_forwards)
            self.stats_forwards += 1
        else:
            out = result
        b, np_, sq, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * d)  # [sq, b, np * hn]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = self.state_dict(prefix="", keep_vars=True)
        # per-head tensors are split along the head dim; a shared omega is replicated over TP
        per_head = {name: 0 for name in state if name.rsplit(".", 1)[-1] not in AscenderHeadParams.SHARED_TENSORS}
        return make_sharded_tensors_for_checkpoint(state, prefix, per_head, sharded_offsets)


def ascender_layer_spec(hp: AscenderHParams, normalization: str, impl: str = "auto") -> ModuleSpec:
    """megatron's local GPT layer with its self-attention swapped for ASCender."""
    spec = local_layer_spec(normalization)
    attention = spec.submodules.self_attention
    attention.module = AscenderSelfAttention
    attention.params = {**attention.params, "extra_dims": (hp.d_z, hp.d_a)}
    attention.submodules.linear_qkv = ModuleSpec(module=AscenderQKVLinear,
                                                 params={"extra_per_head": hp.d_z + hp.d_a})
    attention.submodules.core_attention = ModuleSpec(module=AscenderCoreAttention, params={"hp": hp, "impl": impl})
    return spec
