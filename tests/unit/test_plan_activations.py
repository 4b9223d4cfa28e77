"""``plan``'s activation memory against what autograd really keeps for megatron-core's layer as this
project configures it: every tensor saved for backward during one forward (one count per storage,
the parameters left out), for models of one and two layers. The per-layer difference must equal
``_layer_activation_bytes`` and the one-layer total the plan's activations (the remaining small
tensors: token ids, loss mask, < 1%)."""

import pytest
import torch

from ascender_dist.config.resolve import config_from_dict, derive
from ascender_dist.tools import plan as plan_module
from ascender_dist.tools.plan import ACTIVATION_BYTES, ClusterShape, plan
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

VOCAB, BATCH = 1000, 2
MODEL = dict(preset="debug", hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128)
CASES = {
    "bf16 MHA RoPE GELU LayerNorm": ("bf16", {}),
    "bf16 GQA SwiGLU RMSNorm": ("bf16", {"num_query_groups": 2, "activation": "swiglu", "ffn_hidden_size": 160,
                                         "normalization": "RMSNorm"}),
    "bf16 dropout": ("bf16", {"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    "fp32 MHA learned positions": ("fp32", {"position_embedding_type": "learned_absolute"}),
    "fp32 one query group, learned positions": ("fp32", {"num_query_groups": 1,
                                                        "position_embedding_type": "learned_absolute"}),
}


def _config(precision: str, model: dict, layers: int, batch: int = BATCH):
    return config_from_dict({"model": {**MODEL, **model, "num_layers": layers},
                             "train": {"precision": precision, "micro_batch_size": batch, "global_batch_size": batch}})


def _saved_bytes(cfg, impl: str | None = None) -> int:
    """Bytes of every storage autograd keeps during one forward of the training loss (not parameters)."""
    from ascender_dist.models.build import lm_loss
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel
    from ascender_dist.training.engine import build_run_model

    destroy_model_parallel()
    init_model_parallel(1, 1, seed=1)
    model = build_run_model(cfg, derive(cfg, 1, VOCAB)).train()
    for module in model.modules():  # ASCender's core attention: force a path (impl is its knob)
        if impl is not None and hasattr(module, "impl"):
            module.impl = impl
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, VOCAB, (cfg.train.micro_batch_size, cfg.model.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lm_loss(model, tokens, VOCAB)
    return sum(n for ptr, n in seen.items() if ptr not in weights)


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_counts_what_autograd_keeps(single_rank_group, monkeypatch, name):
    precision, model = CASES[name]
    act_bytes = ACTIVATION_BYTES[precision]
    # torch's CPU dropout keeps its mask in the tensor's dtype (the fused GPU kernel: bool, 1 byte)
    monkeypatch.setattr(plan_module, "MASK_BYTES", act_bytes)
    one, two = _config(precision, model, 1), _config(precision, model, 2)
    layer = _saved_bytes(two) - _saved_bytes(one)
    assert plan_module._layer_activation_bytes(one, "A", BATCH, act_bytes) == layer
    planned = plan(one, ClusterShape(nodes=1, gpus_per_node=1), vocab_size=VOCAB).memory.activations
    assert planned == pytest.approx(_saved_bytes(one), rel=0.01)


# ASCender layers, per path: head dim 24 is not a Triton kernel's, so the plan counts the fused torch
# path, which is what CPU training runs; head dim 16 is, so the plan counts the Triton path, forced
# here (the interpreter runs it on CPU tensors: tests/conftest.py)
ASCENDER = dict(architecture="ascender", seq_length=64,
                ascender={"d_z": 8, "d_a": 4, "k": 4, "window": 16, "num_global": 2})
S_CASES = {
    "bf16 torch path": ("bf16", {"hidden_size": 96}, None),
    "bf16 torch path GQA, aux losses on": ("bf16", {"hidden_size": 96, "num_query_groups": 2, "ascender": {
        **ASCENDER["ascender"], "aux_compactness_weight": 0.1, "aux_crowding_weight": 0.1,
        "aux_alignment_weight": 0.1}}, None),
    # d_a 64: head dim 64 is a kernel's, the operand widths are not (a GPU runs the torch path)
    "bf16 torch path, wide geometry": ("bf16", {"hidden_size": 256, "ascender": {**ASCENDER["ascender"], "d_z": 8,
                                                                                    "d_a": 64}}, None),
    "fp32 torch path, Cohesion off": ("fp32", {"hidden_size": 96, "ascender": {**ASCENDER["ascender"],
                                                                                "use_coh": False}}, None),
    "bf16 Triton path GQA, aux losses on": ("bf16", {"num_query_groups": 2, "ascender": {
        **ASCENDER["ascender"], "aux_compactness_weight": 0.1, "aux_crowding_weight": 0.1,
        "aux_alignment_weight": 0.1}}, "triton"),
    "fp32 Triton path, Separation off": ("fp32", {"ascender": {**ASCENDER["ascender"], "use_sep": False}},
                                         "triton"),
}


@pytest.mark.parametrize("name", list(S_CASES))
def test_the_plan_counts_what_an_ascender_layer_keeps(single_rank_group, name):
    from ascender_dist.models.ascender.kernels.support import SUPPORTED_HEAD_DIMS, shared_memory_shortfall

    precision, model, impl = S_CASES[name]
    model = {**ASCENDER, **model}
    one = _config(precision, model, 1)
    head_dim = one.model.hidden_size // one.model.num_attention_heads
    covered = head_dim in SUPPORTED_HEAD_DIMS and not shared_memory_shortfall("", None, head_dim, one.model.ascender)
    assert covered == (impl == "triton")  # the path the plan assumes is the one measured
    act_bytes = ACTIVATION_BYTES[precision]
    planned = {b: plan_module._layer_activation_bytes(one, "S", b, act_bytes) for b in (BATCH, 2 * BATCH)}
    layer = {b: _saved_bytes(_config(precision, model, 2, b), impl) - _saved_bytes(_config(precision, model, 1, b), impl)
             for b in (BATCH, 2 * BATCH)}  # fmt: skip
    # every per-token byte exactly (the batch-independent part cancels), and the whole layer but the
    # per-head parameter copies (tens of bytes per head, O(1) in s and b; not counted)
    assert planned[2 * BATCH] - planned[BATCH] == layer[2 * BATCH] - layer[BATCH]
    assert abs(planned[BATCH] - layer[BATCH]) <= 64 * one.model.num_attention_heads
