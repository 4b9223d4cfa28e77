"""Slow Hugging Face tokenizer over the project's sentencepiece model (``tokenizer.model``).

Exports load the fast ``tokenizer.json`` (:mod:`ascender_dist.tools.hf_tokenizer`) with
``AutoTokenizer``; this class is still copied into remote-code exports and wraps the
``tokenizer.model`` of exports written before that (lm_eval_adapter.load_tokenizer). It encodes
exactly as training did (``data_pipeline.tokenizer.Tokenizer.encode``: the raw
sentencepiece ids, no BOS/EOS added; byte fallback, so decode(encode(s)) == s). Needs only
``sentencepiece`` and ``transformers``.
"""

from __future__ import annotations

import os
import shutil

import sentencepiece as spm
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tokenizer.model"}


class AscenderDistTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        self.sp = spm.SentencePieceProcessor(model_file=str(vocab_file))
        piece = lambda i: self.sp.id_to_piece(i) if i >= 0 else None  # noqa: E731
        for name, index in (("unk_token", self.sp.unk_id()), ("bos_token", self.sp.bos_id()),
                            ("eos_token", self.sp.eos_id()), ("pad_token", self.sp.pad_id())):
            if piece(index) is not None:
                kwargs.setdefault(name, piece(index))
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("add_prefix_space", False)
        # literal "<s>", "</s>", "<pad>", "<unk>" in text are text, as in training (sentencepiece
        # spells them out); transformers would otherwise cut them out as special ids and encode
        # the pieces around them separately, each with its own dummy prefix
        kwargs.setdefault("split_special_tokens", True)
        # as the fast tokenizer an export writes: the model's generate() needs left padding
        kwargs.setdefault("padding_side", "left")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp.id_to_piece(int(index))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp.decode_pieces(list(tokens))

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        """The sentencepiece decode of the ids (byte pieces merged back into UTF-8 exactly)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        special = set(self.all_special_ids) if skip_special_tokens else set()
        ids = [int(i) for i in token_ids if 0 <= int(i) < self.vocab_size and int(i) not in special]
        return self.sp.decode(ids)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return list(token_ids_0) + (list(token_ids_1) if token_ids_1 else [])

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
