"""Model-level parity between a tensor-parallel layout and TP=1 with the same weights (run on ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ascender_dist.config.resolve import config_from_dict, derive
from ascender_dist.models.ascender.common import set_aux_loss_scale
from ascender_dist.parallel.consolidate import gather_full_state, gather_tp_tensor, load_full_state
from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel, init_process_group
from ascender_dist.training.trainer import aux_loss_gradient_scale

VOCAB = 256


def _tokens(cfg, vocab: int = VOCAB, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (batch, cfg.model.seq_length + 1), generator=gen)


def forward_backward(cfg, tp: int, full_state=None, vocab: int = VOCAB):
    """Build the model at TP=tp (DP fills the rest), run the training loss (models.build.lm_loss: the
    padding ids of the vocabulary masked on each rank's slice) + logits + backward; return full tensors."""
    from megatron.core import parallel_state as mps

    from ascender_dist.models.build import lm_loss
    from ascender_dist.training.engine import build_run_model

    destroy_model_parallel()
    cfg.parallel.tensor_model_parallel_size = tp
    derived = derive(cfg, dist.get_world_size(), vocab)
    init_model_parallel(tp, 1, cfg.train.seed)
    model = build_run_model(cfg, derived)
    set_aux_loss_scale(aux_loss_gradient_scale(1, tp))  # as the trainer does, for one micro-batch
    group = mps.get_tensor_model_parallel_group()
    if full_state is not None:
        load_full_state(model, full_state, tp, mps.get_tensor_model_parallel_rank())
    tokens = _tokens(cfg, vocab)
    inputs = tokens[:, :-1]
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    loss = lm_loss(model, tokens, vocab)
    loss.backward()
    with torch.no_grad():
        logits = model(inputs, position_ids, None)  # [b, s, vocab/tp]
    output_weight = model.output_layer.weight if model.output_layer.weight is not None else model.embedding.word_embeddings.weight
    full_logits = gather_tp_tensor(logits.transpose(0, 2), output_weight, group).transpose(0, 2)
    params = gather_full_state(model, group)
    local_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {
        "loss": loss.detach(),
        "logits": full_logits,
        "params": params,
        "grads": gather_full_state(model, group, grads=True),
        "trainable": {name for name, p in model.named_parameters() if p.requires_grad},
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        # parameters this rank holds only a shard of: > 0 proves the layout really is tensor parallel
        "num_sharded": sum(tuple(full.shape) != local_shapes[name] for name, full in params.items()),
    }


def tp_causality(raw_cfg: dict, positions: tuple[int, ...], tp: int = 2, vocab: int = VOCAB) -> dict:
    """No future leak at TP=tp (and sequence parallel if ``raw_cfg`` asks for it): for each t in
    ``positions``, every token after t changed. Returns per t the largest change of the gathered
    logits at positions <= t (0.0 when causal: bit-equal) and after t (> 0: the change is seen)."""
    from megatron.core import parallel_state as mps

    from ascender_dist.training.engine import build_run_model

    init_process_group()
    cfg = config_from_dict(raw_cfg)
    destroy_model_parallel()
    cfg.parallel.tensor_model_parallel_size = tp
    init_model_parallel(tp, 1, cfg.train.seed)
    model = build_run_model(cfg, derive(cfg, dist.get_world_size(), vocab))
    model.eval()
    group = mps.get_tensor_model_parallel_group()
    output_weight = model.output_layer.weight if model.output_layer.weight is not None else model.embedding.word_embeddings.weight

    def logits(tokens):  # [b, s, vocab], gathered over TP
        positions_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            local = model(tokens, positions_ids, None)  # [b, s, vocab/tp]
        return gather_tp_tensor(local.transpose(0, 2), output_weight, group).transpose(0, 2)

    tokens = _tokens(cfg, vocab)[:, :-1]
    base = logits(tokens)
    out = {}
    for t in positions:
        changed = tokens.clone()
        changed[:, t + 1:] = (tokens[:, t + 1:] + 1) % vocab  # every later token differs
        other = logits(changed)
        out[t] = {"prefix": (other[:, : t + 1] - base[:, : t + 1]).abs().max().item(),
                  "future": (other[:, t + 1:] - base[:, t + 1:]).abs().max().item()}
    return out


def _initial_state(cfg, tp: int, vocab: int = VOCAB) -> dict:
    """The full (gathered) initial weights of a model built at TP=tp from cfg's seed, the word
    embedding and output layer cut to the ``vocab`` real ids (their padding grows with TP)."""
    from megatron.core import parallel_state as mps

    from ascender_dist.training.engine import build_run_model

    destroy_model_parallel()
    cfg.parallel.tensor_model_parallel_size = tp
    init_model_parallel(tp, 1, cfg.train.seed)
    derived = derive(cfg, dist.get_world_size(), vocab)
    model = build_run_model(cfg, derived)
    state = gather_full_state(model, mps.get_tensor_model_parallel_group())
    for name, value in state.items():
        if value.dim() == 2 and value.shape[0] == derived.padded_vocab_size:  # [padded vocab, h]
            state[name] = value[:vocab]
    return state


def tp_init_parity(raw_cfg: dict, tp: int = 2, vocab: int = VOCAB) -> dict:
    """Largest difference of each initial weight between a model built at TP=tp and at TP=1 from
    the same seed (CPU initialisation draws every weight whole, then keeps the rank's shard), and
    the padded vocabulary sizes of the two."""
    init_process_group()
    cfg = config_from_dict(raw_cfg)
    sharded, single = _initial_state(cfg, tp, vocab), _initial_state(cfg, 1, vocab)
    if set(sharded) != set(single):
        raise AssertionError(f"parameters differ by name: {sorted(set(sharded) ^ set(single))}")
    diffs = {name: (sharded[name] - single[name]).abs().max().item() for name in single}
    padded = [derive(cfg, dist.get_world_size(), vocab).padded_vocab_size]  # cfg is at TP=1 now
    cfg.parallel.tensor_model_parallel_size = tp
    padded.insert(0, derive(cfg, dist.get_world_size(), vocab).padded_vocab_size)
    return {"num_params": len(diffs), "padded": padded,
            "differing": sorted(name for name, d in diffs.items() if not d == 0)}  # NaN too


def tp_parity(raw_cfg: dict, tp: int = 2, report: tuple[str, ...] = (), vocab: int = VOCAB) -> dict:
    """Max abs differences (loss, logits, every grad) between TP=tp and TP=1 runs with the same weights.

    ``report``: name suffixes whose gradients are also listed one by one under ``"reported"``
    (``{name: {"diff", "reference_abs", "shape"}}``), with this rank's own local gradient.
    ``vocab``: the tokenizer's size; one that the padded vocabulary exceeds puts padding ids in the
    last TP rank's slice, which the loss must mask there (and at TP=1 at the end)."""
    init_process_group()
    cfg = config_from_dict(raw_cfg)
    sharded = forward_backward(cfg, tp, vocab=vocab)
    reference = forward_backward(cfg, 1, full_state=sharded["params"], vocab=vocab)
    grad_diffs = {name: (sharded["grads"][name] - g).abs().max().item() for name, g in reference["grads"].items()}
    if tp > 1 and sharded["num_sharded"] == 0:
        raise AssertionError(f"TP={tp} run holds no sharded parameter: the layout silently ran unsharded")
    missing = set(reference["grads"]) ^ set(sharded["grads"])
    if missing:
        raise AssertionError(f"gradients present in only one layout: {sorted(missing)}")
    # a parameter detached in both layouts would be missing from both: every trainable one must have a gradient
    no_grad = reference["trainable"] - set(reference["grads"])
    if no_grad:
        raise AssertionError(f"trainable parameters without a gradient: {sorted(no_grad)}")
    return {
        "loss": (sharded["loss"] - reference["loss"]).abs().item(),
        "logits": (sharded["logits"] - reference["logits"]).abs().max().item(),
        "max_grad": max(grad_diffs.values()),
        "worst_grad": max(grad_diffs, key=grad_diffs.get),
        "num_params": len(grad_diffs),
        "num_sharded": sharded["num_sharded"],
        "param_dtypes": sorted(set(sharded["param_dtypes"]) | set(reference["param_dtypes"])),
        # gradients that are exactly zero everywhere in the TP=1 run (a detached path gives zeros too)
        "zero_grads": sorted(name for name, g in reference["grads"].items() if not bool(g.abs().max() > 0)),
        "reported": {name: {"diff": grad_diffs[name], "reference_abs": reference["grads"][name].abs().max().item(),
                            "shape": list(sharded["grads"][name].shape)}
                     for name in grad_diffs if name.endswith(report) and report},
        # every gradient: [max abs difference, max abs of the TP=1 gradient], for a per-tensor relative check
        "grads": {name: [diff, reference["grads"][name].abs().max().item()] for name, diff in grad_diffs.items()},
    }
