"""Checks run on 2 ranks: tensor-parallel layouts vs TP=1 with the same weights."""

import contextlib
from pathlib import Path
from unittest import mock

import torch

from tests.helpers.multiproc import run_checks
from tests.helpers.numeric import nan_max
from tests.helpers.parity import tp_causality, tp_init_parity, tp_parity

ASC = {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2, "chunk_size": 16, "omega_init": 0.5}
CONN = {"num_slots": 6, "rank": 4, "max_steps": 3, "causal_chunk_size": 8, "threshold": 0.0}
DEBUG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 32}
CAUSAL_MODELS = {"gpt": {}, "ascender": {"architecture": "ascender", "ascender": ASC},
                 "connection": {"architecture": "connection", "connection": CONN},
                 "mixed_sc": {"architecture": "connection", "layer_pattern": "SC", "ascender": ASC,
                              "connection": CONN},
                 # the adaptive stop firing: at this seed and threshold 6 of the 8 (sample, chunk) reasoning
                 # states stop after 1 step, 2 run all 3 (measured at TP=1; CONN's threshold 0 never stops)
                 "connection_adaptive": {"architecture": "connection", "connection": {**CONN, "threshold": 0.8}},
                 # the fast path's causal moment states (every MOMENT_STRIDE keys, 256 by default: more than
                 # the 32 tokens here) at a stride of 8, so chunks read states of earlier keys
                 "ascender_moment_states": {"architecture": "ascender", "ascender": ASC}}
CAUSAL_MOMENT_STRIDE = {"ascender_moment_states": 8}
CAUSAL_LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2},
                  "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}
CAUSAL_UNSUPPORTED = {("connection", "tp2_sp"), ("mixed_sc", "tp2_sp"),  # refused: Connection layers and SP
                      ("connection_adaptive", "tp2_sp")}
CAUSAL_POSITIONS = (5, 7, 15, 20)


def _causality(name: str, raw_cfg: dict) -> dict:
    """tp_causality of CAUSAL_MODELS' ``name``, at its CAUSAL_MOMENT_STRIDE if it has one."""
    stride = CAUSAL_MOMENT_STRIDE.get(name)
    with (mock.patch("ascender_dist.models.ascender.fast_moments.MOMENT_STRIDE", stride) if stride
          else contextlib.nullcontext()):
        return tp_causality(raw_cfg, CAUSAL_POSITIONS)


