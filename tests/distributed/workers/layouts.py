"""The parity matrix: a few optimizer steps under every parallel layout vs one process.

``reference`` (1 rank) draws the initial weights of each architecture, saves them, trains, and
saves losses + final weights. ``layouts`` (2 or 4 ranks) starts every layout from those weights
(``checkpoint.init_from``) on the same data and reports the differences (``args["only"]``: just
the named cells, e.g. ``["gpt_deep_pp4"]``, when debugging one).

The matrix is ``ARCHS`` x ``LAYOUTS[world]``, less ``UNSUPPORTED`` (refused at config load) and
restricted per architecture by ``ONLY_LAYOUTS``: see :func:`matrix`.
"""

import contextlib
import json
import pickle
from pathlib import Path
from unittest import mock

import torch.distributed as dist

from ascender_dist.config.resolve import config_from_dict
from ascender_dist.training.callbacks import Callback
from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks
from tests.helpers.numeric import nan_max, worst_key

STEPS = 3
ARCHS = {
    "gpt": {},
    # Two discontinuities of ASCender are kept out of this multi-step comparison (both are checked at
    # one step under TP in test_model_parity, where they cannot be amplified):
    # - k == window, no globals: every candidate is a neighbour. A real top-k choice can flip on a
    #   near-tie when TP's reduction order moves hidden states by 1e-7 (measured: 3e-4 after 3 steps).
    # - no linear biases: z is translation invariant (distances, centroid offsets), so the z part of
    #   the QKV bias has a zero true gradient whose float value is cancellation noise (~1e-7) that
    #   Adam turns into lr-sized steps differing between layouts (measured 3e-5 at TP2).
    "ascender": {"architecture": "ascender", "add_bias_linear": False,
                 "ascender": {"d_z": 4, "d_a": 4, "k": 8, "window": 8, "num_global": 0, "chunk_size": 8,
                              "omega_init": 0.5}},
    "connection": {"architecture": "connection",
                   "connection": {"num_slots": 4, "rank": 4, "max_steps": 2, "causal_chunk_size": 8}},
}
# share_omega_across_heads (one omega [1, 3] per layer, replicated over TP, gradient all-reduced over
# TP): the same tie-free ASCender as above. Only the TP layouts change anything for it (elsewhere it
# is one more replicated parameter), so it runs there only.
ARCHS["ascender_shared_omega"] = {**ARCHS["ascender"],
                                  "ascender": {**ARCHS["ascender"]["ascender"], "share_omega_across_heads": True}}
# A real top-k choice (k < window, global tokens) compared after ONE step, where a near-tie cannot
# have been moved by an earlier step's reduction order (TP's one-step check: test_model_parity); and
# the mixed ASCender + Connection layer pattern.
ARCHS["ascender_topk"] = {**ARCHS["ascender"], "ascender": {**ARCHS["ascender"]["ascender"], "k": 4,
                                                           "num_global": 2}}
ARCHS["mixed_sc"] = {"architecture": "connection", "layer_pattern": "SC", "add_bias_linear": False,
                     "ascender": ARCHS["ascender"]["ascender"], "connection": ARCHS["connection"]["connection"]}
# Learned absolute positions with tied embeddings: under PP the last stage holds a copy of the whole
# embedding module for the tied head, whose position table is never trained; the gathered weights
# must be the first stage's.
ARCHS["gpt_learned_pos"] = {"position_embedding_type": "learned_absolute"}
# Untied input and output embeddings: under PP the last stage holds its own output layer (the
# pipeline's LMHeadPipe) instead of a tied copy of the embedding.
ARCHS["gpt_untied"] = {"untie_embeddings_and_output_weights": True}
# ASCender's three auxiliary losses on (their weights default to 0): their gradient is attached with
# the scale 1 / (gradient accumulation steps x TP), so a layout with another accumulation count (dp2:
# 2 micro-batches per rank, the reference 4) or TP size must still train like the reference. Measured:
# a scale of 1/tp moves dp2_zero1's weights by 9e-3, 1/GAS moves tp2's by 9e-3. Weights 0.1: at 0.5 the
# aux gradient is about 3x the task's, and TP's float noise in it (~5e-7 relative at one step) becomes
# 3e-5 in the embedding through Adam's eps after 3 steps; at 0.1 it is 2e-6.
ARCHS["ascender_aux"] = {**ARCHS["ascender"], "ascender": {
    **ARCHS["ascender"]["ascender"], "aux_compactness_weight": 0.1, "aux_crowding_weight": 0.1,
    "aux_alignment_weight": 0.1}}
