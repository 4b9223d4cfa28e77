"""A plain-torch decoder that computes exactly what our megatron GPTModel computes at TP=1.

Loaded by ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` from a directory
written by ``ascender-dist export-hf``; needs only torch and transformers (the ASCender and
Connection math comes from ``ascender_dist_kernels.py`` next to this file, see there).

Per layer, as megatron's local transformer layer: pre-norm -> mixing layer chosen by the layer's
letter in ``config.layer_pattern`` -> residual add -> pre-MLP norm -> MLP -> residual add; then the
final norm and the (tied or untied) LM head. Hidden states are ``[s, b, h]`` inside the decoder,
as in megatron, so the order of operations matches it.

* ``A``: softmax attention; fused QKV laid out per query group ``[q_g | k_g | v_g]``; RoPE is
  megatron's non-interleaved rotate-half with ``inv_freq = base^(-2i/d)`` over the whole head, at
  ``position_ids`` (per batch row; default ``0..s-1``); scores scaled by ``1/sqrt(head_dim)``, causal.
* ``S``: ASCender; fused QKV per group ``[q_g | k_g | v_g | z_g | h_g]``, RoPE on q and k only,
  then :func:`ascender_attention` on ``[b, heads, s, .]`` with the learned per-head parameters
  (``self_attention.core_attention.params.*``).
* ``C``: the Connection layer (:class:`ConnectionLayer` at TP=1) in place of attention, no bias.

MLP: ``linear_fc1`` -> gelu (exact) or swiglu (``linear_fc1 = [gate; up]``, ``silu(gate) * up``)
-> ``linear_fc2``. Parameter names are ``model.`` + megatron's canonical names (``lm_head.weight``
for ``output_layer.weight``), so an export is a renaming, never a reshuffle of the weights.

No KV cache: generation recomputes the prefix every step. Right padding needs nothing (every
layer is causal); rows with left padding (batched generation) run one by one on their real tokens,
since ASCender and Connection layers take no padding mask.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .ascender_dist_kernels import (
    AscenderHeadParams,
    AscenderHParams,
    ConnectionHParams,
    ConnectionLayer,
    alibi_slopes,
    ascender_attention,
    make_fixed_slots,
)
from .configuration_ascender_dist import AscenderDistConfig


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """As megatron's linear layers: matmul, then the bias as a separate add."""
    y = torch.matmul(x, layer.weight.t())
    return y if layer.bias is None else y + layer.bias


def _norm(config: AscenderDistConfig) -> nn.Module:
    if config.normalization == "LayerNorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    raise ValueError(f"normalization must be LayerNorm or RMSNorm (got {config.normalization!r})")


def _hparams(cls, values: dict):
    known = {f for f in cls.__dataclass_fields__}
    return cls(**{k: v for k, v in values.items() if k in known})


def trained_buffer_dtype(config) -> torch.dtype:
    """The dtype the run held its fixed buffers in (its params dtype; ``config.ascender_dist``'s
    ``precision``, written by export-hf): a bf16 run trained against bf16-rounded ALiBi slopes,
    Connection slots and per-head constants, so the exported model uses those values (in fp32)."""
    precision = (getattr(config, "ascender_dist", None) or {}).get("precision")
    return torch.bfloat16 if precision == "bf16" else torch.float32