def main(args):
    return run_checks({
        "gpt_tp2": lambda: tp_parity({"model": {**DEBUG}}),
        # 250 ids padded to 256: the second rank's slice [128, 256) ends in 6 padding ids the loss masks
        "gpt_padded_vocab_tp2": lambda: tp_parity({"model": {**DEBUG}}, vocab=250),
        "gpt_swiglu_rmsnorm_gqa_tp2": lambda: tp_parity({"model": {
            **DEBUG, "activation": "swiglu", "normalization": "RMSNorm", "num_query_groups": 2,
            "add_bias_linear": False}}),
        "gpt_learned_pos_untied_tp2": lambda: tp_parity({"model": {
            **DEBUG, "position_embedding_type": "learned_absolute", "untie_embeddings_and_output_weights": True}}),
        "ascender_tp2": lambda: tp_parity({"model": {**DEBUG, "architecture": "ascender", "ascender": ASC}}),
        # the three auxiliary losses on: each TP rank's is a mean over its own heads (gradient scale 1/tp)
        "ascender_aux_losses_tp2": lambda: tp_parity({"model": {**DEBUG, "architecture": "ascender", "ascender": {
            **ASC, "aux_compactness_weight": 0.5, "aux_crowding_weight": 0.5, "aux_alignment_weight": 0.5}}}),
        "ascender_gqa_swiglu_tp2": lambda: tp_parity({"model": {
            **DEBUG, "architecture": "ascender", "ascender": {**ASC, "other_bias": "alibi"},
            "num_query_groups": 2, "activation": "swiglu"}}),
        "connection_bilinear_tp2": lambda: tp_parity({"model": {**DEBUG, "architecture": "connection",
                                                                "connection": CONN}}),
        "connection_linear_tp2": lambda: tp_parity({"model": {**DEBUG, "architecture": "connection",
                                                              "connection": {**CONN, "connection": "linear"}}}),
        # omega shared across heads: replicated over TP, its per-rank gradient all-reduced over TP
        "ascender_shared_omega_tp2": lambda: tp_parity({"model": {
            **DEBUG, "architecture": "ascender", "ascender": {**ASC, "share_omega_across_heads": True}}},
            report=("omega_shared",)),
        # post_norm: the gates (the density gate eta = min(1, rho / kappa) too) and the lambdas, trained
        # here, scale the normalised bias, so kappa's gradient is real (max |g| ~2e-4 with kappa_init 1).
        # Under the default pre_norm the row normalisation cancels them up to eps (kappa's |g| ~1e-9).
        "ascender_post_norm_kappa_tp2": lambda: tp_parity({"model": {**DEBUG, "architecture": "ascender", "ascender": {
            **ASC, "gate_placement": "post_norm", "trainable_lambdas": True, "kappa_init": 1.0}}}),
        "mixed_ascender_connection_tp2": lambda: tp_parity({"model": {
            **DEBUG, "architecture": "connection", "layer_pattern": "SC", "ascender": ASC, "connection": CONN}}),
        "connection_stop_under_tp": connection_stop_under_tp,
        # bf16 weights and activations (the GPU precision; megatron's bf16 path and the custom layers'
        # own casts) under TP2 vs TP1, compared within bf16 rounding (test_model_parity.BF16_*)
        **{f"{name}_bf16_tp2": (lambda model=model: tp_parity({"model": {**DEBUG, **model},
                                                                "train": {"precision": "bf16"}}))
           for name, model in CAUSAL_MODELS.items()},
        # no future leak under TP (heads split, vocabulary-parallel logits) and sequence parallel (the
        # sequence itself split between the ranks around every layer): positions inside, at the end
        # of and after a chunk / neighbourhood window
        **{f"causal_{name}_{layout}": (lambda name=name, model=model, parallel=parallel: _causality(
            name, {"model": {**DEBUG, **model}, "parallel": parallel}))
           for name, model in CAUSAL_MODELS.items() for layout, parallel in CAUSAL_LAYOUTS.items()
           if (name, layout) not in CAUSAL_UNSUPPORTED},
        # the same seed gives the same initial weights at TP=1 and TP=2 (a layer after a Connection layer too)
        "init_tp_invariant_connection_first": lambda: tp_init_parity({"model": {
            **DEBUG, "num_layers": 3, "architecture": "connection", "layer_pattern": "CSA", "ascender": ASC,
            "connection": CONN, "untie_embeddings_and_output_weights": True}}),
        # ... also when the padded vocabulary grows with TP (300 ids: 384 rows at TP=1, 512 at TP=2)
        "init_tp_invariant_padded_vocab": lambda: tp_init_parity({"model": {
            **DEBUG, "architecture": "ascender", "ascender": ASC, "untie_embeddings_and_output_weights": True}},
            vocab=300),
        # megatron's attention dropout (drawn from its TP tracker) under the pipeline's recompute
        "pipeline_recompute_dropout": lambda: pipeline_recompute_matches_plain(
            {"model": {**DEBUG, "attention_dropout": 0.3, "hidden_dropout": 0.2},
             "parallel": {"tensor_model_parallel_size": 2, "activation_checkpointing": True}}),
        "pipeline_dropout_rng_sp": lambda: pipeline_dropout_matches_block(
            {"model": {**DEBUG, "architecture": "ascender", "ascender": ASC, "hidden_dropout": 0.2},
             "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}),
        "dist_ckpt_ascender": lambda: dist_checkpoint_reshard(
            {"model": {**DEBUG, "architecture": "ascender", "ascender": ASC}}, args["root"]),
        "dist_ckpt_ascender_shared_omega": lambda: dist_checkpoint_reshard(
            {"model": {**DEBUG, "architecture": "ascender",
                       "ascender": {**ASC, "share_omega_across_heads": True}}}, args["root"]),
        "dist_ckpt_connection": lambda: dist_checkpoint_reshard(
            {"model": {**DEBUG, "architecture": "connection", "layer_pattern": "SC", "ascender": ASC,
                       "connection": CONN}}, args["root"]),
    })


def connection_stop_under_tp() -> dict:
    """Inputs whose chunks converge at different steps: TP ranks must take identical step counts
    (or their collectives would hang) and equal the unsharded layer's."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from ascender_dist.models.connection import ConnectionHParams, ConnectionLayer, shard_state_dict
    from ascender_dist.parallel.mappings import copy_to_tp, reduce_from_tp
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel, init_process_group

    init_process_group()
    destroy_model_parallel()
    init_model_parallel(2, 1, seed=0)
    hp = ConnectionHParams(num_slots=6, rank=4, max_steps=8, threshold=0.6, causal=True, causal_chunk_size=4,
                           connection_init_scale=0.1, normalize_compression=False)
    torch.manual_seed(0)
    full = ConnectionLayer(hp, 32)
    x = torch.randn(16, 4, 32) * torch.tensor([0.1, 1.0, 3.0, 10.0])[None, :, None]
    expected = full(x)
    tp_rank = mps.get_tensor_model_parallel_rank()
    sharded = ConnectionLayer(hp, 32, tp_size=2, tp_rank=tp_rank, reduce_fn=reduce_from_tp, copy_fn=copy_to_tp,
                              gather_fn=gather_from_tensor_model_parallel_region)
    sharded.load_state_dict(shard_state_dict(full.state_dict(), 2, tp_rank))
    out = sharded(x)
    steps = sharded.last_stats.steps.contiguous()
    peers = [torch.empty_like(steps) for _ in range(2)]
    dist.all_gather(peers, steps, group=mps.get_tensor_model_parallel_group())
    return {"steps": steps.tolist(), "peer_steps": [p.tolist() for p in peers],
            "unsharded_steps": full.last_stats.steps.tolist(), "out_diff": (out - expected).abs().max().item(),
            "iterations": sharded.last_stats.iterations}


def pipeline_dropout_matches_block(raw_cfg: dict) -> dict:
    """TP=2 with sequence parallelism and dropout, training mode: the pipeline module's layers
    (one stage) and megatron's TransformerBlock (GPTModel) with the same weights and the same RNG
    states must draw the same dropout masks, i.e. give the same logits. Also the logits of a
    second draw, to show dropout is really on."""
    import torch.distributed as dist

    from ascender_dist.config.resolve import config_from_dict, derive
    from ascender_dist.models.pipeline import build_pipeline_module, canonical_name
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group
    from ascender_dist.training.engine import build_run_model, model_layout
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_process_group()
    cfg = config_from_dict(raw_cfg)
    derived = derive(cfg, dist.get_world_size(), 256)
    init_model_parallel(2, 1, seed=3)
    block = build_run_model(cfg, derived).train()
    pipe = build_pipeline_module(cfg.model, model_layout(cfg, derived), cfg.train.precision, seed=3).train()
    state = block.state_dict()
    pipe_state = {name: state[canonical_name(name, cfg.model.num_layers)]
                  for name in pipe.state_dict() if not name.endswith("_extra_state")}
    pipe.load_state_dict(pipe_state, strict=False)
    tokens = torch.randint(0, 256, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def draw(model_fn, seed):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        with torch.no_grad():
            return model_fn()

    block_logits = draw(lambda: block(tokens, position_ids, None).transpose(0, 1), 9)  # [b, s, v] -> [s, b, v]
    pipe_logits = draw(lambda: pipe(tokens), 9)  # [s, b, v/tp]
    other_draw = draw(lambda: pipe(tokens), 10)
    return {"diff": (pipe_logits - block_logits).abs().max().item(),
            "other_draw_diff": (other_draw - block_logits).abs().max().item(),
            "loaded": len(pipe_state)}


def pipeline_recompute_matches_plain(raw_cfg: dict) -> dict:
    """The pipeline module (one stage) with and without activation checkpointing, same weights and
    RNG states, dropout on: the recompute must draw the forward's dropout masks again, so loss and
    every gradient agree."""
    import torch.distributed as dist

    from ascender_dist.config.resolve import config_from_dict, derive
    from ascender_dist.models.pipeline import TransformerLayerPipe, build_pipeline_module
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group
    from ascender_dist.training.engine import model_layout
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_process_group()
    cfg = config_from_dict(raw_cfg)
    derived = derive(cfg, dist.get_world_size(), 256)
    init_model_parallel(2, 1, seed=3)
    pipe = build_pipeline_module(cfg.model, model_layout(cfg, derived), cfg.train.precision, seed=3).train()
    tokens = torch.randint(0, 256, (2, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(5))
    layer_calls = [0]  # transformer-layer forwards: a recompute runs each layer a second time in backward
    for module in pipe.modules():
        if isinstance(module, TransformerLayerPipe):
            module.register_forward_hook(lambda *_: layer_calls.__setitem__(0, layer_calls[0] + 1))
    runs, calls = {}, {}
    for interval, seed in ((0, 9), (1, 9), (0, 10)):  # 0: no recompute; 1: every layer recomputed in backward
        pipe.set_checkpoint_interval(interval)
        pipe.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        layer_calls[0] = 0
        loss = pipe.loss_fn(pipe(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        calls[(interval, seed)] = layer_calls[0]
        runs[(interval, seed)] = (loss.item(), {n: p.grad.clone() for n, p in pipe.named_parameters()
                                               if p.grad is not None})  # fmt: skip
    grads = runs[(0, 9)][1]
    return {"loss_diff": abs(runs[(0, 9)][0] - runs[(1, 9)][0]), "num_grads": len(grads),
            "max_grad_diff": nan_max((runs[(1, 9)][1][n] - g).abs().max().item() for n, g in grads.items()),
            "layer_calls_plain": calls[(0, 9)], "layer_calls_recompute": calls[(1, 9)],
            # dropout is on: another seed draws other masks, another loss
            "other_seed_loss_diff": abs(runs[(0, 10)][0] - runs[(0, 9)][0])}


def dist_checkpoint_reshard(raw_cfg: dict, root: str) -> dict:
    """megatron dist-checkpointing: save at TP=2, load at TP=1; every tensor (per-head ASCender
    parameters, sharded Connection weights included) must come back whole, each TP rank's shard in
    its place. ``equal_tp_halves``: the TP-sharded tensors whose two saved halves are equal (a
    checkpoint that swapped them would pass; must be none)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps

    from ascender_dist.config.resolve import config_from_dict, derive
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.consolidate import gather_full_state, split_full, tp_partition
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group

    init_process_group()
    cfg = config_from_dict(raw_cfg)
    shared = cfg.model.ascender.share_omega_across_heads
    path = Path(root) / f"dist_ckpt_{cfg.model.architecture}{'_shared_omega' if shared else ''}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    saved = {}
    for tp in (2, 1):
        cfg.parallel.tensor_model_parallel_size = tp
        init_model_parallel(tp, 1, seed=11 + tp)  # different seeds: loading must overwrite everything
        model = build_run_model(cfg, derive(cfg, dist.get_world_size(), 256))
        if tp == 2:
            # every tensor moved away from any fresh initialisation (per-head constants, the Connection
            # weights seeded the same at any TP size): a tensor the checkpoint drops, or loads into the
            # wrong heads, then differs after the load. The noise is drawn for the whole tensor, the same
            # on both ranks, and each rank adds its own shard of it (replicated tensors stay equal): every
            # head gets its own values. ASCender's per-head omega, delta, kappa, lambdas and tau_score
            # start as one constant for all heads, so noise of the shard's shape (the same on both ranks,
            # as before) left both halves equal, and a checkpoint whose per-head ShardedTensors swapped
            # the two ranks' offsets passed with max_diff 0.0 (mutation run; it fails now: 0.22).
            noise = torch.Generator().manual_seed(7)
            tp_rank = mps.get_tensor_model_parallel_rank()
            split = {}  # name: (dim, stride) of the TP-sharded tensors
            for name, param in model.named_parameters():
                sharded, dim, stride = tp_partition(param)
                whole = [n * tp if sharded and d == dim else n for d, n in enumerate(param.shape)]
                full = 0.1 * torch.randn(whole, generator=noise, dtype=param.dtype)
                param.data.add_(split_full(full, dim, tp, tp_rank, stride) if sharded else full)
                if sharded:
                    split[name] = (dim, stride)
            dist_checkpointing.save(model.sharded_state_dict(), str(path))
            saved = gather_full_state(model, mps.get_tensor_model_parallel_group())
            equal_halves = sorted(name for name, (dim, stride) in split.items()
                                  if torch.equal(*(split_full(saved[name], dim, tp, r, stride) for r in range(tp))))
        else:
            fresh = gather_full_state(model, mps.get_tensor_model_parallel_group())
            dist_checkpointing.load(model.sharded_state_dict(), str(path))
    loaded = gather_full_state(model, mps.get_tensor_model_parallel_group())
    diffs = {name: (loaded[name] - value).abs().max().item() for name, value in saved.items()}
    equal_before_load = sorted(name for name, value in saved.items() if torch.equal(fresh[name], value))
    return {"max_diff": nan_max(diffs.values()), "num": len(diffs), "same_names": sorted(saved) == sorted(loaded),
            "equal_before_load": equal_before_load, "num_tp_sharded": len(split), "equal_tp_halves": equal_halves}
