"""Reading documents out of every corpus format the pipeline accepts, streamed.

Formats (chosen by file name; a directory or glob expands to the files below it, sorted):

* ``.txt`` / ``.text`` / ``.md`` (and any unknown suffix given explicitly): one document per file
  (a file over ``LONG_TEXT_BYTES`` comes as :class:`TextParts`, read and tokenized in parts);
* ``.jsonl`` / ``.json`` (one JSON object per line), also ``.jsonl.gz`` and ``.jsonl.zst``
  (decompressed as a stream, never whole in memory): the string field ``text_field`` per line;
* ``.parquet`` (pyarrow, read one record batch at a time): the column ``text_field`` per row;
* a directory written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``: every split, in
  the order ``dataset_dict.json`` lists them): the column ``text_field`` per row;
* ``.tar`` / ``.tar.gz`` / ``.tgz`` text shards: members ``*.txt`` / ``*.text`` / ``*.md`` (one document
  each), ``*.json`` (one object with ``text_field``, as webdataset writes) or ``*.jsonl`` / ``*.ndjson``
  (JSON lines, as above); a member of any other type is an error, never silently skipped.

Every problem is a one-line :class:`DataError` naming the file and the line (``path:17``) or row
(``path:row 17``), so a bad record in a 20 GB corpus is found without a traceback.

A file can also be read from a *part* of it, so several processes or nodes can share one big
file (see :mod:`data_pipeline.parallel`): a ``.jsonl`` by byte range (a line belongs to the range
holding its first byte), a ``.parquet`` by row-group range. Other formats are read whole.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from ._io import file_identity
from .errors import DataError
from .fast_shard import open_tar, tar_has_end_marker

DEFAULT_TEXT_FIELD = "text"
_JSONL = (".jsonl", ".json", ".ndjson")
_TEXT = (".txt", ".text", ".md")
_TAR = (".tar", ".tar.gz", ".tgz")
_READ_CHUNK = 1 << 20
_PARQUET_BATCH_ROWS = 1024
LONG_TEXT_BYTES = 64 << 20  # a text file above this is one document read in parts (TextParts)
TEXT_PART_BYTES = 16 << 20  # the size a part of a TextParts document grows to before it ends at a newline


# --------------------------------------------------------------------------- what a path is
def kind_of(path: Path) -> str:
    """The format of one input: jsonl, jsonl.gz, jsonl.zst, parquet, tar, datasets or text."""
    name = path.name.lower()
    if path.is_dir():
        return "datasets" if is_datasets_dir(path) else "dir"
    for ext in _JSONL:
        if name.endswith(ext):
            return "jsonl"
        if name.endswith(ext + ".gz"):
            return "jsonl.gz"
        if name.endswith(ext + ".zst"):
            return "jsonl.zst"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_TAR):
        return "tar"
    return "text"


def is_datasets_dir(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file() \
        or (path / "dataset_dict.json").is_file()


def _known_in_directory(path: Path) -> bool:
    """Files a directory walk picks up (explicitly named files of any suffix are read as text)."""
    return kind_of(path) != "text" or path.name.lower().endswith(_TEXT)


def expand_inputs(inputs: Iterable[Path | str], seen: Optional[dict[str, Path]] = None) -> list[Path]:
    """Files (and ``datasets`` directories) named by ``inputs``, in order: a glob expands to its
    sorted matches, a plain directory to the known-format files below it (sorted by relative path,
    hidden entries skipped). A missing path, a glob matching nothing, or one file reached twice (named
    twice, a directory and a file in it, a symlink to another input) is a DataError: read twice, its
    documents would be in the corpus twice. ``seen`` (file identity -> path) carries the files of
    earlier calls, for inputs given one at a time."""
    out: list[Path] = []
    for item in inputs:
        text = str(item)
        if any(c in text for c in "*?[") and not Path(text).exists():
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise DataError(text, "no input files match this pattern")
            out.extend(_expand_one(Path(m)) for m in matches)
        else:
            out.append(_expand_one(Path(text)))
    files = [p for group in out for p in group]
    _refuse_one_file_twice(files, {} if seen is None else seen)
    return files


def _refuse_one_file_twice(files: list[Path], seen: dict[str, Path]) -> None:
    """A DataError naming both spellings of the first file (:func:`._io.file_identity`) listed twice
    (in ``files``, or once there and once in ``seen``, which is extended)."""
    for path in files:
        first = seen.setdefault(file_identity(path), path)
        if first is not path:
            same = "named twice" if first == path else f"the same file as {first}"
            raise DataError(str(path), f"input {same}: its documents would be read twice")


def _expand_one(path: Path) -> list[Path]:
    """One existing path as a list of readable inputs."""
    if not path.exists():
        raise DataError(str(path), "input file does not exist")
    if not path.is_dir() or is_datasets_dir(path):
        return [path]
    found: list[Path] = []
    for root, dirs, files in os.walk(path):
        root_path = Path(root)
        keep = []
        for d in sorted(dirs):
            if d.startswith("."):
                continue
            if is_datasets_dir(root_path / d):
                found.append(root_path / d)
            else:
                keep.append(d)
        dirs[:] = keep
        found.extend(root_path / f for f in files if not f.startswith(".") and _known_in_directory(root_path / f))
    found.sort(key=lambda p: p.relative_to(path).as_posix())
    if not found:
        raise DataError(str(path), "directory holds no input files of a known format")
    return found


# --------------------------------------------------------------------------- a piece of an input
@dataclass(frozen=True)
class Piece:
    """An input file, or the part of it one worker reads: bytes ``[lo, hi)`` of a ``.jsonl``, row
    groups ``[lo, hi)`` of a ``.parquet`` (``hi = -1``: to the end)."""

    path: str
    lo: int = 0
    hi: int = -1

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == -1


def iter_piece(piece: Piece, text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str | "TextParts"]:
    """Documents of one piece, streamed: str, or TextParts for a long plain-text file."""
    path = Path(piece.path)
    kind = kind_of(path)
    if kind == "jsonl":
        return iter_jsonl_texts(path, text_field, piece.lo, piece.hi)
    if kind in ("jsonl.gz", "jsonl.zst"):
        return _iter_json_lines(path, _open_compressed(path, kind), text_field)
    if kind == "parquet":
        return iter_parquet_texts(path, text_field, piece.lo, piece.hi)
    if kind == "datasets":
        return iter_datasets_texts(path, text_field)
    if kind == "tar":
        return iter_tar_texts(path, text_field)
    if kind == "dir":
        raise DataError(str(path), "a directory must be expanded first (expand_inputs)")
    return iter([text_document(path)])


def iter_documents(inputs: Iterable[Path | str], text_field: str = DEFAULT_TEXT_FIELD,
                   seen: Optional[dict[str, Path]] = None) -> Iterator[str | "TextParts"]:
    """Every document of ``inputs`` (files, directories, globs), in order (see iter_piece); ``seen``
    as in :func:`expand_inputs`."""
    for path in expand_inputs(inputs, seen):
        yield from iter_piece(Piece(str(path)), text_field)


# --------------------------------------------------------------------------- plain text
def read_text_file(path: Path) -> str:
    """A whole text file as str, its bytes decoded as they are: no newline translation, so ``\\r\\n``
    and ``\\r`` stay as the tokenizer trainer, tar members and JSON lines see them. A file that is
    not UTF-8 is a one-line DataError naming it."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(str(path), f"cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(str(path), f"not valid UTF-8 (byte {e.start}: {e.reason})") from None


