"""Tokenize, pack and write webdataset shards plus a manifest.

Layout (why):

* Documents are tokenized, each followed by EOS, concatenated and cut into samples of exactly
  ``seq_length + 1`` tokens, so one sample gives both the inputs (``[:-1]``) and the shifted labels
  (``[1:]``) with no padding and no wasted compute. Samples do not overlap; the tail that does not
  fill a whole sample is dropped (its size is recorded as ``dropped_tokens``).
* Each sample is one tar entry ``{key}.tokens.npy`` (uint16 when the padded vocabulary fits, else
  int32). The first sample of every shard also carries ``meta.json`` (tokenizer sha256,
  seq_length, dtype) so a shard that strays into the wrong dataset is caught on its own.
* Tars are written with fixed mtimes/owners, so the same input gives byte-identical shards and
  the same sha256 in the manifest.
* Validation is held out BY SHARD, spread evenly over the corpus (not the last shards, which would
  all come from the alphabetically last sources), so train and val never share a shard.
* Everything is written in a temporary directory and moved into place only after the last shard
  succeeded; the manifest is written last, atomically. A run that fails before the move leaves the
  old dataset intact. The old manifest is deleted just before the move, so a crash during it leaves
  no manifest (a one-line loader error until the build is run again), never an old manifest over
  new shards of the same names and sizes, which a partial read (no whole-shard sha256) would accept.
  A SIGTERM or Ctrl-C in that window is held back until the new manifest is saved (:func:`commit`).
* Re-sharding into the same directory then deletes the shards of the old run that the new
  manifest does not list (``{prefix}-{train,val}-NNNNNN.tar`` only), so a glob over the directory
  never mixes old and new data.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from ascender_dist.config.checks import url_template_problem

from ._io import (atomic_write_json, fsync_dir, run_temp_dir, sha256_bytes, signals_deferred, write_durably,
                  writing_into)
from .errors import DataError
from .formats import DEFAULT_TEXT_FIELD, iter_documents, lone_surrogate
from .replace import MANIFEST_NAME, cut_short_hint, drop_previous, restore_cut_short, set_aside_old
from .tokenizer import Tokenizer

MANIFEST_VERSION = 1
DEFAULT_SHARD_MAX_BYTES = 64 * 1024 * 1024
_ENCODE_BATCH = 256

log = logging.getLogger(__name__)


@dataclass
class ShardInfo:
    """One shard as recorded in the manifest."""

    name: str
    split: str
    num_samples: int
    num_tokens: int
    sha256: str
    bytes: int


@dataclass
class Manifest:
    """What a loader needs to know before opening any shard: counts, checksums and tokenizer identity."""

    seq_length: int
    tokenizer_sha256: str
    vocab_size: int
    padded_vocab_size: int
    eos_id: int
    pad_id: int
    dtype: str
    shards: list[ShardInfo] = field(default_factory=list)
    num_documents: int = 0
    dropped_tokens: int = 0
    version: int = MANIFEST_VERSION
    path: Path | None = None  # where it was loaded from; shard names resolve relative to its directory

    def split_shards(self, split: str) -> list[ShardInfo]:
        """Shards of one split ("train" or "val"), in manifest order."""
        return [s for s in self.shards if s.split == split]

    def num_samples(self, split: str) -> int:
        """Total samples of a split."""
        return sum(s.num_samples for s in self.split_shards(split))

    def base_dir(self) -> Path:
        """Directory that shard names are relative to."""
        return self.path.parent if self.path is not None else Path(".")

    def shard_url(self, shard: ShardInfo, url_template: str | None = None) -> str:
        """URL of a shard: a local path next to the manifest, or ``url_template.format(name=...)``
        (e.g. ``"pipe:aws s3 cp s3://bucket/data/{name} -"``) for object stores."""
        if url_template:
            check_url_template(url_template)
            if not _TEMPLATE_SAFE.fullmatch(shard.name):  # a pipe: template runs the result through a shell
                raise DataError(str(self.path or "manifest"), f"shard {shard.name!r}: a name passed to a "
                                "url_template must hold only letters, digits and . _ - + = @ / (no whitespace, "
                                "quotes or shell syntax)")
            return url_template.format(name=shard.name)
        return local_url(self.base_dir() / shard.name)

    def to_json(self) -> dict:
        """Plain-JSON form (``path`` omitted: it is where the file is, not what it says)."""
        d = dataclasses.asdict(self)
        d.pop("path")
        return d

    def save(self, path: Path) -> Path:
        """Write atomically to ``path`` (a directory means ``path/manifest.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / MANIFEST_NAME
        atomic_write_json(path, self.to_json())
        self.path = path
        return path


def reads_as_url(text: str) -> bool:
    """Whether a shard location reads as a URL or command (``pipe:``, ``s3://``, ``file:``), not a
    local path: its first path component holds a ':'. What ShardSpec.local_path decides by."""
    return ":" in text.split("/")[0]


def local_url(path: Path) -> str:
    """``path`` as a shard URL every reader opens as a local file: a relative path whose first folder
    holds a ':' (``run-12:30/...``) would read as a URL scheme to webdataset's gopen and the loader,
    so it gets a leading ``./``; any other path is its plain ``str``."""
    url = str(path)
    return f"./{url}" if reads_as_url(url) else url


def check_url_template(template: str) -> None:
    problem = url_template_problem(template)
    if problem:
        raise DataError("url_template", problem)


# field -> expected JSON type(s); ints must not be bools, floats are not accepted for counts
_MANIFEST_TYPES = {"seq_length": int, "tokenizer_sha256": str, "vocab_size": int, "padded_vocab_size": int,
                   "eos_id": int, "pad_id": int, "dtype": str, "num_documents": int, "dropped_tokens": int,
                   "version": int}
_SHARD_TYPES = {"name": str, "split": str, "num_samples": int, "num_tokens": int, "sha256": str, "bytes": int}
# field -> (least, most) allowed: a count the loader adds up or allocates by must be sane, so that no sum
# of them can overflow int64 and no id table is larger than an int32 token can index. A shard of 0
# samples is legal here: the loader reports it as an empty (skippable) shard, by name.
_MAX_COUNT = 2**48
_MAX_VOCAB = 2**31
_MANIFEST_RANGES = {"seq_length": (1, _MAX_COUNT), "vocab_size": (1, _MAX_VOCAB),
                    "padded_vocab_size": (1, _MAX_VOCAB), "num_documents": (0, _MAX_COUNT),
                    "dropped_tokens": (0, _MAX_COUNT)}
_SHARD_RANGES = {"num_samples": (0, _MAX_COUNT), "num_tokens": (0, _MAX_COUNT), "bytes": (0, _MAX_COUNT)}
_NULLABLE = {"sha256", "bytes"}  # unknown checksum / size: the shard is read without those checks
_SPLITS = ("train", "val")  # what _finalize writes and the loaders read


def check_field_types(where: str, record: dict, types: dict, prefix: str = "", error=None,
                      nullable=_NULLABLE) -> None:
    """Every known field present in ``record`` has its JSON type (bools are not integers); a
    one-line ``error(where, message)`` naming the field otherwise (default DataError). Null is
    allowed for the fields in ``nullable``. Shared by the manifest and the shards' meta.json."""
    for key, kind in types.items():
        if key not in record or record[key] is None and key in nullable:
            continue
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise (error or DataError)(where, f"{prefix}{key}: expected {'an integer' if kind is int else 'a string'}, "
                                              f"got {type(value).__name__} {value!r}")


def check_field_ranges(where: str, record: dict, ranges: dict, prefix: str = "") -> None:
    """Every integer field of ``ranges`` present in ``record`` (types checked before) lies in its
    ``(least, most)``; a one-line DataError naming ``where`` and the field otherwise."""
    for key, (least, most) in ranges.items():
        value = record.get(key)
        if value is not None and not least <= value <= most:
            raise DataError(where, f"{prefix}{key}: must be in [{least}, {most}] (got {value})")


def _check_manifest_numbers(where: str, raw: dict) -> None:
    """The manifest's counts and sizes are in range (:data:`_MANIFEST_RANGES`, :data:`_SHARD_RANGES`),
    ``vocab_size <= padded_vocab_size``, and the shards' totals fit the same bound as one count."""
    check_field_ranges(where, raw, _MANIFEST_RANGES)
    if raw.get("vocab_size", 1) > raw.get("padded_vocab_size", _MAX_VOCAB):
        raise DataError(where, f"vocab_size {raw['vocab_size']} > padded_vocab_size {raw['padded_vocab_size']}")
    for key in _SHARD_RANGES:
        total = sum(s[key] or 0 for s in raw.get("shards") or [])
        if total > _MAX_COUNT:
            raise DataError(where, f"shards: total {key} {total} > {_MAX_COUNT}")


def load_manifest(path) -> Manifest:
    """Read a manifest (a ``manifest.json`` or the directory holding it); problems are one-line DataErrors."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(str(path), "manifest not found" + cut_short_hint(path)) from None
    # ValueError: also an integer past Python's digit limit; RecursionError: nesting past the stack
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(str(path), f"unreadable manifest ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise DataError(str(path), f"manifest must be a JSON object, got {type(raw).__name__}")
    check_field_types(str(path), raw, _MANIFEST_TYPES)
    if raw.get("version", MANIFEST_VERSION) > MANIFEST_VERSION:  # before the shards: their fields may be new
        raise DataError(str(path), f"manifest version {raw['version']} is newer than this code ({MANIFEST_VERSION})")
    if "shards" in raw and not isinstance(raw["shards"], list):
        raise DataError(str(path), f"shards: expected a list, got {type(raw['shards']).__name__}")
    first_of: dict[str, int] = {}
    for i, s in enumerate(raw.get("shards") or []):
        _check_shard_record(str(path), i, s, first_of)
    _check_manifest_numbers(str(path), raw)
    try:
        shards = [ShardInfo(**s) for s in raw.pop("shards")]
        known = {f.name for f in dataclasses.fields(Manifest)}
        manifest = Manifest(shards=shards, **{k: v for k, v in raw.items() if k in known and k != "path"})
    except (KeyError, TypeError) as e:
        raise DataError(str(path), f"manifest is missing or has unexpected fields ({e})") from None
    manifest.path = path
    return manifest


# a shard name is joined to the manifest's directory (a path webdataset's gopen opens: a leading
# "scheme:" would make it a URL, "pipe:" a shell command) or pasted into a url_template's command
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # pipe:, s3:, https:, file: ...
# what a name passed to a url_template may hold: no whitespace, quotes or shell syntax
_TEMPLATE_SAFE = re.compile(r"[A-Za-z0-9_.+=@-]+(/[A-Za-z0-9_.+=@-]+)*")


def is_url_or_command(text: str) -> bool:
    """Whether webdataset's gopen would open ``text`` as a URL or run it as a command (a leading
    "scheme:" such as pipe:, s3:, https:, file:) rather than as a local path."""
    return bool(_SCHEME.match(text))


def shard_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a shard name (a manifest's, or one the writer makes), or None: a
    relative path inside the dataset's directory, read as a file (no scheme, no '..', no absolute
    path, no component starting with '-', no control character)."""
    if not name or name.startswith("/") or is_url_or_command(name) or any(ord(c) < 32 or c == "\x7f" for c in name):
        return "is not a relative file path (no scheme such as 'pipe:', no leading '/', no control character)"
    if any(part == ".." or part.startswith("-") for part in name.split("/")):
        return "has a '..' or a component starting with '-'"
    return None


