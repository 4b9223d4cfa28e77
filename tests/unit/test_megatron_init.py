"""Initialisation does not depend on the tensor-parallel size on a GPU either."""

import torch

from ascender_dist.config.layout import ModelLayout
from ascender_dist.config.resolve import config_from_dict


def test_weights_are_initialised_on_the_cpu_path_also_when_a_gpu_is_visible(monkeypatch):
    """megatron's GPU initialisation seeds each TP shard by (seed, tp_rank): a TP=2 model started from
    other weights than TP=1 on a GPU (the CPU path draws every weight whole, then keeps the shard)."""
    from ascender_dist.parallel.megatron_config import to_transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config_from_dict({"model": {"preset": "debug"}})
    layout = ModelLayout(tensor_parallel=2, pipeline_parallel=1, data_parallel=1, sequence_parallel=False,
                         activation_checkpointing=False, padded_vocab_size=128, vocab_size=128)
    assert to_transformer_config(cfg.model, layout, "bf16").use_cpu_initialization is True


def _layout(tp: int, padded: int, vocab: int = 300) -> ModelLayout:
    return ModelLayout(tensor_parallel=tp, pipeline_parallel=1, data_parallel=1, sequence_parallel=False,
                       activation_checkpointing=False, padded_vocab_size=padded, vocab_size=vocab)


def test_the_word_table_draws_the_tp1_tables_numbers_whatever_its_padded_size():
    """300 ids: 384 rows at TP=1, 512 at TP=2. The TP=2 table's real rows get the TP=1 table's numbers,
    the extra padding rows zeros, and the global stream is left where TP=1 leaves it (the layers
    drawn next start from the same weights)."""
    from ascender_dist.parallel.megatron_config import embedding_init

    model = config_from_dict({"model": {"preset": "debug"}}).model
    tables = {}
    for tp, padded in ((1, 384), (2, 512)):
        torch.manual_seed(7)
        table = torch.empty(padded, 16)
        embedding_init(model, _layout(tp, padded))(table)
        tables[tp] = (table, torch.randn(4))  # the stream after the table
    (one, after_one), (two, after_two) = tables[1], tables[2]
    assert torch.equal(two[:384], one) and not two[384:].any() and torch.equal(after_two, after_one)
    assert one.std() > 0.5 * model.init_method_std  # drawn, not zeros
    torch.manual_seed(7)
    reference = torch.nn.init.normal_(torch.empty(384, 16), mean=0.0, std=model.init_method_std)
    assert torch.equal(one, reference)  # at TP=1: megatron's own initialisation, unchanged


def test_a_position_table_is_drawn_whole():
    """Learned positions use the same init method: a table of another row count is megatron's; one of
    the word table's row count (seq_length = padded vocab) falls back to megatron's whole draw."""
    from ascender_dist.parallel.megatron_config import WordTableInit, embedding_init

    model = config_from_dict({"model": {"preset": "debug", "position_embedding_type": "learned_absolute"}}).model
    init = embedding_init(model, _layout(2, 512))
    assert isinstance(init, WordTableInit)
    positions = init(torch.zeros(model.seq_length, 16))
    assert positions.ne(0).all()
    same_rows = config_from_dict({"model": {"preset": "debug", "position_embedding_type": "learned_absolute",
                                            "seq_length": 512}}).model
    assert not isinstance(embedding_init(same_rows, _layout(2, 512)), WordTableInit)
