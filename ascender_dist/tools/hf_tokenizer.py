"""Our sentencepiece model -> a Hugging Face fast tokenizer (``tokenizer.json``) that encodes and
decodes exactly as ``data_pipeline.tokenizer.Tokenizer`` (raw sentencepiece ids, no BOS/EOS).

Every export ships it (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
plus the original ``tokenizer.model``), so ``AutoTokenizer.from_pretrained(export)`` and lm-eval see
the ids the model was trained on. The converter reads the sentencepiece model's own settings rather
than assuming Llama's, because ours differ (identity normalisation, no whitespace collapsing,
whitespace-only pieces, ``"\\n"`` as a user-defined piece, byte fallback):

* model: BPE with merges ranked by the merged piece's score (sentencepiece merges the adjacent pair
  whose result scores highest; only normal pieces merge), or Unigram with the piece scores (control,
  byte, unknown and unused pieces scored out of reach, so literal text such as ``"<s>"`` or
  ``"<0x41>"`` is spelled out as sentencepiece does; a unigram model lacking one of their
  characters is refused, see :func:`_unigram_model`); byte fallback as configured;
* normaliser: the dummy ``" "`` prefix (not on the empty string), spaces -> ``"▁"``; a model with a
  normalisation rule other than identity or with extra-whitespace removal is refused (no exact
  conversion; ours never has them);
* pre-tokeniser: user-defined pieces isolated (sentencepiece emits them whole, never merged);
  no other split (sentencepiece segments the whole normalised text);
* decoder: ``"▁"`` -> space, byte pieces -> UTF-8, one leading space removed (the dummy prefix);
* the special pieces (bos/eos/pad/unk) are the model's, by id, and ``split_special_tokens`` is on:
  sentencepiece encodes ``"</s>"`` in text as characters, and so does the export.

``tests/unit/test_hf_tokenizer.py`` compares ids and decoded text with sentencepiece on targeted
strings and thousands of random ones, for BPE and Unigram models.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ascender_dist.tools.convert import ConversionError

# sentencepiece ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
OUT_OF_REACH = -1e9  # Unigram score of pieces sentencepiece never matches in text


@dataclass(frozen=True)
class SpecialTokens:
    """The sentencepiece model's special pieces and ids (None where the model has none)."""

    bos: Optional[str]
    eos: Optional[str]
    pad: Optional[str]
    unk: Optional[str]
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: Optional[int]
    unk_id: Optional[int]

    def config_ids(self) -> dict:
        """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for a Hugging Face model config."""
        return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id}

    def token_map(self) -> dict:
        """``special_tokens_map.json``: only the tokens the model has."""
        names = {"bos_token": self.bos, "eos_token": self.eos, "pad_token": self.pad, "unk_token": self.unk}
        return {k: v for k, v in names.items() if v is not None}


def load_proto(model_file: Path):
    """The parsed sentencepiece ModelProto of ``model_file``."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(model_file).read_bytes())
    except Exception as exc:  # protobuf raises its own DecodeError
        raise ConversionError(model_file, f"not a sentencepiece model ({' '.join(str(exc).split())})") from None
    if not proto.pieces:
        raise ConversionError(model_file, "not a sentencepiece model (no pieces)")
    return proto


def special_tokens(proto) -> SpecialTokens:
    t = proto.trainer_spec
    pieces = proto.pieces

    def piece(index: int) -> Optional[str]:
        return pieces[index].piece if 0 <= index < len(pieces) else None

    def idx(index: int) -> Optional[int]:
        return index if 0 <= index < len(pieces) else None

    return SpecialTokens(bos=piece(t.bos_id), eos=piece(t.eos_id), pad=piece(t.pad_id), unk=piece(t.unk_id),
                         bos_id=idx(t.bos_id), eos_id=idx(t.eos_id), pad_id=idx(t.pad_id), unk_id=idx(t.unk_id))


def _bpe_model(proto):
    from tokenizers.models import BPE

    pieces = proto.pieces
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == NORMAL}
    ranked = []  # (-score of the merged piece, its id, left, right): best merge first
    for piece, (score, index) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, index, left, right))
    merges = [(left, right) for _, _, left, right in sorted(ranked)]
    unk = pieces[proto.trainer_spec.unk_id].piece
    return BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=proto.trainer_spec.byte_fallback)


def _check_bpe_user_pieces(proto, model_file: Path) -> None:
    """Refuse multi-character user-defined pieces in a BPE model. sentencepiece emits them whole;
    BPE merges over normal pieces never reach them (their characters come out one by one), and
    the tokenizers library has no exact alternative: ``ignore_merges`` also emits control and
    byte pieces (``<s>``, ``<0x41>``) for text segments spelling them, and added tokens either
    see sentencepiece's dummy prefix in their own text or put it after them."""
    long = [p.piece for p in proto.pieces if p.type == USER_DEFINED and len(p.piece) > 1]
    if long:
        raise ConversionError(model_file, f"bpe model with multi-character user-defined pieces {long[:3]!r}: no exact "
                                          "fast tokenizer (train it as unigram, or with single-character ones)")