# Grouped-query attention with several query groups per TP rank: 8 heads in 4 groups (head dim 4 at
# hidden 32), so at TP2 each rank holds 2 groups of 2 heads and the fused QKV projection's output
# dim is split between whole groups (q of 2 heads | k | v per group, plus z | h per head for
# ASCender). The default 4-head model is plain MHA, one head per group. The layouts compare with a
# reference of the same GQA model, so a query-group count silently dropped by the config would match
# too: _layout_used also reads the heads and query groups per rank back from the built attention.
GQA = {"num_attention_heads": 8, "num_query_groups": 4}
ARCHS["gpt_gqa"] = {**GQA}
ARCHS["ascender_gqa"] = {**ARCHS["ascender"], **GQA}
# the Llama block (SwiGLU's two-in-one fc1 split over TP with stride 2, RMSNorm, no biases) beyond
# the one-step TP2 check of test_model_parity: sequence parallel, the pipeline, ZeRO-3
ARCHS["gpt_llama"] = {"activation": "swiglu", "normalization": "RMSNorm", "add_bias_linear": False}
# the linear connection: one [N, N] slot matrix per layer, replicated over TP (its gradient all-reduced)
ARCHS["connection_linear"] = {"architecture": "connection",
                              "connection": {**{k: v for k, v in ARCHS["connection"]["connection"].items()
                                                if k != "rank"}, "connection": "linear"}}
# GPT attention and ASCender layers alternating (the architectures grid's gpt+ascender model): the
# pattern's two attention kinds share one layer stack, split over TP and PP stages
ARCHS["mixed_as"] = {"architecture": "ascender", "layer_pattern": "AS", "add_bias_linear": False,
                     "ascender": ARCHS["ascender"]["ascender"]}
# Four layers, so that a 4-stage pipeline has two middle stages (neither the embedding's nor the
# head's): activations in and out by point-to-point on both sides, no loader reads, the tied
# embedding's gradient all-reduced between the first and last stage only
ARCHS["gpt_deep"] = {"num_layers": 4}
ARCHS["ascender_deep"] = {**ARCHS["ascender"], "num_layers": 4}
ARCHS["connection_deep"] = {**ARCHS["connection"], "num_layers": 4}
ARCH_STEPS = {"ascender_topk": 1}
ONLY_LAYOUTS = {"ascender_shared_omega": ("tp2", "tp2_sequence_parallel", "tp2_dp2_zero3"),
                "gpt_learned_pos": ("pp2",),
                "ascender_topk": ("pp2", "dp2_zero1", "dp2_zero3", "dp2_recompute", "pp2_dp2"),
                "mixed_sc": ("tp2", "pp2", "dp2_zero1", "tp2_pp2"),
                "mixed_as": ("tp2", "pp2", "dp2_zero1", "tp2_pp2"),
                "gpt_untied": ("pp2", "tp2_pp2"),
                # the aux losses' gradient scale with accumulation 2 per pipeline, ZeRO-3, sequence parallel
                "ascender_aux": ("dp2_zero1", "pp2", "tp2", "pp2_dp2", "tp2_dp2_zero3", "tp2_sequence_parallel"),
                "gpt_llama": ("tp2", "tp2_sequence_parallel", "tp2_pp2", "tp2_dp2_zero3"),
                "connection_linear": ("tp2", "tp2_pp2", "tp2_dp2_zero3"),
                # the query-group split: TP2 alone, and one 4-rank TP2 layout each (the pipeline's
                # own layer stack for GPT, ZeRO-3's partitioned QKV for ASCender)
                "gpt_gqa": ("tp2", "tp2_pp2"),
                "ascender_gqa": ("tp2", "tp2_dp2_zero3"),
                "gpt_deep": ("pp4",), "ascender_deep": ("pp4",), "connection_deep": ("pp4",)}