def _check_shard_record(where: str, i: int, s, first_of: dict[str, int]) -> None:
    """Shard entry ``i`` has exactly the ShardInfo fields, their types, a known split and a name no
    earlier entry has (``first_of``: normalised name -> index, filled here; ``x.tar`` and
    ``./x.tar`` are one file). A shard the loaders would not read (another split, a second copy)
    is an error, never silently dropped or read twice."""
    if not isinstance(s, dict):
        raise DataError(where, f"shards[{i}]: expected an object, got {type(s).__name__} {s!r}")
    check_field_types(where, s, _SHARD_TYPES, prefix=f"shards[{i}].")
    check_field_ranges(where, s, _SHARD_RANGES, prefix=f"shards[{i}].")
    unknown, missing = sorted(set(s) - set(_SHARD_TYPES)), [k for k in _SHARD_TYPES if k not in s]
    if unknown:
        raise DataError(where, f"shards[{i}]: unknown field(s) {', '.join(map(repr, unknown))}")
    if missing:
        raise DataError(where, f"shards[{i}]: missing field(s) {', '.join(map(repr, missing))}")
    if s["split"] not in _SPLITS:
        raise DataError(where, f'shards[{i}].split: must be "train" or "val" (got {s["split"]!r})')
    problem = shard_name_problem(s["name"])
    if problem:
        raise DataError(where, f"shards[{i}].name: {s['name']!r} {problem}")
    name = os.path.normpath(s["name"])
    if name in first_of:
        raise DataError(where, f"shards[{i}].name: {s['name']!r} is already shards[{first_of[name]}]")
    first_of[name] = i


