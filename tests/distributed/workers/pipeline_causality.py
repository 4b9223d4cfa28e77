"""Checks run on 2 ranks: no future leak through DeepSpeed's pipeline engine at PP=2.

Each model is built as the trainer builds it under ``pipeline_model_parallel_size: 2``
(``init_model_parallel`` then ``training.engine.build_engine``: a PipelineModule in DeepSpeed's
PipelineEngine, one transformer layer per stage) and run by ``eval_batch(return_logits=True)``:
the embedding and layer 1 on rank 0, layer 2, the final norm and the head on rank 1, activations
sent between them by the engine. The last stage compares the logits of a batch with those of
the same batch with every token after t changed; the result is shared with every rank.

Weights are the seeded initial ones (no training), dropout is 0 and the engine runs in eval mode:
a causal model gives bit-equal logits at positions <= t.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.causality import make_bidirectional, token_pair
from tests.helpers.multiproc import run_checks

VOCAB = 300
SEQ = 24
BATCH = 2
BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": SEQ,
        "hidden_dropout": 0.0, "attention_dropout": 0.0}
# as tests/unit/test_model_causality: omega != 0 so the ASCender biases act; window / globals / alibi
# so every mask path is used; chunks of 8 (Connection's causal chunks too)
ASC = {"d_z": 8, "d_a": 8, "k": 3, "window": 6, "num_global": 1, "chunk_size": 8, "omega_init": 0.5,
       "other_bias": "alibi"}
CONN = {"num_slots": 4, "rank": 4, "max_steps": 2, "causal_chunk_size": 8, "threshold": 0.0}
MODELS = {
    "gpt": {},  # A | A
    "ascender": {"architecture": "ascender", "ascender": ASC},  # S | S
    "connection": {"architecture": "connection", "connection": CONN},  # A | C (pattern AC)
    "mixed_sc": {"architecture": "connection", "layer_pattern": "SC", "ascender": ASC, "connection": CONN},  # S | C
}
# inside the first chunk of 8, its last position, inside the second chunk, on the boundary of the
# second and third (with MOMENT_STRIDE a moment state at 16: one holding a key after 16 would leak)
POSITIONS = (5, 7, 13, 16)
# ASCender's fused path keeps causal moment states every MOMENT_STRIDE rows (256: none inside SEQ);
# every 8 puts states at 8 and 16, as the unit tests do
MOMENT_STRIDE = 8
# negative controls, run on the positive checks' engines afterwards: (model, pipeline stage whose
# custom layers are made bidirectional). Stage 0's leak must cross the stage boundary to be seen.
CONTROLS = {"ascender_first_stage": ("ascender", 0), "connection_last_stage": ("connection", 1)}


def main(args):
    from ascender_dist.models.ascender import fast_moments

    fast_moments.MOMENT_STRIDE = MOMENT_STRIDE
    engines: dict = {}

    def engine_for(name: str):
        if name not in engines:
            engines[name] = _build_engine(MODELS[name])
        return engines[name]

    return run_checks({
        **{f"pp2_{name}": (lambda name=name: pipeline_causality(engine_for(name), POSITIONS)) for name in MODELS},
        **{f"pp2_bidirectional_{control}": (lambda name=name, stage=stage: pipeline_causality(
            engine_for(name), POSITIONS, bidirectional_stage=stage)) for control, (name, stage) in CONTROLS.items()},
    })


def _build_engine(model: dict):
    """The PP=2 engine of ``model`` as the trainer builds it (run.build_run: process groups, then
    training.engine.build_engine; same seed and default ZeRO stage)."""
    from ascender_dist.config.resolve import config_from_dict, derive
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group
    from ascender_dist.training.engine import build_engine

    init_process_group()
    cfg = config_from_dict({"model": {**BASE, **model}, "parallel": {"pipeline_model_parallel_size": 2},
                            "train": {"micro_batch_size": BATCH, "global_batch_size": BATCH, "seed": 5}})
    derived = derive(cfg, dist.get_world_size(), VOCAB)
    p = cfg.parallel
    init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, cfg.train.seed)
    return build_engine(cfg, derived)


def _logits(engine, tokens: torch.Tensor):
    """The pipeline's logits [s, b, v] of ``tokens[:, :-1]`` on the last stage (None elsewhere)."""
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())  # as training.engine.pipeline_batches
    _, logits = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
    return logits.detach().clone() if engine.is_last_stage() else None


def _layers(engine) -> list[list]:
    """This stage's transformer layers as [global layer number, kind letter] (A, S or C)."""
    from ascender_dist.models.pipeline import TransformerLayerPipe
    from ascender_dist.models.specs.ascender import AscenderCoreAttention
    from ascender_dist.models.specs.connection import ConnectionSelfAttention

    layers = []
    for module in engine.module.modules():
        if isinstance(module, TransformerLayerPipe):
            kinds = {type(m) for m in module.modules()}
            kind = "S" if AscenderCoreAttention in kinds else "C" if ConnectionSelfAttention in kinds else "A"
            layers.append([module.layer.layer_number, kind])
    return layers


def pipeline_causality(engine, positions: tuple[int, ...], bidirectional_stage: int | None = None) -> dict:
    """For each t in ``positions``: the logits of a batch and of the same batch with every token
    after t changed, through the pipeline engine. Returns, the same on every rank:

    - ``stages``: the engine's pipeline stages; ``layers``: per rank, its [layer number, kind];
    - ``swapped``: per rank, custom layers made bidirectional (only with ``bidirectional_stage``);
    - ``by_position``: per t, ``prefix_equal`` (torch.equal of positions <= t), ``prefix`` and
      ``future`` (largest change at <= t and after t), ``shape`` of the logits.
    """
    stage = engine.stage_id
    swapped = make_bidirectional(engine.module) if stage == bidirectional_stage else 0
    by_position = {}
    for t in positions:
        tokens, changed = token_pair(t, VOCAB, SEQ + 1, BATCH)
        a, b = _logits(engine, tokens), _logits(engine, changed)
        if a is not None:  # the last stage: logits [s, b, v]
            by_position[t] = {"prefix_equal": torch.equal(a[: t + 1], b[: t + 1]),
                              "prefix": (a[: t + 1] - b[: t + 1]).abs().max().item(),
                              "future": (a[t + 1:] - b[t + 1:]).abs().max().item(),
                              "shape": list(a.shape)}
    mine = {"rank": dist.get_rank(), "stage": stage, "layers": _layers(engine), "swapped": swapped,
            "by_position": by_position if engine.is_last_stage() else None}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    last = [r for r in everyone if r["by_position"] is not None]
    if len(last) != 1:
        raise AssertionError(f"expected one last pipeline stage, got {[r['rank'] for r in last]}")
    return {"stages": engine.num_stages, "stage_of_rank": [r["stage"] for r in everyone],
            "layers": [r["layers"] for r in everyone], "swapped": [r["swapped"] for r in everyone],
            "by_position": last[0]["by_position"]}