# ----------------------------------------------------------------------------- rotary embedding
def rotary_cos_sin(seq_len: int, dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's RotaryEmbedding (fp32): freqs [s, 1, 1, dim] as cat(f, f), cos and sin of it."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    seq = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return torch.cos(emb), torch.sin(emb)


def rotary_for_positions(position_ids: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, b, 1, dim] of the positions ``position_ids`` [b, s] (each batch row its own): the
    rows of :func:`rotary_cos_sin` up to the largest position, gathered by position id, so offset
    positions rotate q and k as they shift learned position embeddings (``arange`` gives exactly
    the values of the default)."""
    if position_ids.numel() and int(position_ids.min()) < 0:
        raise ValueError(f"position_ids must be >= 0 (got {int(position_ids.min())})")
    length = int(position_ids.max()) + 1 if position_ids.numel() else 0
    cos, sin = rotary_cos_sin(length, dim, base, position_ids.device)
    index = position_ids.long().t()  # [s, b]
    return cos[:, 0, 0][index].unsqueeze(2), sin[:, 0, 0][index].unsqueeze(2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [s, b, n, d]: rotate the first ``cos.shape[-1]`` channels, pass the rest through."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    t_rot = t_rot * cos.to(t.dtype) + _rotate_half(t_rot) * sin.to(t.dtype)
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.shape[-1] else t_rot


# ----------------------------------------------------------------------------- mixing layers
class SoftmaxAttention(nn.Module):
    """Layer kind ``A``: megatron's SelfAttention + DotProductAttention (causal, GQA allowed)."""

    def __init__(self, config: AscenderDistConfig, extra_per_head: int = 0):
        super().__init__()
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_query_groups, config.head_dim
        out = (self.heads + 2 * self.groups) * self.head_dim + self.heads * extra_per_head
        self.linear_qkv = nn.Linear(config.hidden_size, out, bias=config.add_bias_linear)
        self.linear_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        self.extra_per_head = extra_per_head

    def split_qkv(self, hidden: torch.Tensor, extra: tuple[int, int] = (0, 0)):
        """[s, b, h] -> q [s, b, np, hn], k, v [s, b, ng, hn] (+ z, h [s, b, np, d] for ASCender)."""
        s, b = hidden.shape[:2]
        per_group = self.heads // self.groups
        hn = self.head_dim
        sizes = [per_group * hn, hn, hn] + [per_group * d for d in extra if d]
        mixed = _linear(hidden, self.linear_qkv).view(s, b, self.groups, sum(sizes))
        parts = torch.split(mixed, sizes, dim=3)
        q = parts[0].reshape(s, b, self.heads, hn)
        rest = [p.reshape(s, b, self.heads, -1) for p in parts[3:]]
        return q, parts[1], parts[2], rest

    def core(self, q, k, v) -> torch.Tensor:
        """q [s, b, np, hn], k, v [s, b, ng, hn] -> [s, b, np * hn]."""
        repeat = self.heads // self.groups
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=1.0 / math.sqrt(self.head_dim))
        s, b = q.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def forward(self, hidden: torch.Tensor, rotary) -> torch.Tensor:
        q, k, v, _ = self.split_qkv(hidden)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return _linear(self.core(q, k, v), self.linear_proj)


class AscenderCore(nn.Module):
    """Holds the per-head learned tensors under megatron's name ``core_attention.params``."""

    def __init__(self, config: AscenderDistConfig, hp: AscenderHParams):
        super().__init__()
        self.params = AscenderHeadParams(hp, config.num_attention_heads)
        self.trained_dtype = trained_buffer_dtype(config)
        self.buffers_ready = False

    def refresh_derived_buffers(self) -> None:
        """ALiBi slopes are a non-persistent buffer: ``from_pretrained`` (meta-device init) leaves
        it uninitialised, so it is recomputed before the first forward, rounded to the run's
        precision as training held them (bf16 rounding moves a slope by up to 2^-9 of it)."""
        slope = self.params.alibi_slope
        trained = alibi_slopes(self.params.num_heads).to(self.trained_dtype)
        self.params.alibi_slope = trained.to(slope.device, slope.dtype)
        self.buffers_ready = True


class AscenderAttention(SoftmaxAttention):
    """Layer kind ``S``: megatron's AscenderSelfAttention + AscenderCoreAttention at TP=1."""

    def __init__(self, config: AscenderDistConfig):
        self.hp = _hparams(AscenderHParams, config.ascender)
        self.hp.validate("ascender", config.head_dim)  # config.json is not checked by the YAML loader
        super().__init__(config, extra_per_head=self.hp.d_z + self.hp.d_a)
        self.core_attention = AscenderCore(config, self.hp)
        self.step = int(config.ascender_step)
        self.impl = config.ascender_impl

    def forward(self, hidden: torch.Tensor, rotary) -> torch.Tensor:
        if not self.core_attention.buffers_ready:
            self.core_attention.refresh_derived_buffers()
        q, k, v, (z, h) = self.split_qkv(hidden, (self.hp.d_z, self.hp.d_a))
        if rotary is not None:  # megatron rotates the first head_dim channels of [q | z | h]: q only
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        repeat = self.heads // self.groups
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731  [s, b, np, d] -> [b, np, s, d]
        out = ascender_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), to_bhsd(z), to_bhsd(h),
                                 self.core_attention.params, self.hp, step=self.step, impl=self.impl)
        b, np_, s, d = out.shape
        return _linear(out.permute(2, 0, 1, 3).reshape(s, b, np_ * d), self.linear_proj)