LAYOUTS = {
    2: {"tp2": {"tensor_model_parallel_size": 2},
        "pp2": {"pipeline_model_parallel_size": 2},
        "dp2_zero0": {"zero_stage": 0},  # plain data parallelism: gradients all-reduced, no sharding
        "dp2_zero1": {"zero_stage": 1},
        "dp2_zero2": {"zero_stage": 2},
        "dp2_zero3": {"zero_stage": 3},
        "tp2_sequence_parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        "dp2_recompute": {"zero_stage": 1, "activation_checkpointing": True},
        "pp2_recompute": {"pipeline_model_parallel_size": 2, "activation_checkpointing": True},
        # megatron's own recompute (not the pipeline's) re-running TP's collectives, with and without
        # sequence parallel's sharded activations
        "tp2_recompute": {"tensor_model_parallel_size": 2, "activation_checkpointing": True},
        "tp2_sp_recompute": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                             "activation_checkpointing": True},
        # fp32 ZeRO-0 under a pipeline: the run's own optimizer clips by the norm over both stages
        "pp2_zero0": {"pipeline_model_parallel_size": 2, "zero_stage": 0}},
    4: {"tp2_pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        "pp2_dp2": {"pipeline_model_parallel_size": 2},  # ZeRO-1 over the data-parallel pairs of each stage
        "tp2_dp2_zero3": {"tensor_model_parallel_size": 2, "zero_stage": 3},
        "tp2_pp2_zero0": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "zero_stage": 0},
        # the pipeline's own sequence-parallel code: rotary length x TP, the norms' gradient hooks on
        # the PipelineModule (its layers are not megatron's GPTModel)
        "tp2_pp2_sequence_parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                      "sequence_parallel": True},
        # sequence parallel with data parallelism: the TP-summed norm gradients then averaged over DP
        "tp2_dp2_sequence_parallel": {"tensor_model_parallel_size": 2, "zero_stage": 1, "sequence_parallel": True},
        # sequence parallel with ZeRO-3: the norms' TP-summing gradient hooks on parameters ZeRO-3
        # partitions over DP (their data released between uses), the sequence-sharded activations
        # through ZeRO-3's gathered weights
        "tp2_sp_dp2_zero3": {"tensor_model_parallel_size": 2, "zero_stage": 3, "sequence_parallel": True},
        # the run's own fp32 optimizer (ZeRO-0) clipping by the norm over TP x DP, and ZeRO-2's
        # partitioned gradients of TP-sharded weights; ZeRO-0 over a pipeline with data parallelism
        "tp2_dp2_zero0": {"tensor_model_parallel_size": 2, "zero_stage": 0},
        "tp2_dp2_zero2": {"tensor_model_parallel_size": 2, "zero_stage": 2},
        "pp2_dp2_zero0": {"pipeline_model_parallel_size": 2, "zero_stage": 0},
        # TP x DP at the default ZeRO stage (1) without sequence parallel: the optimizer states of
        # TP-sharded weights partitioned over DP
        "tp2_dp2_zero1": {"tensor_model_parallel_size": 2, "zero_stage": 1},
        # one layer per stage: stages 1 and 2 are middle stages (the 4-layer architectures only)
        "pp4": {"pipeline_model_parallel_size": 4},
        # one head (and a quarter of the MLP, of Connection's projections) per rank
        "tp4": {"tensor_model_parallel_size": 4}},
    # all three at once (a large run's layout): TP-sharded stages, ZeRO-1 over each stage's DP pairs, the
    # tied embedding's gradient all-reduced between the first and last stage of each TP rank
    8: {"tp2_pp2_dp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "zero_stage": 1}},
}


# refused at config load with the reason (tested in test_layouts), so not in the matrix
UNSUPPORTED = {("connection", "tp2_sequence_parallel"), ("connection", "tp2_pp2_sequence_parallel"),
               ("connection", "tp2_dp2_sequence_parallel"), ("connection", "tp2_sp_dp2_zero3"),
               ("connection", "tp2_sp_recompute")}


def _stages_fit(arch: str, layout: dict) -> bool:
    """Whether the architecture has a layer for every pipeline stage of the layout (the tiny model: 2)."""
    return layout.get("pipeline_model_parallel_size", 1) <= ARCHS[arch].get("num_layers", 2)


def matrix(world: int) -> list[tuple[str, str]]:
    return [(arch, name) for arch in ARCHS for name in LAYOUTS[world]
            if (arch, name) not in UNSUPPORTED and name in ONLY_LAYOUTS.get(arch, (name,))
            and _stages_fit(arch, LAYOUTS[world][name])]