def text_document(path: Path) -> "str | TextParts":
    """A plain-text file as one document: its text (read_text_file), or TextParts when it is over
    LONG_TEXT_BYTES (its tokens would take 10-15x its size in memory if it were encoded whole)."""
    try:
        size = Path(path).stat().st_size
    except OSError as e:
        raise DataError(str(path), f"cannot read ({e.strerror or e})") from None
    return TextParts(Path(path), size) if size > LONG_TEXT_BYTES else read_text_file(path)


class TextParts:
    """One document, a long plain-text file, as consecutive parts of its text: each part but the
    last ends just after a newline, once it holds ``part_bytes`` bytes (a line longer than that
    stays whole in its part). Iterating reads the file again, in blocks; a consumer that encodes
    part by part needs memory for one part, not the file (:meth:`Tokenizer.encode_parts` gives the
    tokens of the whole text). ``nbytes``: the file's size."""

    def __init__(self, path: Path, nbytes: int, part_bytes: int | None = None):
        self.path, self.nbytes = Path(path), nbytes
        self.part_bytes = TEXT_PART_BYTES if part_bytes is None else part_bytes

    def __iter__(self) -> Iterator[str]:
        offset = 0  # of the current part's first byte in the file, for the error message
        for raw in self._raw_parts():
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(str(self.path), f"not valid UTF-8 (byte {offset + e.start}: {e.reason})") from None
            offset += len(raw)

    def _raw_parts(self) -> Iterator[bytes]:
        buf = bytearray()
        last_newline = -1  # in buf (each block searched once: a long line costs linear time)
        with _open_binary(self.path) as f:
            while block := f.read(_READ_CHUNK):
                found = block.rfind(b"\n")
                if found >= 0:
                    last_newline = len(buf) + found
                buf += block
                if len(buf) >= self.part_bytes and last_newline >= 0:  # a newline byte is never inside a character
                    yield bytes(buf[: last_newline + 1])
                    del buf[: last_newline + 1]
                    last_newline = -1
        if buf:
            yield bytes(buf)

    def __repr__(self) -> str:
        return f"TextParts({str(self.path)!r}, {self.nbytes})"


