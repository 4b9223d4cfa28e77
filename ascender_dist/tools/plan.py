"""``plan``: memory per GPU and training time of a run config on a cluster, before launching it.

Pure arithmetic on the config (no model build, no megatron or DeepSpeed import). The formulas and
their sources are in ``docs/plan.md``; in short:

* model states: what this project's optimizers allocate (docs/plan.md): the ZeRO paper's
  2 + 2 + 12 bytes per parameter for bf16 (Rajbhandari et al. 2020), with DeepSpeed's details: bf16
  ZeRO-1 (BF16_Optimizer) keeps an unsharded fp32 gradient buffer beside the bf16 gradients, ZeRO-2/3
  keep fp32 gradient partitions, and fp32 under ZeRO >= 1 still has an fp32 master copy (ZeRO-0, fp32
  only, runs the project's own AdamW: 4 + 4 + 8). Before that, a pipeline stage holds its own layers
  (embedding on the first stage, LM head on the last) and tensor parallelism divides them by TP.
* activations: what autograd keeps for megatron-core's local (unfused) layer as this project
  configures it, term by term as in Korthikanti et al. 2022 but counted from the tensors the layer
  really saves (tests/unit/test_plan_activations.py measures them): the fp32 softmax output and its
  cast for the value product, the QKV buffer and RoPE's rotated copies, SwiGLU's five ffn-wide
  tensors, dropout masks only when dropout is on; with full recomputation only each layer's input,
  plus one layer's activations while it is recomputed. ASCender (S) and Connection (C) layers are
  approximations (see ``docs/plan.md``).
* time: ``flops_per_token * tokens / (world * peak * mfu)`` with
  :func:`ascender_dist.models.counting.count_model`'s 6N-style training FLOPs per token.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from ascender_dist.config.architectures import expand_layer_pattern
from ascender_dist.config.errors import ConfigError, UserError
from ascender_dist.config.resolve import pad_vocab_size, validate
from ascender_dist.config.schema import RunConfig
from ascender_dist.models.counting import count_model, layer_params as layer_params_of
# DEFAULT_VOCAB_SIZE: the shared assumption (research reads it here)
from ascender_dist.tools.run_vocab import DEFAULT_VOCAB_SIZE, check_vocab_flag

GIB = 2**30
DEFAULT_HEADROOM = 0.9
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}  # bytes per stored activation value
MASK_BYTES = 1  # a dropout mask on a GPU (torch's fused dropout keeps bool; its CPU path keeps the dtype)
LOGIT_BYTES = 4  # the cross entropy keeps fp32 logits (Korthikanti et al.: 4 s b v / t)
SOFTMAX_BYTES = 4  # megatron-core's attention_softmax_in_fp32 (its default): the softmax output is fp32


@dataclass(frozen=True)
class ClusterShape:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0  # H100 SXM
    peak_tflops: float = 989.0  # dense bf16 TFLOP/s per GPU, H100 SXM

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU of one pipeline stage (every TP/DP rank of a stage holds the same)."""

    stage: int
    layers: str  # this stage's slice of the layer pattern
    params: int  # parameters on one GPU after tensor parallelism, before ZeRO
    micro_batches_in_flight: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations_no_checkpointing: int
    activations_checkpointing: int
    activations: int  # the one the config uses
    total: int


@dataclass(frozen=True)
class Plan:
    nodes: int
    gpus_per_node: int
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    zero_stage: int
    precision: str
    sequence_parallel: bool
    activation_checkpointing: bool
    micro_batch_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    seq_length: int
    vocab_size: int
    padded_vocab_size: int
    total_params: int
    memory: StageMemory  # the stage that needs the most
    stages: tuple[StageMemory, ...]
    gpu_memory_gib: float
    headroom: float
    available_bytes: int
    fits: bool
    flops_per_token: float
    tokens: int
    mfu: float
    peak_tflops: float
    train_seconds: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- model states
