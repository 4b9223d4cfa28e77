"""Checks run on 2 ranks: TP=2 with sequence parallelism vs TP=1 with the same weights, one forward
and backward (no optimizer): loss, logits and every parameter's gradient gathered to full shape."""

from __future__ import annotations

import contextlib

import torch

from tests.helpers.multiproc import run_checks

ASC = {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2, "chunk_size": 16, "omega_init": 0.5}
AUX = {"aux_compactness_weight": 0.5, "aux_crowding_weight": 0.5, "aux_alignment_weight": 0.5}
CONN = {"num_slots": 6, "rank": 4, "max_steps": 3, "causal_chunk_size": 8, "threshold": 0.0}
DEBUG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 32}
SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LLAMA = {"activation": "swiglu", "normalization": "RMSNorm", "num_query_groups": 2, "add_bias_linear": False,
         "position_embedding_type": "rope"}
# the models compared under SP (model sections; DEBUG sizes)
SP_MODELS = {
    "gpt": {},
    "llama": LLAMA,
    # aux losses on (each TP rank's a mean over its own heads) and one omega shared by all heads
    # (replicated over TP, its gradient summed over TP by its own hook, next to the SP norms')
    "ascender_aux_shared_omega": {"architecture": "ascender",
                                  "ascender": {**ASC, **AUX, "share_omega_across_heads": True}},
    # per-head omega, GQA + swiglu + RMSNorm, and the post_norm gate placement with trainable lambdas,
    # where kappa's gradient is real (~1e-4 with kappa_init 1; an eps residue under pre_norm)
    "ascender_llama_post_norm": {"architecture": "ascender", **LLAMA, "ascender": {
        **ASC, **AUX, "gate_placement": "post_norm", "trainable_lambdas": True, "kappa_init": 1.0}},
    "learned_pos_untied": {"position_embedding_type": "learned_absolute",
                           "untie_embeddings_and_output_weights": True},
}
# models with Connection layers: the config refuses sequence parallelism for them
SP_REFUSED = {
    "connection_bilinear": {"architecture": "connection", "connection": {**CONN, "connection": "bilinear"}},
    "mixed_sc": {"architecture": "connection", "layer_pattern": "SC", "ascender": ASC, "connection": CONN},
}
# negative controls, on the gpt model: the parameter whose gradient TP rank 1 doubles after the SP reduction
DOUBLED_PARAM = "decoder.layers.0.pre_mlp_layernorm.weight"


def main(args):
    return run_checks({
        **{f"{name}_sp": (lambda model=model: sp_parity({"model": {**DEBUG, **model}}))
           for name, model in SP_MODELS.items()},
        **{f"{name}_sp_refused": (lambda model=model: sp_refusal({"model": {**DEBUG, **model}}))
           for name, model in SP_REFUSED.items()},
        # a real defect must fail the comparison: one rank's gradient of one replicated parameter x2 ...
        "control_one_rank_norm_grad_doubled": lambda: sp_parity({"model": {**DEBUG}}, tamper="double"),
        # ... and the SP gradient reduction left out (each rank keeps its own sequence half's partial sum)
        "control_sp_grad_reduction_dropped": lambda: sp_parity({"model": {**DEBUG}}, tamper="no_reduce"),
    })


@contextlib.contextmanager
def _watch_builds(tamper: str | None, seen: list):
    """Wrap ``training.engine.build_run_model`` (what tests.helpers.parity builds with): record each
    model's sequence_parallel flag, its SP-tagged parameters and the sequence length every norm sees,
    and apply ``tamper`` to the sequence-parallel build."""
    from megatron.core import parallel_state as mps

    import ascender_dist.models.build as build
    import ascender_dist.training.engine as engine

    original_build, original_reduce = engine.build_run_model, build.reduce_sequence_parallel_grads

    def watched(cfg, derived):
        sp = cfg.parallel.sequence_parallel
        if tamper == "no_reduce" and sp:
            build.reduce_sequence_parallel_grads = lambda model: 0
        try:
            model = original_build(cfg, derived)
        finally:
            build.reduce_sequence_parallel_grads = original_reduce
        record = {"sequence_parallel": sp, "config_sp": model.config.sequence_parallel,
                  "sp_tagged": sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
                  "norm_seq_lens": set()}
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):  # [s/tp (SP) or s, b, h]
                module.register_forward_pre_hook(lambda _, inputs: record["norm_seq_lens"].add(inputs[0].shape[0]))
        if tamper == "double" and sp and mps.get_tensor_model_parallel_rank() == 1:
            # registered after the SP all-reduce hook, so it runs after it: rank 1's copy only
            dict(model.named_parameters())[DOUBLED_PARAM].register_hook(lambda g: 2 * g)
        seen.append(record)
        return model

    engine.build_run_model = watched
    try:
        yield
    finally:
        engine.build_run_model = original_build


def sp_parity(raw_cfg: dict, tamper: str | None = None) -> dict:
    """TP=2 + sequence parallel, then TP=1 (no SP: it needs TP > 1) loaded with TP=2's weights, each
    one training-loss forward + backward (tests.helpers.parity.forward_backward). Per gradient:
    [max |g_sp - g_ref|, max |g_ref|, norm of g_sp, norm of g_ref]; this rank's own copy of a
    replicated gradient (what its optimizer would apply)."""
    import torch.distributed as dist

    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.parallel.setup import init_process_group
    from tests.helpers.parity import forward_backward

    init_process_group()
    cfg = config_from_dict({**raw_cfg, "parallel": SP})
    seen: list = []
    with _watch_builds(tamper, seen):
        sharded = forward_backward(cfg, 2)
        cfg.parallel.sequence_parallel = False
        reference = forward_backward(cfg, 1, full_state=sharded["params"])
    if set(sharded["grads"]) != set(reference["grads"]):
        only_one = sorted(set(sharded["grads"]) ^ set(reference["grads"]))
        raise AssertionError(f"gradients present in only one layout: {only_one}")
    no_grad = reference["trainable"] - set(reference["grads"])
    if no_grad:
        raise AssertionError(f"trainable parameters without a gradient: {sorted(no_grad)}")
    grads = {name: [(sharded["grads"][name] - ref).abs().max().item(), ref.abs().max().item(),
                    sharded["grads"][name].norm().item(), ref.norm().item()]
             for name, ref in reference["grads"].items()}
    return {
        "loss": (sharded["loss"] - reference["loss"]).abs().item(),
        "loss_value": reference["loss"].item(),
        "logits": (sharded["logits"] - reference["logits"]).abs().max().item(),
        "grads": grads,
        "num_sharded": sharded["num_sharded"],
        "param_dtypes": sorted(set(sharded["param_dtypes"]) | set(reference["param_dtypes"])),
        "builds": [{**r, "norm_seq_lens": sorted(r["norm_seq_lens"])} for r in seen],
        "seq_length": cfg.model.seq_length,
        "tp_rank": dist.get_rank(),  # world 2 = one TP group of 2
    }


def sp_refusal(raw_cfg: dict) -> str:
    """The ConfigError of a TP=2 + sequence-parallel config (raises if it is accepted)."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.config.resolve import config_from_dict

    try:
        config_from_dict({**raw_cfg, "parallel": SP})
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("sequence parallelism accepted")