def iter_text_lines(path: Path) -> Iterator[str]:
    """A text file line by line (newlines kept), for consumers that do not need whole documents."""
    f = _open_binary(path)
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}", f"not valid UTF-8 (byte {e.start}: {e.reason})") from None


def _open_binary(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(str(path), f"cannot read ({e.strerror or e})") from None


# --------------------------------------------------------------------------- JSON lines
class _BadRecord(Exception):
    """A JSON line that is not an object with the text field (the caller adds file and line)."""


def _parse_json_line(raw: bytes, field: str) -> str | None:
    """The string ``field`` of one JSON line (None for a blank line); _BadRecord says what is wrong."""
    if not raw.strip():
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadRecord(f"not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadRecord(f"invalid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit; nesting past the stack
        raise _BadRecord(f"JSON this reader cannot hold ({_too_big(e)})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise _BadRecord(f'expected an object with a string field "{field}"')
    if "\\u" in line:  # only a \uXXXX escape can put a surrogate into a str decoded from UTF-8
        _check_no_surrogate(obj[field], field)
    return obj[field]


_SURROGATE = re.compile("[\\ud800-\\udfff]")


def lone_surrogate(text: str):
    """The first lone UTF-16 surrogate in ``text`` (a re.Match: no Unicode character, it cannot be
    UTF-8 encoded), or None."""
    return _SURROGATE.search(text)


def _check_no_surrogate(text: str, field: str) -> None:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``), which is no Unicode character and
    cannot be UTF-8 encoded: refuse it here (_BadRecord) rather than crash the tokenizer later."""
    found = lone_surrogate(text)
    if found:
        raise _BadRecord(f'lone surrogate \\u{ord(found.group()):04x} at character {found.start()} of field '
                         f'"{field}" is not valid Unicode')


def iter_jsonl_texts(path: Path, field: str = DEFAULT_TEXT_FIELD, lo: int = 0, hi: int = -1) -> Iterator[str]:
    """The ``field`` of every JSON line whose first byte lies in ``[lo, hi)`` (``hi=-1``: end of file).

    Line numbers in errors count from the file's start (counted only when an error is reported)."""
    f = _open_binary(path)
    with f:
        if lo > 0:
            f.seek(lo - 1)
            if f.read(1) != b"\n":  # lo is inside a line: that line belongs to the previous range
                f.readline()
        start = pos = f.tell()
        index = 0  # lines read in this range
        while hi < 0 or pos < hi:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            try:
                text = _parse_json_line(raw, field)
            except _BadRecord as e:
                raise DataError(f"{path}:{_count_newlines(f, start) + 1 + index}", str(e)) from None
            index += 1
            if text is not None:
                yield text


def _count_newlines(f, end: int) -> int:
    """Newlines in the first ``end`` bytes of ``f`` (line numbers of a range that starts mid-file)."""
    f.seek(0)
    count, left = 0, end
    while left > 0:
        block = f.read(min(_READ_CHUNK, left))
        if not block:
            break
        count += block.count(b"\n")
        left -= len(block)
    return count


def _open_compressed(path: Path, kind: str):
    """A binary line-iterable stream of a ``.gz`` / ``.zst`` file.

    An empty file holds no gzip member / zstd frame at all, which both decompressors read as an
    empty stream: refused, as a cut-off download it most likely is (a compressed empty corpus is
    still a header and an end marker, not zero bytes)."""
    f = _open_binary(path)
    if not f.peek(1):
        f.close()
        unit = "gzip member" if kind == "jsonl.gz" else "zstd frame"
        raise DataError(str(path), f"truncated or corrupt compressed stream before its first line (empty file: "
                                   f"no {unit})")
    if kind == "jsonl.gz":
        return gzip.GzipFile(fileobj=f, mode="rb")
    return io.BufferedReader(_ZstdStream(f, str(path)), buffer_size=_READ_CHUNK)


def _iter_json_lines(path: Path | str, stream, field: str) -> Iterator[str]:
    """JSON lines of a (decompressing) stream; a bad record names ``path`` (a file, or
    ``archive:member``) and its line, a truncated or corrupt stream ``path`` and the last line read
    whole (the stream is decoded in blocks ahead of the lines, so no line of its own is to blame)."""
    lineno = 0
    with stream:
        try:
            for lineno, raw in enumerate(stream, 1):
                try:
                    text = _parse_json_line(raw, field)
                except _BadRecord as e:
                    raise DataError(f"{path}:{lineno}", str(e)) from None
                if text is not None:
                    yield text
        except (EOFError, OSError, zlib.error, _ZstdCorrupt) as e:
            problem = str(e) or type(e).__name__
            after = f" after line {lineno}" if lineno else " before its first line"
            raise DataError(str(path), f"truncated or corrupt compressed stream{after} ({problem})") from None


class _ZstdCorrupt(Exception):
    """A zstd stream that ends inside a frame or does not decode."""


class _ZstdStream(io.RawIOBase):
    """Raw stream of the decompressed bytes of a (multi-frame) zstd file, read in chunks.

    zstandard's own stream reader returns a short read at a truncated end without complaint; here
    each frame's decompressor must reach its end marker, else the read raises, so a cut-off
    download is an error instead of a silently shorter corpus.
    """

    def __init__(self, raw, name: str):
        try:
            import zstandard
        except ImportError:
            raise DataError(name, "reading .zst needs the zstandard package (pip install 'ascender-dist[data]')") \
                from None
        self._zstd = zstandard
        self._raw = raw
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        self._started = False  # current frame has received input
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            chunk = self._raw.read(_READ_CHUNK)
            if not chunk:
                if self._started and not self._dobj.eof:
                    raise _ZstdCorrupt("stream ends inside a zstd frame")
                return 0
            self._pending = self._feed(chunk)
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _feed(self, chunk: bytes) -> bytes:
        """Decompress ``chunk``, starting a new frame decompressor after each frame's end."""
        out = []
        while chunk:
            try:
                out.append(self._dobj.decompress(chunk))
            except self._zstd.ZstdError as e:
                raise _ZstdCorrupt(str(e)) from None
            self._started = True
            if not self._dobj.eof:
                break
            chunk = self._dobj.unused_data
            self._dobj = self._zstd.ZstdDecompressor().decompressobj()
            self._started = False
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


# --------------------------------------------------------------------------- parquet
def parquet_file(path: Path):
    """An open ``pyarrow.parquet.ParquetFile``; unreadable files are one-line DataErrors."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(str(path), "reading .parquet needs pyarrow (pip install 'ascender-dist[data]')") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid, OSError ...
        raise DataError(str(path), f"unreadable parquet file ({type(e).__name__}: {_first_line(e)})") from None


def iter_parquet_texts(path: Path, field: str = DEFAULT_TEXT_FIELD, lo: int = 0, hi: int = -1) -> Iterator[str]:
    """The string column ``field`` of row groups ``[lo, hi)``, one record batch in memory at a time."""
    pf = parquet_file(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(str(path), f'no column "{field}" (columns: {names}; choose one with --text-field)')
    groups = list(range(pf.num_row_groups))[lo:None if hi < 0 else hi]
    if not groups:
        return
    row = sum(pf.metadata.row_group(g).num_rows for g in range(groups[0]))
    try:
        batches = pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[field])
        for batch in batches:
            yield from _column_texts(path, batch.column(0).to_pylist(), row)
            row += batch.num_rows
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}:row {row}", f"unreadable parquet data ({type(e).__name__}: {_first_line(e)})") \
            from None


def _column_texts(path, values: list, first_row: int) -> Iterator[str]:
    """Values of a text column; a null or a non-string names the row."""
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise DataError(f"{path}:row {first_row + i}", f"text value must be a string (got {type(value).__name__})")
        yield value


# --------------------------------------------------------------------------- datasets.save_to_disk
def iter_datasets_texts(path: Path, field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """The column ``field`` of a ``datasets`` directory (memory-mapped Arrow, read in batches)."""
    try:
        import datasets
    except ImportError:
        raise DataError(str(path), "reading a datasets directory needs `datasets` (pip install 'ascender-dist[data]')") \
            from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(str(path), f"unreadable datasets directory ({type(e).__name__}: {_first_line(e)})") from None
    parts = list(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, ds in parts:
        where = f"{path}[{split}]" if split else str(path)
        if field not in ds.column_names:
            raise DataError(where, f'no column "{field}" (columns: {ds.column_names}; choose one with --text-field)')
        column = ds.select_columns([field])
        for start in range(0, len(column), _PARQUET_BATCH_ROWS):
            values = column[start:start + _PARQUET_BATCH_ROWS][field]
            yield from _column_texts(where, values, start)


# --------------------------------------------------------------------------- tar text shards
_TAR_MEMBER_KINDS = {**{ext: "text" for ext in _TEXT}, ".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def iter_tar_texts(path: Path, field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """Texts of a webdataset-style text shard, member by member in archive order (see the module
    docstring for the member types; directories and links hold no text and are passed over).

    The archive must end with its end-of-archive marker: Python's tarfile reads a tar cut off at a
    member boundary as a whole, shorter one, and the lost documents would go unnoticed. In a
    compressed tar the decompressed stream must end so; a cut in the compressed file itself is the
    decompressor's end-of-stream error. The documents before the missing marker have been yielded
    by then (as with any error met mid-file, the run stops)."""
    try:
        with open_tar(path) as tf:
            for member in tf:
                if member.isreg():
                    yield from _tar_member_texts(path, tf, member, field)
            whole = tar_has_end_marker(tf)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DataError(str(path), f"truncated or corrupt tar ({e})") from None
    if not whole:
        raise DataError(str(path), "truncated tar (no end-of-archive marker)")


def _tar_member_texts(path: Path, tf: tarfile.TarFile, member: tarfile.TarInfo, field: str) -> Iterator[str]:
    """Documents of one regular tar member, read as a file of the same type would be; a member of
    a type no reader takes is a DataError (a skipped member would be silently lost data)."""
    where = f"{path}:{member.name}"
    name = member.name.lower()
    kind = next((k for ext, k in _TAR_MEMBER_KINDS.items() if name.endswith(ext)), None)
    if kind is None:
        raise DataError(where, f"unsupported tar member type (supported: {', '.join(_TAR_MEMBER_KINDS)})")
    stream = tf.extractfile(member)
    if kind == "jsonl":
        yield from _iter_json_lines(where, stream, field)
        return
    try:
        text = stream.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(where, f"not valid UTF-8 (byte {e.start})") from None
    if kind == "json":
        text = _json_member_text(where, text, field)
    yield text


def _too_big(error: Exception) -> str:
    """What made a JSON record unreadable though well-formed: a huge integer or deep nesting."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return "an integer with too many digits" if "digits" in str(error) else " ".join(str(error).split())[:80]


def _json_member_text(where: str, text: str, field: str) -> str:
    """The string ``field`` of a tar ``.json`` member (one object, as webdataset writes)."""
    try:
        value = json.loads(text)[field]
        if not isinstance(value, str):
            raise TypeError(value)
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(where, f'invalid JSON or no string "{field}" field') from None
    except (ValueError, RecursionError) as e:  # as in _parse_json_line
        raise DataError(where, f"JSON this reader cannot hold ({_too_big(e)})") from None
    try:
        _check_no_surrogate(value, field)
    except _BadRecord as e:
        raise DataError(where, str(e)) from None
    return value


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