def model_state_bytes(precision: str, zero_stage: int, dp: int) -> tuple[float, float, float]:
    """Bytes per parameter on one GPU (weights, gradients, optimizer states) as this project's
    optimizers allocate them (docs/plan.md, "Model states")."""
    weights = 2.0 if precision == "bf16" else 4.0
    if zero_stage == 0:  # fp32 only (a config check): the project's ClippedAdamW, m and v, no master copy
        return weights, 4.0, 8.0
    optimizer = 12.0 / dp  # DeepSpeed's ZeRO optimizers keep an fp32 master copy, fp32 weights too, + m, v
    if zero_stage == 1:
        # bf16: BF16_Optimizer keeps the bf16 .grad and an unsharded fp32 accumulation buffer
        gradients = 6.0 if precision == "bf16" else 4.0
    else:
        gradients = 4.0 / dp  # the fp32 gradient partition (grad_accum_dtype fp32 under bf16)
    if zero_stage >= 3:
        weights /= dp
    return weights, gradients, optimizer


# --------------------------------------------------------------------------- activations
def norm_bytes(normalization: str, hidden: int, act_bytes: int) -> int:
    """Bytes one norm keeps per token: LayerNorm its input and two statistics; megatron's RMSNorm
    computes in fp32 and keeps the fp32 input, the normalised fp32 tensor and one statistic."""
    if normalization == "RMSNorm":
        return 8 * hidden + 4
    return act_bytes * (hidden + 2)


def _mlp_values(m) -> int:
    """Values per token the MLP keeps besides its input: GELU its input and output (2 f); SwiGLU the
    fc1 output (2 f) and three ffn-wide tensors (the SiLU output, fc2's input and one more; measured)."""
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    return 5 * ffn if m.activation == "swiglu" else 2 * ffn


def _qkv_values(m, head_dim: int) -> int:
    """Values per token the core attention keeps of q, k, v: with grouped-query attention q and the
    head-repeated k, v (3 h); with multi-head attention the fused QKV buffer (v is a view of it) and
    RoPE's rotated copies of q and k."""
    h, a = m.hidden_size, m.num_attention_heads
    kv = (m.num_query_groups or a) * head_dim
    if kv < h:
        return 3 * h
    return 3 * h + (2 * h if m.position_embedding_type == "rope" else 0)


def _softmax_bytes(m, act_bytes: int) -> int:
    """Bytes per (head, query, key) of the s x s part: the fp32 softmax output, then what the value
    product keeps: the dropout mask and output, or without dropout the cast to the activation dtype
    (nothing more in fp32: the same tensor)."""
    if m.attention_dropout > 0:
        return SOFTMAX_BYTES + MASK_BYTES + act_bytes
    return SOFTMAX_BYTES + (act_bytes if act_bytes != SOFTMAX_BYTES else 0)


def ascender_core_bytes(hp, head_dim: int, act_bytes: int) -> int:
    """Bytes ASCender's core attention keeps for backward per token and head (AscenderHParams hp),
    on the path training takes on a GPU (impl auto): the Triton kernels for their head dims, else
    the fused torch path. Both compute in fp32 (bf16 / fp16 inputs upcast) and keep: the inputs
    q, k, v, z, h (k, v per query head: grouped-query attention expands them before the core; the
    Triton path keeps them as given, the torch path its fp32 copies), the output (with the L_coh
    value columns when that loss is on), Separation's row statistics (rho, mu, var) and the top-k
    indices (int32) and valid flags; the Triton path also the softmax's log-sum-exp, the Cohesion
    moments (d_z + 2) and the L_sep row. With the alignment loss on, both paths also keep the
    heading u and the neighbours' mean heading (fp32), one int64 index vector per neighbour slot,
    the neighbour count (fp32) and a bool mask. The Triton path is assumed where the kernels cover
    the head dim and the operand widths (d_z, d_a <= 62); on GPUs with ~99 KiB of shared memory per
    block (A10, L4, L40S) they do not, and the torch path keeps more. Checked against autograd's
    saved tensors per path (tests/unit/test_plan_activations.py)."""
    from ascender_dist.models.ascender.kernels.support import SUPPORTED_HEAD_DIMS, shared_memory_shortfall

    fp32 = max(act_bytes, 4)
    triton = head_dim in SUPPORTED_HEAD_DIMS and not shared_memory_shortfall("", None, head_dim, hp)
    inputs = (3 * head_dim + hp.d_z + hp.d_a) * (act_bytes if triton else fp32)
    out = head_dim + (hp.d_z + 1 if hp.use_coh and hp.aux_compactness_weight > 0 else 0)
    rows = out + (3 if hp.use_sep else 0)
    if triton:
        rows += 1 + (hp.d_z + 2 if hp.use_coh else 0) + (1 if hp.use_sep and hp.aux_crowding_weight > 0 else 0)
    alignment_loss = (2 * head_dim + 1) * fp32 + 8 * hp.k + 1 if hp.use_align and hp.aux_alignment_weight > 0 else 0
    return inputs + fp32 * rows + hp.k * (4 + 1) + alignment_loss


