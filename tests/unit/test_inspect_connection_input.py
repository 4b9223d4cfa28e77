"""inspect-connection's input tokens: an input that gives none, or a --max-tokens below 1, is one line
naming the flag before any file is read (it was a torch dtype traceback from inside the model's
embedding, and a negative --max-tokens sliced from the end)."""

import types

import pytest

from ascender_dist.tools.convert import ConversionError
from ascender_dist.tools.inspect_connection import _tokens, inspect_connection

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401


def _cfg(tokenizer):
    return types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=str(tokenizer.model_path), manifest=None))


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
