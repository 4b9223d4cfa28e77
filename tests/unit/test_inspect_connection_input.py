"""inspect-connection's input tokens: an input that gives none, or a --max-tokens below 1, is one line
naming the flag before any file is read (it was a torch dtype traceback from inside the model's
embedding, and a negative --max-tokens sliced from the end)."""

import types

import pytest

from ascender_dist.tools.convert import ConversionError
from ascender_dist.tools.inspect_connection import _tokens, inspect_connection

from .data_fixtures import SEQ, make_dataset, text_file, tiny_tokenizer  # noqa: F401


def _cfg(tokenizer, seq_length: int = 64, **data):
    data = {"tokenizer": str(tokenizer.model_path) if tokenizer else None, "manifest": None, "mixture": [],
            "url_template": None, **data}
    return types.SimpleNamespace(data=types.SimpleNamespace(**data), model=types.SimpleNamespace(seq_length=seq_length),
                                 train=types.SimpleNamespace(seed=1))


@pytest.mark.parametrize("text,max_tokens,expected", [
    ("", 64, "--text: is empty: no tokens to inspect"),
    ("  \n", 64, "--text: is empty: no tokens to inspect"),
    ("def f(): pass", 0, "--max-tokens: must be >= 1 (got 0)"),
    (None, -1, "--max-tokens: must be >= 1 (got -1)"),
], ids=["empty-text", "blank-text", "max-tokens-0", "max-tokens-negative"])
def test_bad_input_arguments_are_refused_before_anything_is_read(tmp_path, text, max_tokens, expected):
    with pytest.raises(ConversionError) as info:
        inspect_connection(tmp_path / "not-there", tmp_path / "out", text, max_tokens)  # the directory is never read
    assert str(info.value) == expected


def test_a_text_gives_its_first_max_tokens(tiny_tokenizer):
    ids, labels = _tokens(_cfg(tiny_tokenizer), {}, "def f(): return 1", 3)
    assert ids.shape == (1, 3) and len(labels) == 3


def test_tokens_stop_at_the_models_positions(tiny_tokenizer, tmp_path):
    """Learned positions end at model.seq_length: a longer --max-tokens raised an IndexError inside
    the embedding (and a validation window holds seq_length + 1 ids)."""
    ids, labels = _tokens(_cfg(tiny_tokenizer, seq_length=4), {}, "def f(): return 1 + 2 + 3 + 4", 200)
    assert ids.shape == (1, 4) and len(labels) == 4
    make_dataset(tmp_path / "ds", [4], val_counts=[4])
    ids, _ = _tokens(_cfg(None, seq_length=SEQ, manifest=str(tmp_path / "ds")), {}, None, 200)
    assert ids.shape == (1, SEQ)


def test_a_mixture_runs_validation_sample_is_read_from_its_mixture(tmp_path):
    """The tool read data.manifest only, and stopped on a mixture run with advice to use the mixture."""
    make_dataset(tmp_path / "a", [4], val_counts=[4])
    make_dataset(tmp_path / "b", [4], val_counts=[4], first_id=1000)
    mixture = [types.SimpleNamespace(manifest=str(tmp_path / name), weight=1.0, url_template=None) for name in "ab"]
    ids, _ = _tokens(_cfg(None, seq_length=SEQ, mixture=mixture), {}, None, 5)
    assert ids.shape == (1, 5)


def test_a_text_is_refused_with_another_tokenizer_than_the_weights_were_trained_with(tiny_tokenizer, tmp_path):
    meta = {"tokenizer_sha256": "0" * 64}  # what meta.json records
    with pytest.raises(ConversionError) as info:
        _tokens(_cfg(tiny_tokenizer), meta, "def f(): return 1", 3, tmp_path / "meta.json")
    message = str(info.value)
    assert message.startswith(str(tiny_tokenizer.model_path)) and "is not the tokenizer the weights were" in message
    ids, _ = _tokens(_cfg(tiny_tokenizer), {"tokenizer_sha256": tiny_tokenizer.sha256}, "def f(): return 1", 3)
    assert ids.shape == (1, 3)


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4)], ids=["per-sample", "per-slot"])
def test_the_first_causal_chunk_is_reported_apart_from_the_input_steps(shape):
    import torch

    from ascender_dist.models.connection.layer import ReasoningStats
    from ascender_dist.tools.inspect_connection import _input_steps

    hp = types.SimpleNamespace(causal=True, causal_chunk_size=8)
    steps = torch.ones(shape, dtype=torch.int32)
    steps[:, 0] = 3  # the bare slots' state: input-independent
    steps[1, 2] = 2
    out = _input_steps(ReasoningStats(steps, 1, causal=True), hp)
    assert out["steps_first_chunk"] == 3.0 and out["steps_max"] == 2.0
    assert out["steps_mean"] == pytest.approx(1.25) and out["steps_per_chunk"] == pytest.approx([3.0, 1.0, 1.5])
    one = _input_steps(ReasoningStats(steps[:, :1], 1, causal=True), hp)
    assert one["steps_mean"] is None and one["steps_max"] is None and one["steps_first_chunk"] == 3.0
    full = _input_steps(ReasoningStats(steps[:, 0], 1), types.SimpleNamespace(causal=False))
    assert full == {"steps_mean": 3.0, "steps_max": 3.0}


def test_out_is_checked_before_the_model_is_built(tmp_path):
    """--out naming a file failed with a traceback after the model had run; --out inside the
    consolidated directory wrote heatmaps among the files the other tools check and replace."""
    from ascender_dist.tools.inspect_connection import make_out_dir

    consolidated = tmp_path / "cons"
    consolidated.mkdir()
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConversionError) as info:
        make_out_dir(tmp_path / "afile", consolidated)
    assert str(info.value).startswith(str(tmp_path / "afile")) and "cannot create the output directory" in str(info.value)
    for inside in (consolidated, consolidated / "figs"):
        with pytest.raises(ConversionError) as info:
            make_out_dir(inside, consolidated)
        assert "is the consolidated directory" in str(info.value) and "\n" not in str(info.value)
    make_out_dir(tmp_path / "new" / "out", consolidated)
    assert (tmp_path / "new" / "out").is_dir()
