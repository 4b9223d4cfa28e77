"""SentencePiece tokenizer training and loading, with vocabulary padding for tensor parallelism.

Why the choices below:

* ``byte_fallback`` + identity normalisation + whitespace-only pieces: the default corpus is
  source code; every byte sequence must encode and ``decode(encode(s)) == s`` must hold exactly
  (indentation, tabs, newlines and non-ASCII included), so nothing is ever mapped to ``<unk>``.
* ``"\\n"`` is a user-defined symbol: sentencepiece trains on lines and would otherwise never
  learn a newline piece (it would fall back to the byte ``<0x0A>``).
* Fixed special ids ``pad=0, unk=1, bos=2, eos=3`` so every model trained here agrees.
* A tensor-parallel embedding needs a vocabulary divisible by ``tp * 128``-ish; the padded size
  is recorded next to the model (``out_prefix.json``) and padding rows are never produced by
  :meth:`Tokenizer.encode` (strip them again when exporting weights).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import sentencepiece as spm
from tqdm import tqdm

from ._io import atomic_write_bytes, atomic_write_json, check_writable, refuse_existing, sha256_bytes, sha256_file
from .errors import DataError

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
DEFAULT_INPUT_SENTENCE_SIZE = 2_000_000
_MAX_LINE_BYTES = 16384  # sentencepiece silently drops longer "sentences"; we split instead

# texts cut after each newline by Tokenizer.parts_split_exactly: whitespace, indents and symbols
# on both sides of a newline, where a normaliser that does not keep newlines merges across them
NEWLINE_PROBES = ("a\nb", "x = 1 \n  y = 2\n", "\n\n  #\n#x\t\n\tz", " a\n \n b \n", "é\n\u00a0é\n1\n2")


def check_pad_multiple(where: str, multiple) -> None:
    """A padding multiple is an integer >= 1 (1: no padding); anything else is a DataError naming
    the field, so a typo never silently means "unpadded" (which breaks tensor-parallel embeddings)."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise DataError(where, f"pad_vocab_to_multiple_of: must be an integer >= 1, 1 meaning no padding "
                               f"(got {multiple!r})")