def _layer_activation_bytes(cfg: RunConfig, letter: str, micro_batch: int, act_bytes: int) -> float:
    """Stored activations of one layer for one micro-batch on one GPU.

    Per token, replicated values (divided by t only with sequence parallelism: the norms, the QKV
    and fc1 inputs, the hidden dropout masks) and tensor-parallel ones (always divided by t: q, k, v,
    the s x s part, the output projection's input, the MLP); per layer and micro-batch, GPT layers
    also keep the s x s bool causal mask and RoPE's cos / sin ([s, head_dim], four of them)."""
    m, p = cfg.model, cfg.parallel
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    t = p.tensor_model_parallel_size
    tau = t if p.sequence_parallel else 1
    head_dim = h // a
    masks = 2 * h * MASK_BYTES if m.hidden_dropout > 0 else 0  # after attention and after the MLP
    rep = 2 * norm_bytes(m.normalization, h, act_bytes) + act_bytes * h + masks  # norms, fc1 input
    par = act_bytes * _mlp_values(m)
    per_layer = 0.0
    if letter == "C":
        # The Connection layer replaces the attention block (its input, Q, K, V, the scores, the
        # output projection's input). Its own stored values were measured at ~10.6 h per token
        # (benchmarks/results/connection.md, "saved" column, N=32, c=128, 4 steps: linear in s, no
        # s x s term); the reasoning states add max_steps * N / c of those h (1 at that shape), kept
        # in fp32 also in bf16 / fp16 (the added part of the split state, docs/connection.md):
        # 10 h values plus max_steps * N / c h fp32 ones. Counted unsharded (conservative).
        hp = m.connection
        chunk = min(hp.causal_chunk_size, s)
        rep += (act_bytes * 10 + max(act_bytes, 4) * hp.max_steps * hp.num_slots / chunk) * h
    else:
        rep += act_bytes * h  # the QKV projection's input
        par += act_bytes * h  # the output projection's input
        rope = 4 * s * head_dim * act_bytes if m.position_embedding_type == "rope" else 0  # cos / sin
        if letter == "S":  # no s x s tensor, no mask: what the core keeps per token and head
            par += a * ascender_core_bytes(m.ascender, head_dim, act_bytes)
            per_layer = rope  # (and per-head parameter copies: tens of bytes per head, not counted)
        else:
            par += act_bytes * _qkv_values(m, head_dim) + _softmax_bytes(m, act_bytes) * a * s
            per_layer = s * s + rope  # the causal mask (bool), whatever the batch
    return s * micro_batch * (rep / tau + par / t) + per_layer


# --------------------------------------------------------------------------- the plan
# upper bounds of the plan's inputs, far beyond any cluster: past them the arithmetic overflows (a
# 1e300 GiB GPU is an OverflowError, a 300-digit token count does not convert to float)
MAX_COUNT = 2**31  # nodes, GPUs per node
MAX_AMOUNT = 1e12  # GiB per GPU, peak TFLOP/s
MAX_TOKENS = 2**63
# plan()'s input fields -> the `ascender-dist plan` flags that set them (the CLI's errors name the flag)
FIELD_FLAGS = {"cluster.nodes": "--nodes", "cluster.gpus_per_node": "--gpus-per-node",
               "cluster.gpu_memory_gib": "--gpu-memory-gib", "cluster.peak_tflops": "--peak-tflops", "mfu": "--mfu",
               "tokens": "--tokens", "headroom": "--headroom"}


def _check_inputs(cluster: ClusterShape, mfu: float, tokens: Optional[int], headroom: float) -> None:
    for name in ("nodes", "gpus_per_node"):
        if not 1 <= getattr(cluster, name) <= MAX_COUNT:
            raise ConfigError(f"cluster.{name}", f"must be in [1, {MAX_COUNT}] (got {getattr(cluster, name)})")
    for name in ("gpu_memory_gib", "peak_tflops"):
        if not (math.isfinite(getattr(cluster, name)) and 0 < getattr(cluster, name) <= MAX_AMOUNT):
            raise ConfigError(f"cluster.{name}", f"must be a number in (0, {MAX_AMOUNT:g}] (got {getattr(cluster, name)})")
    if not 0 < mfu <= 1:
        raise ConfigError("mfu", f"must be in (0, 1] (got {mfu})")
    if tokens is not None and not 1 <= tokens <= MAX_TOKENS:
        raise ConfigError("tokens", f"must be in [1, 2^63] (got {tokens})")
    if not 0 < headroom <= 1:
        raise ConfigError("headroom", f"must be in (0, 1] (got {headroom})")


