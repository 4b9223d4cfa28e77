"""inspect-connection's input tokens: an input that gives none is one line naming the flag (it was a
torch dtype traceback from inside the model's embedding)."""

import types

import pytest

from ascender_dist.tools.convert import ConversionError
from ascender_dist.tools.inspect_connection import _tokens

from .data_fixtures import text_file, tiny_tokenizer  # noqa: F401


def _cfg(tokenizer):
    return types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=str(tokenizer.model_path), manifest=None))


@pytest.mark.parametrize("text,max_tokens", [("", 64), ("def f(): pass", 0)], ids=["empty-text", "max-tokens-0"])
def test_an_input_without_tokens_is_one_line(tiny_tokenizer, text, max_tokens):
    with pytest.raises(ConversionError) as info:
        _tokens(_cfg(tiny_tokenizer), {}, text, max_tokens)
    assert str(info.value) == f"--text: gives no tokens to inspect (text {text!r}, max_tokens {max_tokens})"


def test_a_text_gives_its_first_max_tokens(tiny_tokenizer):
    ids, labels = _tokens(_cfg(tiny_tokenizer), {}, "def f(): return 1", 3)
    assert ids.shape == (1, 3) and len(labels) == 3