def _config(args, arch: str, name: str, parallel: dict, init_from=None, train: dict | None = None,
            model: dict | None = None):
    """The tiny run of ``arch`` (ARCHS; ``model``: these model fields on top) in ``parallel``."""
    # Adam eps 1e-5 instead of 1e-8: some parameters have a gradient that is exactly zero in exact
    # arithmetic (a key bias shifts every score of a row equally; z is translation invariant), so
    # their float gradient is rounding noise (~1e-10) that differs between layouts, and Adam with a
    # tiny eps turns noise of either sign into a full +-lr step (measured: 1.8e-3 in ASCender's QKV
    # bias after 3 steps at TP2). With eps 1e-5 noise moves nothing and real gradients still dominate.
    return config_from_dict(tiny_run_config(
        args["data"], Path(args["root"]) / f"{arch}_{name}",
        model={**ARCHS[arch], **(model or {})}, parallel=parallel, train={"train_steps": ARCH_STEPS.get(arch, STEPS), **(train or {})},
        # grad_clip 0.25: below every architecture's first gradient norms, so every layout clips
        optimizer={"eps": 1e-5, "grad_clip": 0.25, **({"warmup_steps": 0} if arch in ARCH_STEPS else {})},
        checkpoint={"init_from": init_from, "auto_resume": False}))


# validation micro-batches in all after training: 4 at DP1, 2 per rank at DP2 (the largest DP here);
# the same sequences for every layout (a per-rank count made DP2's validation set twice the
# reference's). VAL_MICRO_BATCHES - 1 at DP2 is rounded up to the same 4.
VAL_MICRO_BATCHES = 4


def _files(args, arch: str) -> dict:
    root = Path(args["root"])
    return {"init": root / f"init_{arch}.safetensors", "final": root / f"final_{arch}.safetensors",
            "losses": root / f"losses_{arch}.json", "grad_norms": root / f"grad_norms_{arch}.json",
            "val": root / f"val_{arch}.json"}


class GradNorms(Callback):
    """The logged global gradient norm of every step (None where a layout reports none)."""

    def __init__(self):
        self.values = []

    def on_step_end(self, trainer, values: dict) -> None:
        self.values.append(values["train/grad_norm"])


def reference(args):
    from ascender_dist.training.trainer import Trainer
    from ascender_dist.training.weights import gather_canonical_state, write_weights_file

    out = {}
    for arch in ARCHS:
        files = _files(args, arch)
        norms = GradNorms()
        trainer = Trainer(_config(args, arch, "reference", {"zero_stage": 0}), callbacks=[norms])
        write_weights_file(gather_canonical_state(trainer.engine.module, trainer.cfg), files["init"])
        losses = trainer.fit()
        write_weights_file(gather_canonical_state(trainer.engine.module, trainer.cfg), files["final"])
        files["val"].write_text(json.dumps(trainer.validate(VAL_MICRO_BATCHES)))
        files["losses"].write_text(json.dumps(losses))
        files["grad_norms"].write_text(json.dumps(norms.values))
        out[arch] = losses
    return out


@contextlib.contextmanager
def objects_received():
    """Counts the pickled bytes of the objects this rank receives from other ranks through
    torch.distributed's object collectives (how gather_canonical_state moves weights) while active:
    yields a one-item list holding the running total."""
    total = [0]
    size = lambda objs: sum(len(pickle.dumps(o)) for o in objs)  # noqa: E731
    real = {name: getattr(dist, name) for name in ("all_gather_object", "recv_object_list", "broadcast_object_list",
                                                     "gather_object")}

    def all_gather_object(out, obj, *a, **k):
        real["all_gather_object"](out, obj, *a, **k)
        total[0] += size(o for i, o in enumerate(out) if i != dist.get_rank())

    def recv_object_list(out, *a, **k):
        result = real["recv_object_list"](out, *a, **k)
        total[0] += size(out)
        return result

    def broadcast_object_list(out, src=0, *a, **k):
        real["broadcast_object_list"](out, src, *a, **k)
        if dist.get_rank() != src:
            total[0] += size(out)

    def gather_object(obj, out=None, dst=0, *a, **k):
        real["gather_object"](obj, out, dst, *a, **k)
        if out is not None and dist.get_rank() == dst:
            total[0] += size(o for i, o in enumerate(out) if i != dst)

    fakes = {"all_gather_object": all_gather_object, "recv_object_list": recv_object_list,
             "broadcast_object_list": broadcast_object_list, "gather_object": gather_object}
    with contextlib.ExitStack() as stack:
        for name, fake in fakes.items():
            stack.enter_context(mock.patch.object(dist, name, fake))
        yield total