def plan(cfg: RunConfig, cluster: ClusterShape, *, vocab_size: int, mfu: float = 0.4,
         tokens: Optional[int] = None, headroom: float = DEFAULT_HEADROOM) -> Plan:
    """Memory per GPU and training time of ``cfg`` on ``cluster``. ConfigError when the layout is
    impossible (world size not a multiple of TP x PP, batch not divisible, ...); fitting in memory
    is reported in ``Plan.fits`` (see :func:`check_fits`)."""
    _check_inputs(cluster, mfu, tokens, headroom)
    world = cluster.world_size
    validate(cfg, world)  # TP x PP divides the world, batch divides into micro-batches x DP, ...
    m, p, t_cfg = cfg.model, cfg.parallel, cfg.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = world // (tp * pp)
    grad_accum = t_cfg.global_batch_size // (t_cfg.micro_batch_size * dp)
    s, h, b = m.seq_length, m.hidden_size, t_cfg.micro_batch_size
    padded_vocab = pad_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    counts = count_model(cfg.model, vocab_size, cfg.parallel.tensor_model_parallel_size)
    weight_b, grad_b, optim_b = model_state_bytes(t_cfg.precision, p.zero_stage, dp)
    act_bytes = ACTIVATION_BYTES[t_cfg.precision]
    tau = tp if p.sequence_parallel else 1

    pattern = expand_layer_pattern(cfg.model)
    per_stage = m.num_layers // pp
    layer_params = {c: layer_params_of(m, c) for c in set(pattern)}
    layer_act = {c: _layer_activation_bytes(cfg, c, b, act_bytes) for c in set(pattern)}
    layer_input = act_bytes * s * b * h / tau  # what full recomputation keeps per layer

    stages = []
    for i in range(pp):
        letters = pattern[i * per_stage:(i + 1) * per_stage]
        params = sum(layer_params[c] for c in letters)
        extra_act = 0.0
        in_flight = min(pp - i, grad_accum)  # 1F1B: stage i holds pp - i micro-batches
        if i == 0:
            params += padded_vocab * h + (s * h if m.position_embedding_type == "learned_absolute" else 0)
            if m.hidden_dropout > 0:
                extra_act += in_flight * s * b * h * MASK_BYTES / tau  # embedding dropout mask
        if i == pp - 1:
            params += 2 * h if m.normalization == "LayerNorm" else h  # final norm
            if m.untie_embeddings_and_output_weights or pp > 1:  # tied + pp > 1: megatron's copy
                params += padded_vocab * h
            # final norm, LM-head input, fp32 logits of the vocab-parallel cross entropy
            extra_act += (s * b * (norm_bytes(m.normalization, h, act_bytes) + act_bytes * h) / tau
                          + LOGIT_BYTES * s * b * padded_vocab / tp)
        shard = params / tp
        weights, grads, optim = weight_b * shard, grad_b * shard, optim_b * shard
        full = sum(layer_act[c] for c in letters)
        no_ckpt = in_flight * full + extra_act
        ckpt = in_flight * len(letters) * layer_input + max(layer_act[c] for c in letters) + extra_act
        act = ckpt if p.activation_checkpointing else no_ckpt
        parts = [math.ceil(x) for x in (weights, grads, optim, no_ckpt, ckpt, act)]
        stages.append(StageMemory(i, letters, math.ceil(shard), in_flight, *parts,
                                  total=parts[0] + parts[1] + parts[2] + parts[5]))
    worst = max(stages, key=lambda st: st.total)
    available = int(headroom * cluster.gpu_memory_gib * GIB)
    tokens = tokens if tokens is not None else t_cfg.train_steps * t_cfg.global_batch_size * s
    seconds = counts.flops_per_token * tokens / (world * cluster.peak_tflops * 1e12 * mfu)
    return Plan(
        nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, world_size=world,
        tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, zero_stage=p.zero_stage,
        precision=t_cfg.precision, sequence_parallel=p.sequence_parallel,
        activation_checkpointing=p.activation_checkpointing, micro_batch_size=b,
        global_batch_size=t_cfg.global_batch_size, gradient_accumulation_steps=grad_accum, seq_length=s,
        vocab_size=vocab_size, padded_vocab_size=padded_vocab, total_params=counts.total_params,
        memory=worst, stages=tuple(stages), gpu_memory_gib=cluster.gpu_memory_gib, headroom=headroom,
        available_bytes=available, fits=worst.total <= available, flops_per_token=counts.flops_per_token,
        tokens=tokens, mfu=mfu, peak_tflops=cluster.peak_tflops, train_seconds=seconds,
        notes=tuple(_notes(cfg, pattern, pp, worst)),
    )