# --------------------------------------------------------------------------- sample encoding
def token_dtype(padded_vocab_size: int) -> np.dtype:
    """uint16 halves the shard size whenever every id fits; int32 otherwise."""
    return np.dtype(np.uint16) if padded_vocab_size <= 65536 else np.dtype(np.int32)


def npy_bytes(arr: np.ndarray) -> bytes:
    """The ``.npy`` encoding of an array (what webdataset's ``npy`` decoder reads)."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def pack_samples(token_lists: Iterable[list[int]], eos_id: int, sample_len: int) -> Iterator[np.ndarray]:
    """Concatenate documents (each + EOS) and yield full samples of ``sample_len`` tokens.

    The last partial sample is never yielded; :class:`_Packer` exposes how many tokens it dropped.
    """
    packer = _Packer(eos_id, sample_len)
    for ids in token_lists:
        yield from packer.add(ids)


class _Packer:
    """Incremental packer: keeps the unfinished tail between documents."""

    def __init__(self, eos_id: int, sample_len: int):
        self.eos_id = eos_id
        self.sample_len = sample_len
        self.buf: list[int] = []

    def add(self, ids: list[int], end: bool = True) -> Iterator[np.ndarray]:
        """Append a document (``end``: its last part, EOS follows) and yield every sample that is
        now complete."""
        self.buf.extend(ids)
        if end:
            self.buf.append(self.eos_id)
        n = len(self.buf) // self.sample_len
        if n:
            full = np.asarray(self.buf[: n * self.sample_len], dtype=np.int64).reshape(n, self.sample_len)
            del self.buf[: n * self.sample_len]
            yield from full

    @property
    def leftover(self) -> int:
        """Tokens that would be dropped if input ended now."""
        return len(self.buf)


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    """A tar header with fixed metadata so identical content gives identical bytes (and sha256)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uname = info.gname = ""
    return info