def _tp_replica_diff(trainer) -> float:
    """Max difference between the TP ranks' copies of every parameter NOT partitioned over TP (norms,
    row-parallel biases, ASCender's shared omega): replicas must stay identical, while the consolidated
    weights read only TP rank 0's copy. 0 at TP=1. Collective on all ranks."""
    import torch
    from megatron.core import parallel_state as mps

    from ascender_dist.parallel.consolidate import tp_partition
    from ascender_dist.training.weights import _gathered, canonical_parameters

    group = mps.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    worst = torch.zeros(1)
    if world > 1:
        named = [p for _, p in canonical_parameters(trainer.engine.module, trainer.cfg) if not tp_partition(p)[0]]
        with _gathered(named, trainer.cfg.parallel.zero_stage):
            for param in named:
                parts = [torch.empty_like(param.data) for _ in range(world)]
                dist.all_gather(parts, param.data.contiguous(), group=group)
                worst = torch.maximum(worst, torch.stack([(x - parts[0]).abs().max() for x in parts]).max().float().cpu().view(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _layout_used(trainer) -> dict:
    """The layout the run really trained with, read back from megatron's process groups, DeepSpeed's
    engine and the built model: a config regression that quietly ran another layout (pp2 as DP=2,
    ZeRO-3 as stage 0, recompute off, GQA as MHA) would still match the reference. Collective-free.

    ``attention_per_rank``: the distinct [heads, query groups] per TP rank of this rank's megatron
    attention modules (SelfAttention and its core attention; Connection layers have none)."""
    from megatron.core import parallel_state as mps

    module = trainer.engine.module
    configs = [m.config for m in module.modules() if hasattr(getattr(m, "config", None), "sequence_parallel")]
    return {"tensor_model_parallel_size": mps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": mps.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": mps.get_data_parallel_world_size(),
            "zero_stage": trainer.engine.zero_optimization_stage(),
            "sequence_parallel": any(c.sequence_parallel for c in configs),
            "activation_checkpointing": any(c.recompute_granularity == "full" for c in configs)
            or getattr(module, "activation_checkpoint_interval", 0) > 0,  # megatron's, or the pipeline's
            "attention_per_rank": sorted({(m.num_attention_heads_per_partition, m.num_query_groups_per_partition)
                                          for m in module.modules() if hasattr(m, "num_query_groups_per_partition")})}


def layout_expected(parallel: dict, world: int, reference, model: dict) -> dict:
    """What a LAYOUTS entry asks for, with the run config's defaults (``reference``: the arch's
    reference RunConfig) filled in; rank 0's view (pipeline stage 0's layers). The heads and query
    groups come from ``model``, the model section as written (not as resolved: a loader that
    dropped num_query_groups would resolve both sides to MHA)."""
    from ascender_dist.config.architectures import expand_layer_pattern

    tp, pp = parallel.get("tensor_model_parallel_size", 1), parallel.get("pipeline_model_parallel_size", 1)
    first_stage = expand_layer_pattern(reference.model)[: reference.model.num_layers // pp]
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": world // (tp * pp),
            "zero_stage": parallel.get("zero_stage", reference.parallel.zero_stage),
            "sequence_parallel": parallel.get("sequence_parallel", False),
            "activation_checkpointing": parallel.get("activation_checkpointing", False),
            "attention_per_rank": [(heads // tp, groups // tp)] if set(first_stage) - {"C"} else []}


def _compare(args, arch: str, name: str, parallel: dict) -> dict:
    from ascender_dist.training.trainer import Trainer
    from ascender_dist.training.weights import gather_canonical_state, read_weights_file

    files = _files(args, arch)
    norms = GradNorms()
    trainer = Trainer(_config(args, arch, name, parallel, init_from=str(files["init"])), callbacks=[norms])
    used = _layout_used(trainer)
    written = tiny_run_config(args["data"], Path(args["root"]), model=ARCHS[arch])["model"]
    expected = layout_expected(parallel, dist.get_world_size(), _config(args, arch, "reference", {}), written)
    losses = trainer.fit()
    val_loss = trainer.validate(VAL_MICRO_BATCHES)
    val_rounded_up = trainer.validate(VAL_MICRO_BATCHES - 1)
    with objects_received() as received:
        final = gather_canonical_state(trainer.engine.module, trainer.cfg)
    received_by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(received_by_rank, received[0])
    replica_diff = _tp_replica_diff(trainer)
    if dist.get_rank() != 0:
        return {}
    ref_losses = json.loads(files["losses"].read_text())
    ref_final = read_weights_file(files["final"])
    missing = sorted(set(ref_final) ^ set(final))
    if missing:
        raise AssertionError(f"parameters present in only one layout: {missing}")
    param_diff = {k: (final[k] - v).abs().max().item() for k, v in ref_final.items()}
    worst = worst_key(param_diff)
    shared = [k for k in ref_final if k.endswith("omega_shared")]
    init = read_weights_file(files["init"]) if shared else {}
    return {"layout_used": used, "layout_expected": expected, "losses": losses, "reference_losses": ref_losses,
            "loss_diff": nan_max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "val_loss": val_loss, "reference_val_loss": json.loads(files["val"].read_text()),
            "val_rounded_up": val_rounded_up, "dp": trainer.pstate.dp_size,
            "grad_norms": norms.values, "reference_grad_norms": json.loads(files["grad_norms"].read_text()),
            "param_diff": param_diff[worst], "worst_param": worst, "replica_diff": replica_diff,
            "weights_received": received_by_rank, "model_bytes": sum(len(pickle.dumps(v)) for v in final.values()),
            "shared_omega": {"count": len(shared), "diff": nan_max([0.0, *(param_diff[k] for k in shared)]),
                             "moved": nan_max([0.0, *((final[k] - init[k]).abs().max().item() for k in shared)])}}


def pp_stage_init(args) -> dict:
    """Fresh weights (no init_from) of a 4-layer GPT at PP=4, one layer per stage: the largest
    difference between the same weight of the layers on every pair of stages 1..3 (stage 0 draws
    the embedding first), by weight name. Equal seeds on every stage would make these 0."""
    from megatron.core import parallel_state as mps

    from ascender_dist.training.trainer import Trainer

    cfg = config_from_dict(tiny_run_config(
        args["data"], Path(args["root"]) / "pp4_fresh_init", model={"num_layers": 4},
        parallel={"pipeline_model_parallel_size": 4}, train={"train_steps": 4}, checkpoint={"auto_resume": False}))
    trainer = Trainer(cfg)
    layer = {n.split(".layer.", 1)[1]: p.detach().clone() for n, p in trainer.engine.module.named_parameters()
             if ".layer." in n}
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, (mps.get_pipeline_model_parallel_rank(), layer))
    by_stage = dict(stages)
    pairs = [(1, 2), (1, 3), (2, 3)]
    return {f"{a}-{b}": {n: (by_stage[a][n] - by_stage[b][n]).abs().max().item() for n in by_stage[a]
                         if by_stage[a][n].dim() > 1} for a, b in pairs}


def part_of(cells: list, part: int, parts: int) -> list:
    """Every ``parts``-th cell from ``part`` on: the matrix runs in ``parts`` launches, as the process
    groups of each pipeline-parallel cell's engine stay alive (deepspeed never ends its pipeline grid's
    groups) with their gloo threads, which slow the later cells of one long launch."""
    return cells[part::parts]


def layouts(args):
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    part, parts = args.get("part", 0), args.get("parts", 1)
    cells = [cell for cell in part_of(matrix(world), part, parts) if "only" not in args or f"{cell[0]}_{cell[1]}" in args["only"]]
    checks = {f"{arch}_{name}": (lambda arch=arch, name=name: _compare(args, arch, name, LAYOUTS[world][name]))
              for arch, name in cells}
    if world == 4 and part == 0 and "pp4_stage_init" in args.get("only", ("pp4_stage_init",)):
        checks["pp4_stage_init"] = lambda: pp_stage_init(args)
    return run_checks(checks)
