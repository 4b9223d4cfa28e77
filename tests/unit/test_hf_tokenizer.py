"""The exported fast tokenizer (tokenizer.json) encodes and decodes exactly as our sentencepiece model.

Reference: ``data_pipeline.tokenizer.Tokenizer`` (sentencepiece itself) on targeted strings (leading,
trailing and repeated spaces, indentation, tabs, newlines, digits, non-Latin text and characters
outside the vocabulary, which take the byte fallback, literal special-token text, the empty string)
and on 2,000 random strings over an alphabet of those, for BPE and Unigram models.
"""

import json
import random

import pytest

from data_pipeline.tokenizer import Tokenizer, train_tokenizer

from .data_fixtures import TEXT

CASES = [
    "", " ", "  ", "\n", "\n\n", " \n ", "def foo", " def foo", "  def  foo  ", "trailing   ",
    "def main():\n    return 1\n", "x = 1\n\n    return  y\n\tz\n", "\t\tif x:\n\t\t\tpass\n",
    "1234567890 3.14159 0x1F", "héllo wörld", "漢字 テスト ✓ 😀", "Ωμέγα кириллица العربية",
    "<s> </s> <pad> <unk> <0x41>", "a\u00a0b\u200bc\u0301", "\r\n\r\n", "▁already▁", "x" * 300,
    "a<|endoftext|>b", "<|endoftext|>", "x<|endoftext|><|endoftext|> y", "def f():\n        return 1\n",
]
# multi-character user-defined pieces (data-pipeline train-tokenizer --special-token): sentencepiece
# always emits them whole; the unigram export does too, a BPE export is refused (below)
USER_SYMBOLS = {"unigram": ["<|endoftext|>", "    "], "bpe": []}
ALPHABET = list(" \n\t  abcdefxyz_():=.,0123456789") + ["é", "漢", "😀", "▁", "\u0301", "<s>", "</s>", "\x00", "\r", "<|endoftext|>", "    "]


def _random_strings(n: int) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(n)]


@pytest.fixture(params=["bpe", "unigram"])
def sp_model(request, tmp_path):
    corpus = tmp_path / "corpus.txt"
    # as any real code corpus, the text has the characters of the special pieces (see test_unconvertible...)
    corpus.write_text(TEXT * 20 + "héllo wörld 漢字 テスト 1234567890\n" * 5 + "a</b> <0xABCDEF> <unk> <pad>\n" * 50,
                      encoding="utf-8")
    return train_tokenizer([corpus], tmp_path / request.param, 400, model_type=request.param, progress=False,
                           user_defined_symbols=USER_SYMBOLS[request.param])


def test_fast_tokenizer_gives_sentencepiece_ids_and_text(sp_model):
    from ascender_dist.tools.hf_tokenizer import fast_tokenizer

    ours = Tokenizer.load(sp_model)
    fast = fast_tokenizer(sp_model)
    assert fast.get_vocab_size() == ours.vocab_size
    byte_fallback_seen = False
    for text in CASES + _random_strings(2000):
        ids = ours.encode(text)
        assert fast.encode(text, add_special_tokens=False).ids == ids, repr(text)
        assert fast.decode(ids, skip_special_tokens=False) == ours.decode(ids), repr(text)
        byte_fallback_seen |= any(ours.sp.is_byte(i) for i in ids)
    assert byte_fallback_seen  # the strings really reach the byte pieces
    assert ours.encode("") == [] and ours.decode(ours.encode("  def  foo  ")) == "  def  foo  "