def padded_size(vocab_size: int, multiple: int | None) -> int:
    """Smallest multiple of ``multiple`` that is >= ``vocab_size`` (no padding for None/<=1)."""
    if multiple is None or multiple <= 1:
        return vocab_size
    return -(-vocab_size // multiple) * multiple


# --------------------------------------------------------------------------- input reading
# The readers live in formats.py; these names stay importable from here.
from .formats import (DEFAULT_TEXT_FIELD, expand_inputs, iter_documents, iter_jsonl_texts,  # noqa: E402,F401
                      iter_piece, iter_tar_texts, iter_text_lines, kind_of, Piece, read_text_file)


def iter_training_texts(inputs: Sequence[Path], text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """What the trainer reads, streamed: plain text files line by line (a 20 GB ``.txt`` is never
    held whole), every other format document by document (one record at a time)."""
    for path in expand_inputs(inputs):
        if kind_of(path) == "text":
            yield from iter_text_lines(path)
        else:
            yield from iter_piece(Piece(str(path)), text_field)


def _training_lines(inputs: Sequence[Path], progress: bool, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """Lines (newline kept) for sentencepiece; over-long lines are cut so none is silently dropped.
    Streamed: sentencepiece keeps only its ``input_sentence_size`` reservoir sample of them."""
    texts = iter_training_texts(inputs, text_field)
    for doc in tqdm(texts, desc="train-tokenizer: reading", unit="text", disable=not progress):
        for line in doc.splitlines(keepends=True):
            yield from _cut_long_line(line)


def _cut_long_line(line: str) -> Iterator[str]:
    """``line`` in pieces sentencepiece keeps (at most _MAX_LINE_BYTES UTF-8 bytes): heads of
    _MAX_LINE_BYTES // 4 characters (4 bytes per character at most) while the rest is longer,
    then the rest. Linear in the line: a line of minified code or a text file without newlines
    can be gigabytes, and re-encoding the rest after each cut took hours."""
    remaining = len(line.encode("utf-8"))
    start, cut = 0, _MAX_LINE_BYTES // 4
    while remaining > _MAX_LINE_BYTES:
        head = line[start : start + cut]
        yield head
        remaining -= len(head.encode("utf-8"))
        start += cut
    if start < len(line):
        yield line[start:]


def _remember_errors(lines: Iterator[str], errors: list) -> Iterator[str]:
    """``lines`` unchanged, but a DataError they raise is also appended to ``errors``.

    sentencepiece turns an exception raised by its sentence iterator into a RuntimeError whose
    text ends in a stack frame, so the caller re-raises the remembered one-line error instead."""
    try:
        yield from lines
    except DataError as e:
        errors.append(e)
        raise


# --------------------------------------------------------------------------- training
RESERVED_PIECES = {"<pad>": PAD_ID, "<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}


def check_special_tokens(symbols: Sequence[str]) -> None:
    """Refuse a special token (user-defined symbol) that is empty or one of the reserved pieces:
    sentencepiece then drops the reserved id (eos_id -1, which a uint16 shard stores as 65535) or
    fails with its own wording."""
    for symbol in symbols:
        if symbol == "":
            raise DataError("--special-token", "an empty special token")
        if symbol in RESERVED_PIECES:
            reserved = " ".join(RESERVED_PIECES)
            raise DataError(f"--special-token {symbol}", f"a reserved piece (id {RESERVED_PIECES[symbol]}); "
                                                         f"reserved: {reserved}")


def tokenizer_files(out_prefix: Path) -> dict:
    """The files :func:`train_tokenizer` writes for ``out_prefix``: {"model", "vocab", "json"} -> path."""
    out_prefix = Path(out_prefix)
    return {kind: out_prefix.with_name(f"{out_prefix.name}.{kind}") for kind in ("model", "vocab", "json")}


def check_output_prefix(out_prefix: Path) -> None:
    """Refuse, before any training, an ``out_prefix`` whose ``.model`` / ``.vocab`` / ``.json`` cannot
    be written (an existing directory, a prefix under a regular file) or already exist (a tokenizer
    is never replaced): training can take hours, and a bad path should not be found out only when
    the result is written."""
    files = tokenizer_files(out_prefix)
    for path in files.values():
        check_writable(path)
    # the .model is written last (_write_model_files): it exists only once the sidecars do
    refuse_existing(files["model"],
                    "shards and checkpoints made with a tokenizer there would no longer load: choose another "
                    "--out-prefix or remove its .model, .vocab and .json")
    # a .json or .vocab there without the .model is a run cut short (its sidecar names the .model,
    # and the .vocab is written just before it), or a user's own file, such as a corpus.json next to
    # --out-prefix corpus: that is never written over
    if not _own_leftover_sidecar(files["json"], files["model"]):
        for kind in ("json", "vocab"):
            refuse_existing(files[kind], "not a sidecar of a tokenizer trained there: choose another --out-prefix")


def _own_leftover_sidecar(json_path: Path, model_path: Path) -> bool:
    """Whether ``json_path`` is the sidecar a cut-short training wrote for ``model_path`` (a JSON
    object naming it as its model_file, with the model's sha256)."""
    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("model_file") == model_path.name and "sha256" in data


def train_tokenizer(inputs: list[Path], out_prefix: Path, vocab_size: int, model_type: str = "bpe",
                    pad_vocab_to_multiple_of: int = 128, user_defined_symbols: Sequence[str] = (),
                    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE, *, character_coverage: float = 0.9995,
                    byte_fallback: bool = True, seed: int = 1234, num_threads: int = 1,
                    progress: bool = True, text_field: str = DEFAULT_TEXT_FIELD) -> Path:
    """Train a sentencepiece model on ``inputs`` and write ``out_prefix.model``, ``.vocab`` and ``.json``.

    The ``.json`` sidecar records vocab size, padded vocab size, the sha256 of the ``.model`` file
    (shards and checkpoints carry it, so a run refuses data made with another tokenizer) and the
    special ids. Returns the ``.model`` path. All three files are written atomically.
    ``input_sentence_size``: lines sentencepiece samples for training; 0 keeps every line.
    """
    out_prefix = Path(out_prefix)
    inputs = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    if not inputs:
        raise DataError(str(out_prefix), "train_tokenizer needs at least one input file")
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise DataError(str(out_prefix), f"model_type must be bpe, unigram, char or word (got {model_type!r})")
    if vocab_size < 8:
        raise DataError(str(out_prefix), f"vocab_size must be >= 8 (got {vocab_size})")
    if input_sentence_size < 0 or 0 < input_sentence_size <= 100:  # sentencepiece samples 0 (all) or > 100 lines
        raise DataError(str(out_prefix), f"input_sentence_size must be 0 (every line) or above 100 "
                                         f"(got {input_sentence_size})")
    check_pad_multiple(str(out_prefix), pad_vocab_to_multiple_of)
    check_special_tokens(user_defined_symbols)
    check_output_prefix(out_prefix)
    symbols = ["\n"] + [s for s in user_defined_symbols if s != "\n"]
    model_buf = io.BytesIO()
    input_errors: list[DataError] = []
    text_lines: list[int] = [0]  # lines holding text that sentencepiece was given
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_counted(_remember_errors(_training_lines(inputs, progress, text_field), input_errors),
                                       text_lines),
            model_writer=model_buf,
            vocab_size=vocab_size, model_type=model_type, byte_fallback=byte_fallback,
            character_coverage=character_coverage, normalization_rule_name="identity",
            remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, user_defined_symbols=symbols,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
            max_sentence_length=_MAX_LINE_BYTES, hard_vocab_limit=False, num_threads=num_threads,
            minloglevel=2,
        )
    except DataError:
        raise
    except (RuntimeError, OSError, ValueError) as e:  # ValueError: a setting sentencepiece cannot parse
        if input_errors:  # sentencepiece wrapped our reader's error in a RuntimeError ending in a stack frame
            raise input_errors[0] from None
        if not text_lines[0]:  # sentencepiece's words: "INTERNAL: ... [!sentences_.empty()]"
            held = "the input holds" if len(inputs) == 1 else "the inputs hold"
            raise DataError(_names(inputs), f"{held} no text to train a tokenizer on") from None
        small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e))
        if small:  # its own words name an option of spm_train, not of this command
            raise DataError(f"vocab_size {small[1]}", f"below the {small[2]} pieces this corpus needs (its characters "
                                                      f"and the reserved pieces): use {small[2]} or more") from None
        if "[(vocab_size) >= (0)]" in str(e):  # word / char: fewer pieces asked than they reserve
            reserved = 4 + len(symbols) + (256 if byte_fallback else 0)
            raise DataError(f"vocab_size {vocab_size}", f"below the {reserved} pieces a {model_type} model reserves "
                                                        f"(4 special ids, {len(symbols)} user-defined symbol(s)"
                                                        f"{', 256 byte pieces' if byte_fallback else ''}): use more")
        raise DataError(str(out_prefix), f"sentencepiece training failed: {str(e).strip().splitlines()[-1]}") from None
    model = _write_model_files(out_prefix, model_buf.getvalue(), model_type, pad_vocab_to_multiple_of, symbols)
    got = spm.SentencePieceProcessor(model_file=str(model)).get_piece_size()
    if got < vocab_size:  # hard_vocab_limit off: sentencepiece stops where the corpus has no more pieces
        log.warning("%s: vocab_size %d asked, the corpus gave %d pieces (a larger corpus gives more)", model, vocab_size,
                    got)
    return model


def _counted(lines: Iterator[str], count: list) -> Iterator[str]:
    """``lines`` unchanged; ``count[0]`` counts those that hold more than a line end, so that a
    failed training can tell an input without text (sentencepiece then says only "INTERNAL: ...
    [!sentences_.empty()]") from a failure of its own."""
    for line in lines:
        count[0] += bool(line.strip("\r\n"))
        yield line


def _names(paths: Sequence[Path], most: int = 3) -> str:
    """The files ``paths`` for an error line: the first ``most``, then how many more."""
    names = ", ".join(map(str, paths[:most]))
    return names + (f" (+{len(paths) - most} more)" if len(paths) > most else "")


def _write_model_files(out_prefix: Path, model: bytes, model_type: str, multiple: int, symbols) -> Path:
    """Write ``.vocab`` (piece<TAB>score, like spm_train), the ``.json`` sidecar and then ``.model``
    (last, so that a ``.model`` on disk means a complete tokenizer: launch/demo.sh and the test
    dataset skip the step when it exists)."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    files = tokenizer_files(out_prefix)
    model_path = files["model"]
    vocab_lines = [f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}" for i in range(sp.get_piece_size())]
    atomic_write_bytes(files["vocab"], ("\n".join(vocab_lines) + "\n").encode("utf-8"))
    vocab = sp.get_piece_size()
    atomic_write_json(files["json"], {
        "model_file": model_path.name, "model_type": model_type, "sha256": sha256_bytes(model),
        "vocab_size": vocab, "padded_vocab_size": padded_size(vocab, multiple),
        "pad_vocab_to_multiple_of": multiple, "pad_id": sp.pad_id(), "unk_id": sp.unk_id(),
        "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "user_defined_symbols": list(symbols),
    })
    atomic_write_bytes(model_path, model)  # last: an existing .model means all three files are there
    return model_path


# --------------------------------------------------------------------------- loading
class Tokenizer:
    """A loaded sentencepiece model plus the facts a training run must agree on (sizes, ids, hash)."""

    def __init__(self, processor: spm.SentencePieceProcessor, sha256: str, padded_vocab_size: int,
                 model_path: Path | None = None):
        self.sp = processor
        self.sha256 = sha256
        self.model_path = model_path
        self.vocab_size = processor.get_piece_size()
        self.padded_vocab_size = padded_vocab_size
        self.eos_id = processor.eos_id()
        self.bos_id = processor.bos_id()
        self.pad_id = processor.pad_id()
        self.unk_id = processor.unk_id()

    @classmethod
    def load(cls, model_path: Path, pad_vocab_to_multiple_of: int | None = None) -> "Tokenizer":
        """Load ``model_path``; padding comes from the argument, else the ``.json`` sidecar, else 128.
        A malformed sidecar or padding multiple is a DataError naming it."""
        model_path = Path(model_path)
        try:
            data = model_path.read_bytes()
        except OSError as e:
            raise DataError(str(model_path), f"cannot read tokenizer model ({e.strerror or e})") from None
        sp = _processor(model_path, data)
        try:
            sidecar = _sidecar(model_path)
        except DataError:
            if pad_vocab_to_multiple_of is None:  # the padding would come from it
                raise
            sidecar = {}  # padding given: a broken sidecar only leaves the model unverified
        sha256 = sha256_bytes(data)
        _check_against_sidecar(model_path, sidecar, sha256, sp.get_piece_size())
        multiple, where = pad_vocab_to_multiple_of, str(model_path)
        if multiple is None:
            where = str(model_path.with_suffix(".json"))
            multiple = sidecar.get("pad_vocab_to_multiple_of", 128)
        check_pad_multiple(where, multiple)
        return cls(sp, sha256, padded_size(sp.get_piece_size(), multiple), model_path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added; the shard writer appends EOS per document)."""
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts in one sentencepiece call (much faster than a Python loop)."""
        return self.sp.encode(texts, num_threads=num_threads)

    def encode_parts(self, parts: Iterable[str]) -> Iterator[list[int]]:
        """The ids of the text ``"".join(parts)``, part by part, where every part but the first
        starts just after a newline (formats.TextParts): concatenated, exactly ``encode`` of the
        whole text, in the memory of one part. Where newlines split the segmentation
        (parts_split_exactly) each side is segmented on its own; a later part is encoded after a
        newline, ``encode("\n" + part)``, and the ids of ``encode("\n")`` (the dummy prefix and the
        newline) are dropped from its front. A tokenizer without that property gets the parts joined
        and encoded whole."""
        parts = iter(parts)
        if not self.parts_split_exactly:
            yield self.encode("".join(parts))
            return
        yield from self._encode_split(parts)

    def _encode_split(self, parts: Iterable[str]) -> Iterator[list[int]]:
        lead = len(self.encode("\n"))
        for i, part in enumerate(parts):
            yield self.encode(part) if i == 0 else self.encode("\n" + part)[lead:]

    def check_document_separator(self) -> None:
        """Refuse a tokenizer without an end-of-document id (sentencepiece's -1, e.g. '</s>' made a
        user-defined symbol): shards separate documents with it, and -1 would be stored as 65535."""
        if self.eos_id < 0:
            raise DataError(str(self.model_path or "tokenizer"), "has no end-of-document piece (eos_id -1): shards "
                                                                 "separate documents with it; train one with eos")

    @functools.cached_property
    def parts_split_exactly(self) -> bool:
        """Whether a text cut after its newlines encodes part by part to its own ids: no piece but
        ``"\n"`` contains a newline, normalisation keeps newlines (a rule such as nmt_nfkc maps them
        to spaces, and pieces like "▁#" then span a cut), and probes with whitespace around
        newlines encode alike cut and whole. True of the tokenizers train_tokenizer writes
        (identity normalisation, trained on lines); encode_parts relies on it."""
        if any("\n" in piece and piece != "\n" for piece in map(self.sp.id_to_piece, range(self.vocab_size))):
            return False
        if "\n" not in self.sp.normalize("a\nb"):
            return False
        for probe in NEWLINE_PROBES:
            cuts = [i + 1 for i, c in enumerate(probe) if c == "\n"]
            parts = [probe[i:j] for i, j in zip([0, *cuts], [*cuts, len(probe)]) if i < j]
            if [i for ids in self._encode_split(parts) for i in ids] != self.encode(probe):
                return False
        return True

    def decode(self, ids) -> str:
        """Text of ``ids``; padding ids (>= vocab_size) and tensors/arrays are accepted and pads dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def describe(self) -> dict:
        """The facts a manifest or checkpoint stores to check later data against this tokenizer."""
        return {"tokenizer_sha256": self.sha256, "vocab_size": self.vocab_size,
                "padded_vocab_size": self.padded_vocab_size, "eos_id": self.eos_id, "bos_id": self.bos_id,
                "pad_id": self.pad_id}


def _processor(model_path: Path, data: bytes) -> spm.SentencePieceProcessor:
    """The sentencepiece processor of a model file's bytes. sentencepiece loads an empty proto
    without complaint into a model of 0 pieces that fails only inside the first encode, so an
    empty file (or a model without pieces) is refused here, by name, like any other non-model."""
    if not data:
        raise DataError(str(model_path), "not a sentencepiece model (empty file)")
    try:
        sp = spm.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, TypeError, OSError):
        raise DataError(str(model_path), "not a sentencepiece model") from None
    if sp.get_piece_size() == 0:
        raise DataError(str(model_path), "not a sentencepiece model (no pieces)")
    return sp