def encode_shard(samples: list[np.ndarray], dtype: np.dtype, meta: dict) -> bytes:
    """A whole shard as tar bytes: ``{i:06d}.tokens.npy`` per sample, ``000000.meta.json`` on the first."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i, sample in enumerate(samples):
            key = f"{i:06d}"
            data = npy_bytes(np.ascontiguousarray(sample, dtype=dtype))
            tf.addfile(_tarinfo(f"{key}.tokens.npy", len(data)), io.BytesIO(data))
            if i == 0:
                mdata = json.dumps(meta, sort_keys=True).encode("utf-8")
                tf.addfile(_tarinfo(f"{key}.meta.json", len(mdata)), io.BytesIO(mdata))
    return buf.getvalue()


# --------------------------------------------------------------------------- writing
def _documents(documents, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """Accept texts or file paths (any format of :mod:`data_pipeline.formats`), in the given order.
    A lone str or Path is one item (iterating a str would yield its characters). One file reached
    by two of the paths is a DataError, as in one ``iter_documents`` call (read twice, its
    documents would be in the corpus twice); a str naming an existing file too (it would be
    tokenized as text: pass a Path)."""
    if isinstance(documents, (str, Path)):
        documents = [documents]
    seen: dict = {}  # file identity -> path, over every Path item
    for i, item in enumerate(documents):
        if isinstance(item, Path):
            yield from iter_documents([item], text_field, seen)
        elif isinstance(item, str):
            _refuse_a_path_as_text(item)
            _refuse_a_lone_surrogate(i, item)
            yield item
        else:
            raise DataError(repr(item)[:60], "documents must be str texts or pathlib.Path files")


def _refuse_a_lone_surrogate(index: int, text: str) -> None:
    """A str document holding a lone UTF-16 surrogate (no Unicode character: it cannot be UTF-8
    encoded) is refused by position, as the file readers refuse one; the tokenizer's own error
    named neither the document nor the character."""
    found = lone_surrogate(text)
    if found:
        raise DataError(f"documents[{index}]", f"lone surrogate \\u{ord(found.group()):04x} at character {found.start()} "
                                             "is not valid Unicode")


def _refuse_a_path_as_text(text: str) -> None:
    """A one-line str that names an existing file was meant as its path."""
    if "\n" in text or len(text) > 4096:
        return
    try:
        is_file = Path(text).is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte: text
        return
    if is_file:
        raise DataError(text, "a str document that names a file is taken as text: pass pathlib.Path(...) to read "
                              "the file, or give the text itself")


def encoded_documents(documents: Iterable, tokenizer: Tokenizer,
                      num_threads: int = 1) -> Iterator[tuple[list[int], bool, int]]:
    """Token ids of ``documents`` (str texts, or formats.TextParts), in order, as ``(ids, end,
    text_bytes)``: ``end`` on a document's last ids (EOS follows them). Texts are encoded in
    batches (one sentencepiece call each), a TextParts document part by part, so its memory is
    that of one part, not of the whole file."""
    texts: list[str] = []

    def encoded_texts():
        if texts:
            for text, ids in zip(texts, tokenizer.encode_batch(texts, num_threads=num_threads)):
                yield ids, True, len(text.encode("utf-8"))
            texts.clear()

    for doc in documents:
        if isinstance(doc, str):
            texts.append(doc)
            if len(texts) == _ENCODE_BATCH:
                yield from encoded_texts()
            continue
        yield from encoded_texts()
        sizes: list[int] = []  # of the parts read for the ids that come next
        for ids in tokenizer.encode_parts(_measured(doc, sizes)):
            yield ids, False, sum(sizes)
            sizes.clear()
        yield [], True, 0
    yield from encoded_texts()


def _measured(parts: Iterable[str], sizes: list) -> Iterator[str]:
    """``parts`` unchanged, each one's UTF-8 size appended to ``sizes`` as it is read."""
    for part in parts:
        sizes.append(len(part.encode("utf-8")))
        yield part


