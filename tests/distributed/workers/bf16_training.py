"""bf16 training in 2-rank layouts vs one process at ZeRO-1: data parallelism at ZeRO-1 (the layout
of every shipped scaling config), ZeRO-2 and ZeRO-3, a two-stage pipeline and TP2 at ZeRO-1.

``reference`` (1 rank) draws each model's initial weights, saves them and trains STEPS bf16
steps at ZeRO-1 (DeepSpeed's BF16_Optimizer: bf16 parameters, fp32 master weights, fp32 gradient
accumulation), accumulating all 4 micro-batches of each global batch; ``layouts`` (2 ranks) starts
each layout's run from those weights (``checkpoint.init_from``): at DP2 the same global batches as 2
micro-batches per rank, the ranks' fp32 gradient sums averaged by DeepSpeed's all-reduce; at PP2
all 4 micro-batches through both stages (one layer each: bf16 activations and their gradients sent
between the stages, each stage's BF16_Optimizer, the gradient norm over both stages, the tied
embedding's fp32 gradient all-reduced between the first and the last stage). Each run reports its
losses, global gradient norms and final fp32 masters next to the reference's.

``args["variants"]``: extra runs of ``[arch, variant, layout]`` with a deliberate change
(:func:`_variant`): bugs the comparison must reject (the negative controls of test_bf16_training),
and the rounding perturbations its tolerances were measured against.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.workers.layouts import GradNorms, _config
from tests.helpers.multiproc import run_checks

ARCHS = ("gpt", "ascender", "connection")  # models of layouts.ARCHS (tie-free ASCender, small Connection)
UNTIED = "_untied"  # an ARCHS name + UNTIED: the same model with its own output layer (no tied embedding)
# the models each layout trains (test_bf16_training says why PP2 runs them untied, and tied GPT too)
LAYOUT_ARCHS = {"dp2": ARCHS, "pp2": tuple(arch + UNTIED for arch in ARCHS) + ("gpt",), "dp2_zero2": ARCHS,
                "dp2_zero3": ARCHS, "tp2": ARCHS}
# 6 steps: warm-up (lr/2, lr) and the cosine decay; layouts' optimizer settings (grad_clip 0.25 clips
# every step here, Adam eps 1e-5)
STEPS = 6
# the 2-rank layouts trained against the 1-rank ZeRO-1 reference: data parallel at ZeRO-1 (the shipped
# configs' layout), 2 and 3, a two-stage pipeline at ZeRO-1 (one layer per stage, the reference's
# 4 micro-batches flowing through both stages; DP1) and two tensor-parallel ranks at ZeRO-1 (DP1)
LAYOUTS = {"dp2": {"zero_stage": 1}, "pp2": {"zero_stage": 1, "pipeline_model_parallel_size": 2},
           "dp2_zero2": {"zero_stage": 2}, "dp2_zero3": {"zero_stage": 3},
           "tp2": {"zero_stage": 1, "tensor_model_parallel_size": 2}}
TRAIN = {"precision": "bf16", "train_steps": STEPS}
BUGS = ("rank1_grad_dropped", "rank1_grad_doubled", "no_accumulation_scaling", "tied_grads_unreduced")
ROUNDINGS = ("bf16_reduce", "fp32_noise")


def _files(args, arch: str) -> dict:
    root = Path(args["root"])
    return {"init": root / f"init_{arch}.safetensors", "final": root / f"final_{arch}.safetensors",
            "record": root / f"record_{arch}.json"}


def _trainer(args, arch: str, name: str, parallel: dict, init_from=None, **train):
    from ascender_dist.training.trainer import Trainer

    norms = GradNorms()
    base, untied = arch.removesuffix(UNTIED), arch.endswith(UNTIED)
    cfg = _config(args, base, name, parallel, init_from=init_from, train={**TRAIN, **train},
                  model={"untie_embeddings_and_output_weights": True} if untied else None)
    return Trainer(cfg, callbacks=[norms]), norms


def _precision_used(trainer) -> dict:
    """What the run really trained with, read back from the engine: a run that fell back to fp32,
    to another optimizer or to another batch split could match too."""
    from megatron.core import parallel_state as mps

    return {"optimizer": type(trainer.engine.optimizer).__name__,
            "param_dtypes": sorted({str(p.dtype) for p in trainer.engine.module.parameters()}),
            "data_parallel_size": mps.get_data_parallel_world_size(),
            "pipeline_stages": mps.get_pipeline_model_parallel_world_size(),
            "gradient_accumulation_steps": trainer.engine.gradient_accumulation_steps()}


def reference(args):
    from ascender_dist.training.weights import gather_canonical_state, write_weights_file

    for arch in sorted({arch for archs in LAYOUT_ARCHS.values() for arch in archs}):
        files = _files(args, arch)
        trainer, norms = _trainer(args, arch, "reference", {"zero_stage": 1})
        write_weights_file(gather_canonical_state(trainer.engine.module, trainer.cfg), files["init"])
        losses = trainer.fit(final_save=False)
        write_weights_file(gather_canonical_state(trainer.engine.module, trainer.cfg), files["final"])
        files["record"].write_text(json.dumps({"losses": losses, "grad_norms": norms.values,
                                               "used": _precision_used(trainer)}))
    return {}


@contextlib.contextmanager
def _variant(engine, variant: str | None):
    """``engine`` with a deliberate change while active; yields a one-item list counting the calls
    of the changed code (0 would make a negative control vacuous).

    Bugs (must fail the comparison):
    - ``rank1_grad_dropped`` / ``rank1_grad_doubled``: rank 1's accumulated fp32 gradients times 0 /
      2 just before the data-parallel all-reduce (DeepSpeed's ``allreduce_bucket``, BF16_Optimizer's
      path at ZeRO-1): a reduction that lost or double-counted a rank.
    - ``no_accumulation_scaling``: the micro-batch losses enter backward times the accumulation
      steps, i.e. without the 1 / gradient_accumulation_steps scaling (the summed instead of the
      mean gradient, 2x at DP2). (Calling DeepSpeed's backward with ``scale_wrt_gas=False`` does not
      do it: its output hook then scales the gradient instead.)
    - ``tied_grads_unreduced`` (PP2): the tied embedding's gradient not all-reduced between the first
      and the last stage (the pipeline's tied-weight list reads as empty): each stage's copy steps by
      its own half of the gradient.
    Rounding perturbations (what the tolerances must and need not absorb; measured, not run by CI):
    - ``bf16_reduce``: ``train.grad_reduce_dtype: bf16``, one bf16 rounding of every reduced gradient
      (applied by the caller's config, nothing to patch here).
    - ``fp32_noise``: every reduced gradient times (1 + 2^-23 N(0, 1)), about one fp32 rounding: a
      reduction that sums in another order."""
    calls = [0]
    if variant in (None, "bf16_reduce"):
        yield calls
        return
    if variant == "tied_grads_unreduced":
        def no_tied_weights():
            calls[0] += 1
            return []

        engine.module.get_tied_weights_and_groups = no_tied_weights
        try:
            yield calls
        finally:
            del engine.module.__dict__["get_tied_weights_and_groups"]
        return
    if variant == "no_accumulation_scaling":
        real_backward = engine.backward

        def backward(loss, *rest, **kwargs):
            calls[0] += 1
            return real_backward(loss * engine.gradient_accumulation_steps(), *rest, **kwargs)

        engine.backward = backward
    else:
        real_reduce = engine.allreduce_bucket
        noise = torch.Generator().manual_seed(3)

        def allreduce_bucket(bucket, dp_group, dp_world_size=None):
            calls[0] += 1
            if variant == "fp32_noise":
                out = real_reduce(bucket, dp_group, dp_world_size)
                return out.mul_(1 + 2.0**-23 * torch.randn(out.shape, generator=noise, dtype=out.dtype))
            if dist.get_rank() == 1:
                for grad in bucket:
                    grad.mul_({"rank1_grad_dropped": 0.0, "rank1_grad_doubled": 2.0}[variant])
            return real_reduce(bucket, dp_group, dp_world_size)

        engine.allreduce_bucket = allreduce_bucket
    try:
        yield calls
    finally:  # the instance attribute goes; the class's method is back
        del engine.__dict__["backward" if variant == "no_accumulation_scaling" else "allreduce_bucket"]


def _compare(args, arch: str, variant: str | None = None, layout: str = "dp2") -> dict:
    """Train ``arch`` in ``layout`` (LAYOUTS) from the reference's initial weights; on rank 0 its
    losses and gradient norms next to the reference's, and per weight tensor [max |w - w_ref|,
    max |w_ref - w_init|] (final fp32 masters)."""
    from ascender_dist.training.weights import gather_canonical_state, read_weights_file

    if variant is not None and variant not in BUGS + ROUNDINGS:
        raise ValueError(f"unknown variant {variant!r}")
    files = _files(args, arch)
    reduce_dtype = {"grad_reduce_dtype": "bf16"} if variant == "bf16_reduce" else {}
    trainer, norms = _trainer(args, arch, f"{layout}_{variant or 'plain'}", LAYOUTS[layout], init_from=str(files["init"]),
                              **reduce_dtype)  # fmt: skip
    with _variant(trainer.engine, variant) as calls:
        losses = trainer.fit(final_save=False)
    final = gather_canonical_state(trainer.engine.module, trainer.cfg)
    if dist.get_rank() != 0:
        return {}
    ref = json.loads(files["record"].read_text())
    init, ref_final = read_weights_file(files["init"]), read_weights_file(files["final"])
    if set(ref_final) != set(final):
        raise AssertionError(f"parameters present in only one run: {sorted(set(ref_final) ^ set(final))}")
    weights = {name: [(final[name] - value).abs().max().item(), (value - init[name]).abs().max().item()]
               for name, value in ref_final.items()}
    return {"used": _precision_used(trainer), "reference_used": ref["used"], "losses": losses,
            "reference_losses": ref["losses"], "grad_norms": norms.values, "reference_grad_norms": ref["grad_norms"],
            "weights": weights, "variant_calls": calls[0]}


def layouts(args):
    """Every model of every 2-rank layout (checks named ``{arch}_{layout}``), then the variants."""
    checks = {f"{arch}_{layout}": (lambda arch=arch, layout=layout: _compare(args, arch, layout=layout))
              for layout, archs in LAYOUT_ARCHS.items() for arch in archs}
    for arch, variant, layout in args.get("variants", []):
        checks[f"{arch}_{variant}"] = lambda arch=arch, variant=variant, layout=layout: _compare(args, arch, variant,
                                                                                                layout)
    if "only" in args:  # named checks only (debugging one cell)
        checks = {name: check for name, check in checks.items() if name in args["only"]}
    return run_checks(checks)