class ConnectionAttention(nn.Module):
    """Layer kind ``C``: the Connection layer in place of attention (``self_attention.layer.*``)."""

    def __init__(self, config: AscenderDistConfig):
        super().__init__()
        self.hp = _hparams(ConnectionHParams, config.connection)
        self.hp.validate("connection", config.hidden_size)  # config.json is not checked by the YAML loader
        self.layer = ConnectionLayer(self.hp, config.hidden_size)
        self.buffers_ready = False

    def refresh_derived_buffers(self) -> None:
        """The off-diagonal mask of the bilinear connection is a non-persistent buffer: recomputed
        before the first forward (``from_pretrained`` builds the model on the meta device)."""
        if hasattr(self.layer, "offdiag"):
            mask = self.layer.offdiag
            n = self.hp.num_slots
            self.layer.offdiag = 1.0 - torch.eye(n, dtype=mask.dtype, device=mask.device)
        self.buffers_ready = True

    def forward(self, hidden: torch.Tensor, rotary) -> torch.Tensor:
        if not self.buffers_ready:
            self.refresh_derived_buffers()
        return self.layer(hidden)


MIXERS = {"A": SoftmaxAttention, "S": AscenderAttention, "C": ConnectionAttention}


class MLP(nn.Module):
    def __init__(self, config: AscenderDistConfig):
        super().__init__()
        ffn = config.ffn_hidden_size
        self.swiglu = config.activation == "swiglu"
        if config.activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation must be gelu or swiglu (got {config.activation!r})")
        self.linear_fc1 = nn.Linear(config.hidden_size, 2 * ffn if self.swiglu else ffn, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(ffn, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _linear(x, self.linear_fc1)
        if self.swiglu:
            gate, up = torch.chunk(x, 2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        return _linear(x, self.linear_fc2)


class DecoderLayer(nn.Module):
    def __init__(self, config: AscenderDistConfig, letter: str):
        super().__init__()
        if letter not in MIXERS:
            raise ValueError(f"layer_pattern letters must be from {''.join(MIXERS)} (got {letter!r})")
        self.letter = letter
        self.input_layernorm = _norm(config)
        self.self_attention = MIXERS[letter](config)
        self.pre_mlp_layernorm = _norm(config)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor, rotary) -> torch.Tensor:
        hidden = hidden + self.self_attention(self.input_layernorm(hidden), rotary)
        return hidden + self.mlp(self.pre_mlp_layernorm(hidden))


class Embedding(nn.Module):
    def __init__(self, config: AscenderDistConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        elif config.position_embedding_type != "rope":
            raise ValueError(f"position_embedding_type must be rope or learned_absolute "
                             f"(got {config.position_embedding_type!r})")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(position_ids)
        return x.transpose(0, 1).contiguous()  # [s, b, h]


class Decoder(nn.Module):
    def __init__(self, config: AscenderDistConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, letter) for letter in config.layer_pattern)
        self.final_layernorm = _norm(config)


# ----------------------------------------------------------------------------- models
class AscenderDistPreTrainedModel(PreTrainedModel):
    config_class = AscenderDistConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        """Random init of what a checkpoint did not hold, and the tensors that follow from the config.

        ``from_pretrained`` builds the model on the meta device; persistent tensors an export holds
        are loaded (flagged ``_is_hf_initialized``, never touched here), missing ones are recomputed
        from the config (fixed slots, fixed per-head tensors) or drawn. Non-persistent buffers are
        recomputed by the layers before their first forward (``refresh_derived_buffers``), since
        transformers may skip this method for modules whose saved tensors all loaded.
        """
        std = self.config.initializer_range
        trained = trained_buffer_dtype(self.config)  # fixed tensors: rounded as the run held them

        def missing(t) -> bool:
            return t is not None and not getattr(t, "_is_hf_initialized", False)

        if isinstance(module, AscenderHeadParams):
            hp = _hparams(AscenderHParams, self.config.ascender)
            fresh = AscenderHeadParams(hp, module.num_heads, dtype=trained)  # a few floats per head, on CPU
            fresh_state = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
            for name, value in fresh_state.items():
                target = getattr(module, name)
                if missing(target) and name != "alibi_slope":  # the slopes: AscenderCore.refresh_derived_buffers
                    target.copy_(value.to(target.device, target.dtype))
        elif isinstance(module, ConnectionLayer):
            hp, d, n = module.hp, module.hidden_size, module.hp.num_slots
            if missing(module.slots):
                module.slots.copy_(make_fixed_slots(n, d, hp.slot_seed, trained).to(module.slots.device,
                                                                                     module.slots.dtype))
            stds = module.init_stds()  # the training layer's: the connection is scaled, not init_std
            for name, param in module.named_parameters(recurse=False):
                if missing(param):
                    param.normal_(0.0, stds.get(name, hp.init_std))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            if missing(module.weight):
                module.weight.normal_(0.0, std)
            if missing(getattr(module, "bias", None)):
                module.bias.zero_()
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if missing(module.weight):
                module.weight.fill_(1.0)
            if missing(getattr(module, "bias", None)):
                module.bias.zero_()


class AscenderDistModel(AscenderDistPreTrainedModel):
    """Embedding -> decoder layers -> final norm; returns hidden states [b, s, h]."""

    def __init__(self, config: AscenderDistConfig):
        super().__init__(config)
        self.embedding = Embedding(config)
        self.decoder = Decoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def rotary(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]):
        """RoPE's (cos, sin) for ``input_ids`` [b, s], None without rope: positions 0..s-1 by default
        ([s, 1, 1, d], megatron's), else those of ``position_ids`` ([b, s], [1, s] or [s]; per row)."""
        if self.config.position_embedding_type != "rope":
            return None
        dim, base = self.config.head_dim, float(self.config.rotary_base)
        if position_ids is None:
            return rotary_cos_sin(input_ids.shape[1], dim, base, input_ids.device)
        return rotary_for_positions(position_ids.to(input_ids.device).expand(input_ids.shape), dim, base)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = input_ids.shape
        rotary = self.rotary(input_ids, position_ids)
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        for layer in self.decoder.layers:
            hidden = layer(hidden, rotary)
        return self.decoder.final_layernorm(hidden).transpose(0, 1)  # [b, s, h]


class AscenderDistForCausalLM(AscenderDistPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embedding.word_embeddings.weight"}

    def __init__(self, config: AscenderDistConfig):
        super().__init__(config)
        self.model = AscenderDistModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.model.embedding.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        past_key_values=None,
        use_cache: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ):
        self._check_inputs(input_ids, attention_mask, position_ids, past_key_values, kwargs.get("inputs_embeds"))
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            logits = self._unpadded_logits(input_ids, attention_mask)
        else:  # no padding, or right padding: every layer is causal, real tokens never see the pads
            hidden = self.model(input_ids, position_ids)
            logits = _linear(hidden, self.lm_head)
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithPast(loss=loss, logits=logits)  # no cache (prepare_inputs_for_generation)

    def _check_inputs(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds) -> None:
        """One-line ValueErrors for what this model would otherwise ignore or compute outside its
        training: inputs_embeds and a KV cache (it has none: a cache passed with only the new tokens
        scored them as a whole sequence), an attention_mask not shaped like input_ids, an empty
        sequence, positions past the trained context (max_position_embeddings: RoPE models returned
        logits never trained for, learned positions an IndexError)."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("input_ids is required and inputs_embeds is not supported")
        if past_key_values is not None and _cached_length(past_key_values) > 0:
            raise ValueError("past_key_values: this model keeps no KV cache; pass the whole sequence every step "
                             "(generate() does)")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}: they must be equal")
        if input_ids.shape[-1] == 0:
            raise ValueError("input_ids holds no token")
        limit = self.config.max_position_embeddings
        last = input_ids.shape[-1] if position_ids is None else int(position_ids.max()) + 1
        if last > limit:
            raise ValueError(f"positions up to {last} but the model was trained on {limit} "
                             f"(max_position_embeddings): truncate the input (tokenizer truncation=True)")

    def _unpadded_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Left-padded rows (batched generation): each row's real tokens on their own, positions from
        0, logits scattered back (zeros at the pads). ASCender and Connection layers have no padding
        mask, so this is what keeps a batched result equal to the unbatched one."""
        mask = attention_mask.bool()
        logits = None
        for row in range(input_ids.shape[0]):
            real = mask[row].nonzero().flatten()
            if real.numel() == 0:
                continue
            if int(real[-1] - real[0]) + 1 != real.numel():
                raise ValueError("attention_mask must be one contiguous run of ones per row: left padding, or "
                                 "right padding for scoring only (generate() needs padding_side='left')")
            row_logits = _linear(self.model(input_ids[row:row + 1, real]), self.lm_head)[0]
            if logits is None:
                logits = row_logits.new_zeros(*input_ids.shape, row_logits.shape[-1])
            logits[row, real] = row_logits
        if logits is None:
            raise ValueError("attention_mask has no real token")
        return logits

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No cache: the whole prefix every step. A row ending in padding is refused from the first
        step: its next token would be predicted at a pad (forward alone cannot tell right padding
        from none until a generated token follows the pads)."""
        if attention_mask is not None and bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("attention_mask must be one contiguous run of ones per row: left padding, or "
                             "right padding for scoring only (generate() needs padding_side='left')")
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def _cached_length(past) -> int:
    """Tokens a KV cache holds: a transformers Cache's sequence length, or a legacy tuple's layers."""
    return int(past.get_seq_length()) if hasattr(past, "get_seq_length") else len(past)


__all__ = ["AscenderDistConfig", "AscenderDistForCausalLM", "AscenderDistModel", "AscenderDistPreTrainedModel",
           "rotary_cos_sin", "rotary_for_positions", "apply_rotary"]
