"""checkpoint.init_from weights that do not fit the model: one line naming the field, never a
silently dropped tensor (a file of a deeper model, or with an untied head, into this one)."""

import pytest
import torch

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.resolve import config_from_dict, derive
from tests.helpers.errors import one_line
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "seq_length": 16}
VOCAB = 64
SOURCE = "/data/init.safetensors"


@pytest.fixture()
def model_and_state(single_rank_group):
    from ascender_dist.parallel.setup import destroy_model_parallel, init_model_parallel
    from ascender_dist.training.engine import build_run_model

    cfg = config_from_dict({"model": MODEL})
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=3)
    model = build_run_model(cfg, derive(cfg, 1, VOCAB))
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return cfg, model, state


def _load(cfg, model, state):
    from ascender_dist.training.weights import check_all_weights_used, load_canonical_state

    used = load_canonical_state(model, cfg, state, source=SOURCE, field="checkpoint.init_from")
    check_all_weights_used(state, used, source=SOURCE, field="checkpoint.init_from")


def test_a_fitting_file_loads_every_tensor(model_and_state):
    cfg, model, state = model_and_state
    state = {k: torch.randn_like(v) for k, v in state.items()}
    _load(cfg, model, state)
    assert all(torch.equal(p, state[name]) for name, p in model.named_parameters())


def test_tensors_of_a_deeper_model_are_refused_not_dropped(model_and_state):
    cfg, model, state = model_and_state
    extra = {k.replace("layers.1.", "layers.2."): v for k, v in state.items() if "layers.1." in k}
    with pytest.raises(ConfigError) as info:
        _load(cfg, model, {**state, **extra, "output_layer.weight": state["embedding.word_embeddings.weight"]})
    one_line(info.value, "checkpoint.init_from", SOURCE, "tensors this model has no place for",
             "decoder.layers.2.")


@pytest.mark.parametrize("problem", ["missing", "shape"])
def test_a_missing_or_misshapen_tensor_is_one_line(model_and_state, problem):
    cfg, model, state = model_and_state
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    if problem == "missing":
        state.pop(name)
        needle = f"no tensor {name}"
    else:
        state[name] = torch.zeros(3, 3)
        needle = f"{name} has shape (3, 3)"
    with pytest.raises(ConfigError) as info:
        _load(cfg, model, state)
    one_line(info.value, "checkpoint.init_from", SOURCE, needle)


@pytest.mark.parametrize("shape", [(8,), (8, 1), (8, 9), (8, 4)])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_misshapen_tensor_is_one_line_on_every_tensor_parallel_rank(monkeypatch, shape, tp_rank):
    """At TP > 1 the whole tensor is checked before it is split: a tensor of another rank raised a
    raw IndexError inside torch.chunk, and an uneven split could fit on one rank and not another."""
    from megatron.core import parallel_state as mps
    from torch import nn

    from ascender_dist.training.weights import rank_shards

    monkeypatch.setattr(mps, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(mps, "get_tensor_model_parallel_rank", lambda: tp_rank)
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(8, 4))  # this rank's half of a row-parallel (8, 8) weight
    module.w.tensor_model_parallel, module.w.partition_dim, module.w.partition_stride = True, 1, 1
    cfg = config_from_dict({})
    with pytest.raises(ConfigError) as info:
        rank_shards(module, cfg, {"w": torch.zeros(shape)}, source=SOURCE, field="checkpoint.init_from")
    one_line(info.value, "checkpoint.init_from", SOURCE, f"w has shape {shape}, which does not fit this model "
                                                         "((8, 8), (8, 4) per TP rank)")
    assert rank_shards(module, cfg, {"w": torch.arange(64.0).view(8, 8)}, source=SOURCE)[0][2].equal(
        torch.arange(64.0).view(8, 8)[:, 4 * tp_rank:4 * tp_rank + 4])


@pytest.mark.parametrize("key", ["embedding.word_embeddings.weight", "output_layer.weight"])
def test_fewer_vocabulary_rows_than_the_runs_token_ids_are_refused(key):
    """Weights of a 400-id tokenizer into a run of 500 ids: both pad to 512, so the shapes fit after
    padding, and ids 400-499 (real tokens here) started as zero rows without a word (found by a review)."""
    from ascender_dist.training.weights import pad_vocab

    state = {key: torch.randn(400, 8), "decoder.final_layernorm.weight": torch.ones(8)}
    with pytest.raises(ConfigError) as info:
        pad_vocab(state, 500, 512, f"checkpoint.init_from ({SOURCE})")
    one_line(info.value, "checkpoint.init_from", SOURCE, f"{key} has 400 rows", "500 token ids", "ids 400-499")
    padded = pad_vocab(state, 400, 512)  # the run's own vocabulary: padding rows only, zero
    assert padded[key].shape == (512, 8) and torch.equal(padded[key][:400], state[key])
    assert not padded[key][400:].any()
    assert pad_vocab({key: torch.randn(512, 8)}, 500, 512)[key].shape == (512, 8)  # already padded: as is


def test_a_run_refuses_init_from_weights_of_a_smaller_vocabulary(single_rank_group, tmp_path):
    """The same through build_run: the run's own ids come from its tokenizer; the file is named."""
    from ascender_dist.training.run import build_run
    from ascender_dist.training.weights import write_weights_file
    from tests.helpers.data import make_tiny_dataset, tiny_run_config

    data = make_tiny_dataset(tmp_path / "data", corpus_bytes=60_000)
    weights = tmp_path / "small_vocab.safetensors"
    write_weights_file({"embedding.word_embeddings.weight": torch.randn(10, 32)}, weights)
    cfg = config_from_dict(tiny_run_config(data, tmp_path / "run", checkpoint={"init_from": str(weights)}))
    with pytest.raises(ConfigError) as info:
        build_run(cfg)
    one_line(info.value, f"checkpoint.init_from ({weights})", "has 10 rows", "ids 10-")