def _notes(cfg: RunConfig, pattern: str, pp: int, worst: StageMemory) -> list[str]:
    notes = []
    if "S" in pattern:
        notes.append("ASCender (S) layers are approximated: no s x s term (no ASCender path keeps one), "
                     "plus z, h and the wider folded q/k; per-chunk working tiles are not counted")
    if "C" in pattern:
        notes.append("Connection (C) layers are approximated: (10 + max_steps*N/c) * h values per token for "
                     "the layer, from benchmarks/results/connection.md, not divided by TP")
    if pp > 1:
        notes.append(f"pipeline: 1F1B schedule, stage i keeps min(pp - i, grad accum) micro-batches in flight; "
                     f"stage {worst.stage} needs the most and is shown")
    if cfg.parallel.activation_checkpointing:
        notes.append("full recomputation runs each forward twice: the MFU given counts model FLOPs only, "
                     "so expect it lower than without checkpointing")
    if cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 1:
        notes.append("bf16 ZeRO-1: DeepSpeed's BF16_Optimizer keeps the bf16 gradients and an unsharded fp32 "
                     "accumulation buffer (6 bytes/param, counted)")
    elif cfg.train.precision == "fp32" and cfg.parallel.zero_stage >= 1:
        notes.append("fp32 under ZeRO >= 1: DeepSpeed's optimizer keeps an fp32 master copy too "
                     "(12 bytes/param of optimizer states, sharded; counted)")
    if cfg.parallel.zero_stage >= 2 or (cfg.train.precision == "fp32" and cfg.parallel.zero_stage == 1):
        # measured on 2 CPU ranks: ~2.0e9 bytes beyond the model states after a ZeRO-3 backward, and on the
        # accumulation micro-steps of fp32 ZeRO-1 (docs/plan.md, "Not counted")
        notes.append("not counted: DeepSpeed's gradient reduction bucket of reduce_bucket_size elements "
                     "(default 5e8: ~2 GB in fp32, twice with overlap_comm) whatever the model's size; "
                     "the headroom must hold it (on a small GPU, lower --headroom, the fraction the plan may use)")
    notes.append("not counted: communication buckets, CUDA context, allocator fragmentation "
                 "(the headroom is for these)")
    return notes


# --------------------------------------------------------------------------- output
def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days ({seconds / 3600:.0f} h)"


def _layout(plan_: Plan) -> str:
    return (f"tp {plan_.tensor_parallel} x pp {plan_.pipeline_parallel} x dp {plan_.data_parallel}, "
            f"ZeRO-{plan_.zero_stage}")