def _unigram_model(proto, model_file: Path):
    """Unigram over the piece scores. Pieces sentencepiece never matches in text (control, byte,
    unknown, unused) get a score no segmentation picks while their characters are normal pieces
    (spelling them out always scores higher); a model where one is not is refused, because the
    tokenizers library scores unknown characters below its lowest piece and would pick them."""
    from tokenizers.models import Unigram

    normal = {p.piece for p in proto.pieces if p.type == NORMAL}
    hidden = [p.piece for p in proto.pieces if p.type not in (NORMAL, USER_DEFINED)]
    missing = sorted({c for piece in hidden for c in piece if c not in normal})
    if missing:
        raise ConversionError(model_file, f"unigram model without the characters {''.join(missing)!r} of its "
                                          "special pieces: no exact fast tokenizer (train it with them, or use bpe)")
    vocab = [(p.piece, p.score if p.type in (NORMAL, USER_DEFINED) else OUT_OF_REACH) for p in proto.pieces]
    return Unigram(vocab, proto.trainer_spec.unk_id, proto.trainer_spec.byte_fallback)


def fast_tokenizer(model_file: Path):
    """A ``tokenizers.Tokenizer`` that encodes / decodes as the sentencepiece model ``model_file``."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    proto = load_proto(model_file)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    unsupported = [name for name, on in (("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix),
                                         (f"normalization {spec.name!r}", bool(spec.precompiled_charsmap)),
                                         ("remove_extra_whitespaces", spec.remove_extra_whitespaces)) if on]
    if unsupported:  # measured: 5 to 40 % of random strings differ from sentencepiece with these
        raise ConversionError(model_file, f"{', '.join(unsupported)}: no exact fast tokenizer (data-pipeline "
                                          "train-tokenizer uses identity normalisation and keeps every space)")
    kinds = sentencepiece_model_pb2.TrainerSpec
    if trainer.model_type == kinds.BPE:
        _check_bpe_user_pieces(proto, model_file)
        model = _bpe_model(proto)
    elif trainer.model_type == kinds.UNIGRAM:
        model = _unigram_model(proto, model_file)
    else:
        name = kinds.ModelType.Name(trainer.model_type)
        raise ConversionError(model_file, f"sentencepiece model type {name} has no exact fast tokenizer here "
                                          "(bpe and unigram do)")
    tok = Tokenizer(model)
    steps = []
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))  # leaves the empty string empty, as sentencepiece
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    user = [p.piece for p in proto.pieces if p.type == USER_DEFINED]
    if user:
        pattern = "|".join(re.escape(u) for u in sorted(user, key=len, reverse=True))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    steps = [decoders.Replace("▁", " ")]
    if trainer.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _save_pretrained(hf, out: Path) -> None:
    """``hf.save_pretrained(out)`` with every write failure an OSError: the ``tokenizers`` library
    raises a bare ``Exception("No space left on device (os error 28)")`` for its I/O errors, which
    ``staged_output`` (it turns OSError into one line and removes the partial output) would let
    through as a traceback. An OSError is re-raised as it is."""
    try:
        hf.save_pretrained(str(out))
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001  (the library's Rust errors have no type of their own)
        raise OSError(" ".join(str(exc).split()) or type(exc).__name__) from exc


def write_hf_tokenizer(model_file: Path, out: Path, model_max_length: int, fast=None) -> SpecialTokens:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and a copy of
    ``tokenizer.model`` into ``out``; returns the special tokens (their ids go into config.json).
    ``fast``: :func:`fast_tokenizer` of ``model_file`` when the caller already built it."""
    from transformers import PreTrainedTokenizerFast

    model_file, out = Path(model_file), Path(out)
    special = special_tokens(load_proto(model_file))
    # left padding: a batch then generates (new tokens follow every row's last real token)
    hf = PreTrainedTokenizerFast(tokenizer_object=fast or fast_tokenizer(model_file), model_max_length=model_max_length,
                                 clean_up_tokenization_spaces=False, split_special_tokens=True, padding_side="left",
                                 **special.token_map())
    _save_pretrained(hf, out)
    config_file = out / "tokenizer_config.json"
    data = json.loads(config_file.read_text()) if config_file.is_file() else {}
    data.update(tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True,
                clean_up_tokenization_spaces=False, add_bos_token=False, add_eos_token=False, padding_side="left",
                model_max_length=model_max_length, **special.token_map())
    data.pop("auto_map", None)
    config_file.write_text(json.dumps(data, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special.token_map(), indent=2))
    if (out / "tokenizer.model").resolve() != model_file.resolve():
        shutil.copyfile(model_file, out / "tokenizer.model")
    return special