def test_written_files_load_with_auto_tokenizer(sp_model, tmp_path):
    from transformers import AutoTokenizer

    from ascender_dist.tools.hf_tokenizer import write_hf_tokenizer

    ours = Tokenizer.load(sp_model)
    out = tmp_path / "hf"
    special = write_hf_tokenizer(sp_model, out, model_max_length=64)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        assert (out / name).is_file(), name
    assert (special.pad_id, special.unk_id, special.bos_id, special.eos_id) == \
        (ours.pad_id, ours.unk_id, ours.bos_id, ours.eos_id) == (0, 1, 2, 3)
    assert json.loads((out / "special_tokens_map.json").read_text()) == \
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)
    for text in CASES + _random_strings(300):
        ids = ours.encode(text)
        assert tok(text)["input_ids"] == ids, repr(text)  # no BOS/EOS added, "</s>" in text is characters
        assert tok.decode(ids) == ours.decode(ids), repr(text)
    assert tok.decode([ours.eos_id], skip_special_tokens=True) == ""


def test_unconvertible_model_is_one_line(tmp_path):
    from ascender_dist.tools.convert import ConversionError
    from ascender_dist.tools.hf_tokenizer import fast_tokenizer

    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(ConversionError, match="bad.model: not a sentencepiece model"):
        fast_tokenizer(bad)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20, encoding="utf-8")
    char = train_tokenizer([corpus], tmp_path / "char", 400, model_type="char", progress=False)
    with pytest.raises(ConversionError, match="model type CHAR has no exact fast tokenizer"):
        fast_tokenizer(char)
    # a unigram model whose vocabulary lacks "<" (TEXT has none): "<s>" in text could match the control piece
    unigram = train_tokenizer([corpus], tmp_path / "uni", 400, model_type="unigram", progress=False)
    with pytest.raises(ConversionError, match="unigram model without the characters '[^']*<"):
        fast_tokenizer(unigram)


def test_normalising_models_are_refused_not_approximated(tmp_path):
    """nfkc / extra-whitespace removal: no exact conversion here (measured: hundreds of random strings
    differ), so the export refuses in one line instead of shipping a tokenizer with other ids."""
    import io

    import sentencepiece as spm

    from ascender_dist.tools.convert import ConversionError
    from ascender_dist.tools.hf_tokenizer import fast_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20, encoding="utf-8")
    for rule, collapse, message in (("nmt_nfkc", True, "normalization 'nmt_nfkc', remove_extra_whitespaces"),
                                    ("identity", True, "remove_extra_whitespaces")):
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(input=str(corpus), model_writer=buf, vocab_size=400, model_type="bpe",
                                       byte_fallback=True,
                                       normalization_rule_name=rule, remove_extra_whitespaces=collapse,
                                       minloglevel=2, hard_vocab_limit=False)
        model = tmp_path / f"{rule}.model"
        model.write_bytes(buf.getvalue())
        with pytest.raises(ConversionError, match=f"{model.name}: {message}: no exact fast tokenizer"):
            fast_tokenizer(model)


def test_bpe_with_multi_character_user_pieces_is_refused_not_spelled_out(tmp_path):
    """BPE merges never reach a multi-character user-defined piece: the fast tokenizer would spell
    '<|endoftext|>' out character by character where training used one id."""
    from ascender_dist.tools.convert import ConversionError
    from ascender_dist.tools.hf_tokenizer import fast_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20, encoding="utf-8")
    model = train_tokenizer([corpus], tmp_path / "bpe", 400, model_type="bpe", progress=False,
                            user_defined_symbols=["<|endoftext|>"])
    with pytest.raises(ConversionError) as info:
        fast_tokenizer(model)
    message = str(info.value)
    assert "bpe model with multi-character user-defined pieces ['<|endoftext|>']" in message and "\n" not in message


def test_slow_tokenizer_of_older_exports_gives_sentencepiece_ids(sp_model):
    """The slow tokenizer (remote-code exports written before tokenizer.json) encodes literal
    special-token text as text too: transformers would cut '</s>' out as the EOS id and encode
    the text around it as separate pieces."""
    from ascender_dist.hf.tokenization_ascender_dist import AscenderDistTokenizer

    ours = Tokenizer.load(sp_model)
    slow = AscenderDistTokenizer(str(sp_model))
    for text in CASES + ["a</s>b", "x <s> y", "<unk>", "a<pad>b"] + _random_strings(300):
        assert slow.encode(text, add_special_tokens=False) == ours.encode(text), repr(text)