def _samples_per_shard(samples_per_shard, shard_max_bytes, sample_len: int, dtype: np.dtype) -> int:
    """Shard capacity in samples: explicit, or as many as fit in ``shard_max_bytes`` (tar overhead included)."""
    if samples_per_shard is not None:
        if samples_per_shard < 1:
            raise DataError("write_shards", f"samples_per_shard must be >= 1 (got {samples_per_shard})")
        return int(samples_per_shard)
    max_bytes = int(shard_max_bytes or DEFAULT_SHARD_MAX_BYTES)
    # tar: 512-byte header + data padded to 512 per member; the archive ends with two zero blocks
    # and is padded to a 10240-byte record. npy adds a 128-byte header. meta.json: one more member.
    per_sample = 512 + -(-(128 + sample_len * dtype.itemsize) // 512) * 512
    usable = (max_bytes // tarfile.RECORDSIZE) * tarfile.RECORDSIZE - 1024 - 1024
    if usable < per_sample:  # not even one sample fits: every shard would hold one, far over the limit
        least = -(-(per_sample + 2048) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE
        raise DataError("write_shards", f"shard_max_bytes {max_bytes} is below one sample's shard ({least} bytes for "
                                        f"{sample_len} tokens of {dtype.name}): give at least {least}")
    return usable // per_sample


def val_shard_indices(num_shards: int, val_fraction: float) -> set[int]:
    """Which shards are validation: ``round(n * val_fraction)`` (at least 1 when 0 < f and n >= 2),
    spread evenly over the corpus order so val resembles train."""
    if val_fraction <= 0 or num_shards < 2:
        return set()
    n_val = min(num_shards - 1, max(1, round(num_shards * val_fraction)))
    return {int((j + 0.5) * num_shards / n_val) for j in range(n_val)}


def check_shard_settings(out_dir: Path, seq_length: int, val_fraction: float, samples_per_shard: int | None = None,
                         shard_max_bytes: int | None = None, prefix: str = "shard") -> None:
    """What every shard writer checks before reading anything (the serial one here, the parallel
    jobs of :mod:`.parallel`, the CLI before launching them), then ``out_dir`` created. The shard
    sizes are None (default size) or >= 1, and at most one is given; 0 or a negative size would
    otherwise mean the default or one-sample shards without a word. The prefix: see :func:`check_shard_prefix`."""
    out_dir = Path(out_dir)
    check_shard_prefix(prefix)
    if seq_length < 1:
        raise DataError("write_shards", f"seq_length must be >= 1 (got {seq_length})")
    for name, value in (("samples_per_shard", samples_per_shard), ("shard_max_bytes", shard_max_bytes)):
        if value is not None and value < 1:
            raise DataError("write_shards", f"{name} must be >= 1 (got {value})")
    if samples_per_shard is not None and shard_max_bytes is not None:
        raise DataError("write_shards", "give samples_per_shard or shard_max_bytes, not both (one would be ignored)")
    if not 0 <= val_fraction < 1:
        raise DataError("write_shards", f"val_fraction must be in [0, 1) (got {val_fraction})")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(str(out_dir), "output directory is an existing file")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(str(out_dir), f"cannot create output directory ({e.strerror or e})") from None


def check_shard_prefix(prefix: str) -> None:
    """A shard name prefix must be a plain file name: shards are ``out_dir/{prefix}-{split}-NNNNNN.tar``,
    listed by name next to the manifest. A prefix holding a directory (``sub/x``), or empty, ``.``
    or ``..``, would put them elsewhere or nowhere, and would fail only after the old manifest is
    gone."""
    has_dir = any(sep and sep in prefix for sep in ("/", os.sep, os.altsep))
    if has_dir or prefix in ("", ".", "..") or "\0" in prefix:
        raise DataError("write_shards", f"prefix must be a plain file name, without a directory (got {prefix!r})")
    problem = shard_name_problem(f"{prefix}-train-000000.tar")
    if problem:  # its shards would be refused when the manifest is read
        raise DataError("write_shards", f"prefix {prefix!r}: a shard name it makes {problem}")


def write_shards(documents: Iterable[str] | list[Path], tokenizer: Tokenizer, out_dir: Path, seq_length: int,
                 samples_per_shard: int | None = None, shard_max_bytes: int | None = None,
                 val_fraction: float = 0.05, prefix: str = "shard", *, num_threads: int = 1,
                 progress: bool = True, text_field: str = DEFAULT_TEXT_FIELD) -> Manifest:
    """Tokenize ``documents``, pack into ``seq_length + 1``-token samples, write train/val shards and
    ``out_dir/manifest.json``; return the manifest.

    Shards are named ``{prefix}-{split}-{i:06d}.tar`` (numbered per split, so brace patterns like
    ``shard-train-{000000..000009}.tar`` work). Nothing in ``out_dir`` changes until every shard
    has been written successfully.
    """
    out_dir = Path(out_dir)
    tokenizer.check_document_separator()
    check_shard_settings(out_dir, seq_length, val_fraction, samples_per_shard, shard_max_bytes, prefix)
    dtype = token_dtype(tokenizer.padded_vocab_size)
    sample_len = seq_length + 1
    capacity = _samples_per_shard(samples_per_shard, shard_max_bytes, sample_len, dtype)
    meta = {"tokenizer_sha256": tokenizer.sha256, "seq_length": seq_length, "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size}
    tmp_dir = run_temp_dir(out_dir, "shards")
    try:
        with writing_into(out_dir):  # a full disk: one line; input errors are DataErrors already
            written, n_docs, dropped = _write_tmp_shards(documents, tokenizer, tmp_dir, capacity, sample_len,
                                                         dtype, meta, num_threads, progress, text_field)
        if not written:
            raise DataError(str(out_dir), f"documents gave fewer than {sample_len} tokens: not one sample to write")
        return commit(written, tmp_dir, out_dir, prefix, val_fraction, seq_length=seq_length,
                      tokenizer_sha256=tokenizer.sha256, vocab_size=tokenizer.vocab_size,
                      padded_vocab_size=tokenizer.padded_vocab_size, eos_id=tokenizer.eos_id,
                      pad_id=tokenizer.pad_id, dtype=dtype.name, num_documents=n_docs, dropped_tokens=dropped)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def commit(written, tmp_dir: Path, out_dir: Path, prefix: str, val_fraction: float, **fields) -> Manifest:
    """Publish the shards written in ``tmp_dir`` with a manifest of ``fields``: :func:`_finalize`, the
    manifest's save and :func:`remove_stale_shards`; return the manifest. Both writers (this
    module's and :mod:`.parallel`'s merge) end here.

    SIGTERM and SIGINT are held back until all three are done (``_io.signals_deferred``): a polite
    stop between the old manifest's removal and the new one's save would leave new shards, old
    shards and no manifest; held back, it stops the process just after, the new dataset complete."""
    with signals_deferred():
        restore_cut_short(out_dir)  # an earlier write killed midway: its old dataset back first
        manifest = Manifest(shards=_finalize(written, tmp_dir, out_dir, prefix, val_fraction), **fields)
        manifest.save(out_dir / MANIFEST_NAME)
        drop_previous(out_dir)
        remove_stale_shards(out_dir, prefix, manifest)
    return manifest


def own_shard_names(prefix: str):
    """Whether a file name is one of this tool's shard names under ``prefix``."""
    pattern = re.compile(rf"{re.escape(prefix)}-(train|val)-\d{{6,}}\.tar")
    return lambda name: pattern.fullmatch(name) is not None


def remove_stale_shards(out_dir: Path, prefix: str, manifest: Manifest) -> int:
    """Delete the ``{prefix}-{train,val}-NNNNNN.tar`` files in ``out_dir`` that ``manifest`` (just
    written there) does not list, and return how many. A re-shard into an old directory would
    otherwise leave the old run's extra shards behind for a glob or brace pattern to read as data.
    Only this tool's own shard names are touched; any other file is left alone."""
    own = own_shard_names(prefix)
    listed = {s.name for s in manifest.shards}
    stale = sorted(p for p in Path(out_dir).iterdir()
                   if own(p.name) and p.name not in listed and not p.is_dir())
    for path in stale:
        try:
            path.unlink()
        except OSError as e:
            raise DataError(str(path), f"cannot remove stale shard not in the new manifest ({e.strerror or e})") \
                from None
    if stale:
        log.warning("%s: removed %d old shard file(s) the new manifest does not list (%s ... %s)",
                    out_dir, len(stale), stale[0].name, stale[-1].name)
    return len(stale)


def _write_tmp_shards(documents, tokenizer, tmp_dir, capacity, sample_len, dtype, meta, num_threads, progress,
                      text_field=DEFAULT_TEXT_FIELD):
    """Stream documents through the tokenizer and packer; write each full shard to ``tmp_dir``.

    Returns (list of (tmp_path, ShardInfo without name/split), documents seen, dropped tokens).
    """
    packer = _Packer(tokenizer.eos_id, sample_len)
    pending: list[np.ndarray] = []
    written = []
    n_docs = 0
    bar = tqdm(desc="shard: tokenizing", unit="B", unit_scale=True, disable=not progress)
    for ids, end, text_bytes in encoded_documents(_documents(documents, text_field), tokenizer, num_threads):
        n_docs += end
        bar.update(text_bytes)
        pending.extend(packer.add(ids, end))
        while len(pending) >= capacity:
            written.append(_flush(pending[:capacity], tmp_dir, len(written), dtype, meta))
            del pending[:capacity]
    bar.close()
    if pending:
        written.append(_flush(pending, tmp_dir, len(written), dtype, meta))
    return written, n_docs, packer.leftover


def _flush(samples, tmp_dir: Path, index: int, dtype, meta):
    """Write one shard's tar into the temp dir, fsynced; checksum computed from the exact bytes written."""
    data = encode_shard(samples, dtype, meta)
    path = tmp_dir / f"{index:06d}.tar"
    write_durably(path, data)  # on disk before _finalize moves it under a name the manifest lists
    info = ShardInfo(name="", split="", num_samples=len(samples), num_tokens=len(samples) * len(samples[0]),
                     sha256=sha256_bytes(data), bytes=len(data))
    return path, info


def _finalize(written, tmp_dir: Path, out_dir: Path, prefix: str, val_fraction: float) -> list[ShardInfo]:
    """Assign splits, name the shards and move them from the temp dir into ``out_dir`` (the old
    dataset moved aside first: :func:`.replace.set_aside_old`), for :func:`commit`, which then saves
    the new manifest.

    Whatever can fail short of an I/O error fails before the old manifest goes: each shard is first
    renamed to its final name inside the temp dir (a name the file system refuses stops here, the
    old dataset untouched) and no final name may be an existing directory. An OSError after that is
    a one-line DataError saying the dataset needs the build run again.

    Durability (see :mod:`._io`): the writers fsynced every shard's bytes in the temp dir; the old
    dataset's move aside is made durable before the first move in, and the moves before the new
    manifest is written, so after a power loss no manifest names shards whose data or names did
    not reach the disk, and the old dataset is whole in its folder aside."""

    staged = _stage_final_names(written, tmp_dir, prefix, val_shard_indices(len(written), val_fraction))
    for info, _ in staged:
        if (out_dir / info.name).is_dir():
            raise DataError(str(out_dir / info.name), "cannot write shard: a directory has its name")
    set_aside_old(out_dir, own_shard_names(prefix))
    try:
        for info, path in staged:
            where = out_dir / info.name
            os.replace(path, where)
        where = out_dir
        fsync_dir(out_dir)
    except OSError as e:
        raise DataError(str(where), f"cannot move the new shards into place ({e.strerror or e}); the old "
                                    "dataset is kept aside: run the build again to put it back") from None
    return [info for info, _ in staged]


def _stage_final_names(written, tmp_dir: Path, prefix: str, val: set[int]) -> list[tuple[ShardInfo, Path]]:
    """Name each shard ``{prefix}-{split}-NNNNNN.tar`` (numbered per split) and rename it to that name
    inside ``tmp_dir``; returns (info, staged path) in corpus order. A failing rename is a one-line
    DataError while ``out_dir`` is still as it was."""
    counters = {"train": 0, "val": 0}
    staged = []
    for i, (path, info) in enumerate(written):
        info.split = "val" if i in val else "train"
        info.name = f"{prefix}-{info.split}-{counters[info.split]:06d}.tar"
        counters[info.split] += 1
        try:
            os.replace(path, tmp_dir / info.name)
        except OSError as e:
            raise DataError(info.name, f"cannot name a shard so ({e.strerror or e}); nothing in the output "
                                       "directory was changed") from None
        staged.append((info, tmp_dir / info.name))
    return staged