def format_plan(plan_: Plan) -> str:
    mem = plan_.memory
    ckpt = "on" if plan_.activation_checkpointing else "off"
    rows = [
        ("world", f"{plan_.world_size} GPUs = {plan_.nodes} node(s) x {plan_.gpus_per_node}"),
        ("layout", f"{_layout(plan_)}, {plan_.precision}"
                   + (", sequence parallel" if plan_.sequence_parallel else "")),
        ("batch", f"micro {plan_.micro_batch_size} x grad accum {plan_.gradient_accumulation_steps} x dp "
                  f"{plan_.data_parallel} = {plan_.global_batch_size} sequences of {plan_.seq_length} tokens"),
        ("parameters", f"{plan_.total_params:,} (vocab {plan_.vocab_size} padded to {plan_.padded_vocab_size}); "
                       f"{mem.params:,} per GPU on stage {mem.stage}"),
        ("parameters GiB/GPU", _gib(mem.parameters)),
        ("gradients GiB/GPU", _gib(mem.gradients)),
        ("optimizer states GiB/GPU", _gib(mem.optimizer_states)),
        ("activations GiB/GPU, no checkpointing", _gib(mem.activations_no_checkpointing)
         + (" (used)" if not plan_.activation_checkpointing else "")),
        ("activations GiB/GPU, full checkpointing", _gib(mem.activations_checkpointing)
         + (" (used)" if plan_.activation_checkpointing else "")),
        ("total GiB/GPU", f"{_gib(mem.total)} (activation checkpointing {ckpt})"),
        ("available GiB/GPU", f"{_gib(plan_.available_bytes)} ({plan_.headroom:g} x {plan_.gpu_memory_gib:g})"),
        ("fits", "yes" if plan_.fits else "NO"),
        ("tokens", f"{plan_.tokens:,}"),
        ("training FLOPs/token", f"{plan_.flops_per_token:.4g}"),
        ("time", f"{_duration(plan_.train_seconds)} at MFU {plan_.mfu:g} of {plan_.peak_tflops:g} TFLOP/s/GPU"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'item':<{width}} | value |", f"| {'-' * width} | --- |"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    lines += [f"- {note}" for note in plan_.notes]
    return "\n".join(lines)


def _breakdown(stage: StageMemory) -> str:
    return (f"parameters {_gib(stage.parameters)} + gradients {_gib(stage.gradients)} + optimizer states "
            f"{_gib(stage.optimizer_states)} + activations {_gib(stage.activations)} GiB")


def check_fits(plan_: Plan) -> None:
    """ConfigError (one line) naming the sizes when the plan does not fit in GPU memory."""
    if plan_.fits:
        return
    mem = plan_.memory
    stage = f" on pipeline stage {mem.stage}" if plan_.pipeline_parallel > 1 else ""
    hint = ""
    if not plan_.activation_checkpointing and mem.total - mem.activations + mem.activations_checkpointing \
            <= plan_.available_bytes:
        hint = "; it fits with parallel.activation_checkpointing=true"
    raise ConfigError("parallel", f"{_layout(plan_)} does not fit: {_gib(mem.total)} GiB needed per GPU{stage}, "
                                  f"{_gib(plan_.available_bytes)} GiB available ({plan_.headroom:g} x "
                                  f"{plan_.gpu_memory_gib:g} GiB): {_breakdown(mem)}{hint}")


# --------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascender-dist plan",
        description="Memory per GPU and training time of a run config on a cluster (see docs/plan.md).")
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set parallel.zero_stage=2 (repeatable)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="default 80 (H100 SXM)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 TFLOP/s per GPU (default 989, H100 SXM)")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens to train (default train_steps x global_batch_size x seq_length)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"when the config has no model.vocab_size and no readable tokenizer "
                             f"(default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help="fraction of GPU memory the plan may use (default 0.9)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    return parser


def _vocab(cfg: RunConfig, explicit: Optional[int]) -> tuple[int, list[str]]:
    """vocab size and the notes saying where it came from (and which command makes a missing tokenizer)."""
    from ascender_dist.tools.run_vocab import run_vocab

    run = run_vocab(cfg, explicit, DEFAULT_VOCAB_SIZE)
    return run.size, [f"vocab size {run.size} ({run.source})"] + ([run.hint] if run.hint else [])


def plan_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist plan ...``: print the plan; exit 2 with one line on stderr when it is
    impossible or does not fit (the table is printed first)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        from ascender_dist.config import load_config
        from ascender_dist.config.resolve import named_source

        check_vocab_flag(args.vocab_size)  # before the config is read: the flag's own line
        cfg = load_config(args.config, args.overrides)
        vocab, vocab_notes = _vocab(cfg, args.vocab_size)
        cluster = ClusterShape(args.nodes, args.gpus_per_node, args.gpu_memory_gib, args.peak_tflops)
        try:
            result = plan(cfg, cluster, vocab_size=vocab, mfu=args.mfu, tokens=args.tokens, headroom=args.headroom)
        except ConfigError as exc:
            if exc.path in FIELD_FLAGS:  # one of this command's flags
                raise ConfigError(FIELD_FLAGS[exc.path], exc.message) from None
            raise named_source(exc, args.config, args.overrides) from None  # a field of the file or a --set
        result = replace(result, notes=(*vocab_notes, *result.notes))
        print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
        sys.stdout.flush()
        check_fits(result)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(plan_main())