def _check_against_sidecar(model_path: Path, sidecar: dict, sha256: str, pieces: int) -> None:
    """A model whose bytes or piece count differ from what its sidecar recorded at training is
    damaged or replaced (sentencepiece loads a cut-short model without complaint, with its
    normalizer settings or pieces missing, and then tokenizes differently): refused by name."""
    recorded = sidecar.get("sha256")
    if isinstance(recorded, str) and recorded != sha256:
        raise DataError(str(model_path), f"sha256 {sha256[:12]}... differs from the {recorded[:12]}... that its sidecar "
                                         f"{model_path.with_suffix('.json').name} recorded: the model file is damaged "
                                         "or was replaced (restore it, or train the tokenizer again)")
    size = sidecar.get("vocab_size")
    if isinstance(size, int) and not isinstance(size, bool) and size != pieces:
        raise DataError(str(model_path), f"{pieces} pieces, its sidecar {model_path.with_suffix('.json').name} "
                                         f"recorded {size}: the model file is damaged or was replaced")


def _sidecar(model_path: Path) -> dict:
    """The ``.json`` written next to a ``.model`` by :func:`train_tokenizer`, or {} when there is none.
    One that is there but unreadable (corrupt, cut short, not UTF-8, no permission) or not a JSON
    object is a DataError naming the file: read as "no sidecar", it would silently give the default
    padding, another padded_vocab_size than the one the tokenizer was made with."""
    side = model_path.with_suffix(".json")
    try:
        data = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or UnicodeDecodeError
        raise DataError(str(side), f"unreadable tokenizer sidecar ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(data, dict):
        raise DataError(str(side), f"tokenizer sidecar must be a JSON object, got {type(data).__name__}")
    return data


def tokenizer_sha256(model_path: Path) -> str:
    """sha256 of a tokenizer model file, the identity that shards and checkpoints are checked against."""
    return sha256_file(model_path)
