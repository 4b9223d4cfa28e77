"""Fast reading of the shards this pipeline writes, the loader's hot path.

The shards written by ``encode_shard`` have one regular layout: per sample a 512-byte header and
a ``.npy`` of identical header and size, one ``meta.json`` after the first sample. Two uses of it:

* :func:`decode_regular_shard`: a scan of the headers plus one numpy gather decodes a whole shard
  in memory (Python's tarfile / webdataset plus ``np.load`` per sample costs ~80 us per sample).
  Used where a rank needs a whole shard (one data-parallel rank, or shards behind pipes/URLs).
* :func:`probe_layout` / :class:`RegularLayout`: from the first members, the offset of every
  sample, so a data-parallel rank reads only its own samples with positioned reads.

Anything that does not match that layout exactly (other member names, sizes, npy headers, a
truncated archive, ...) returns None and the caller takes the general webdataset path on the
whole shard, which also produces the precise error message. So this module never decides that
a shard is bad.

:func:`is_end_of_archive` / :func:`open_tar` + :func:`tar_has_end_marker` are the one test of a tar's end marker,
shared with the general path and the corpus reader (:mod:`.formats`), which must refuse a tar cut
off at a member boundary that Python's tarfile would read as a shorter, whole one.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np

_BLOCK = 512
END_OF_ARCHIVE = 2 * _BLOCK  # the two zero blocks after the last member


def is_end_of_archive(blocks: bytes) -> bool:
    """Whether ``blocks`` are the two zero blocks that end a tar archive. A tar cut off exactly at
    a member boundary lacks them and is otherwise indistinguishable from a shorter, whole archive."""
    return len(blocks) == END_OF_ARCHIVE and blocks.count(0) == END_OF_ARCHIVE


class _EndNotingInfo(tarfile.TarInfo):
    """tarfile's member header reader, noting on the TarFile where it met a zero block (the first
    half of the end-of-archive marker): tarfile ends its member list there, and also at end of file
    or an unreadable header, without telling which."""

    @classmethod
    def fromtarfile(cls, tf: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tf)
        except tarfile.EOFHeaderError:
            tf.zero_block_at = tf.fileobj.tell() - _BLOCK
            raise


def open_tar(name=None, fileobj=None) -> tarfile.TarFile:
    """A tar archive (compressed or not, as tarfile's ``"r:*"`` detects) opened for reading so that
    :func:`tar_has_end_marker` can tell, once its members are read, whether it is whole."""
    return tarfile.open(name, "r:*", fileobj=fileobj, tarinfo=_EndNotingInfo)


def tar_has_end_marker(tf: tarfile.TarFile) -> bool:
    """Whether ``tf`` (from :func:`open_tar`, its members read to the end) ends with the
    end-of-archive marker, where the members stop.

    Python's tarfile ends the member list without complaint at end of file on a member boundary,
    and at an unreadable header after the first, so a cut-off tar reads as a shorter, whole one;
    only the two zero blocks tell. For a compressed archive this checks the decompressed stream,
    which is then read to its end (normally a few KiB of record padding) so that the decompressor's
    own end-of-stream checks (a cut-off file, a checksum) run too: their errors (EOFError, OSError,
    zlib.error, ...) are the caller's to word. Reads forward only: a seek back in a compressed
    stream may decompress it again from the start."""
    first_zero = getattr(tf, "zero_block_at", None) == tf.offset
    whole = first_zero and is_end_of_archive(bytes(_BLOCK) + tf.fileobj.read(_BLOCK))
    while tf.fileobj.read(1 << 20):
        pass
    return whole


def _member(data: bytes, pos: int) -> tuple[bytes, int] | None:
    """(name, size) of the USTAR header at ``pos``; None for an end block or anything unusual."""
    hdr = data[pos:pos + _BLOCK]
    if len(hdr) < _BLOCK or hdr[0] == 0:
        return None
    if hdr[156:157] not in (b"0", b"\0") or hdr[345:346] != b"\0":  # regular file, no name prefix
        return None
    try:
        size = int(hdr[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None
    return hdr[:100].split(b"\0", 1)[0], size


def decode_regular_shard(data: bytes, seq_length: int) -> tuple[np.ndarray, bytes | None] | None:
    """``([num_samples, seq_length + 1] token array, meta.json bytes or None)``, or None when
    ``data`` is not a shard of the exact layout ``encode_shard`` writes."""
    starts: list[int] = []
    size0 = None
    meta = None
    last_key = None
    pos = 0
    while True:
        m = _member(data, pos)
        if m is None:
            break
        name, size = m
        start = pos + _BLOCK
        pos = start + -(-size // _BLOCK) * _BLOCK
        if pos > len(data):
            return None
        key, _, field = name.partition(b".")
        if field == b"tokens.npy":
            if key == last_key or size0 is not None and size != size0:
                return None
            size0, last_key = size, key
            starts.append(start)
        elif field == b"meta.json" and len(starts) == 1 and key == last_key and meta is None:
            meta = data[start:start + size]
        else:
            return None
    if not starts or not is_end_of_archive(data[pos:pos + END_OF_ARCHIVE]):
        return None
    header = data[starts[0]:starts[0] + size0]
    try:
        f = io.BytesIO(header)
        shape, fortran, dtype = _read_header(f, np.lib.format.read_magic(f))
    except ValueError:
        return None
    hlen = f.tell()
    n_tokens = seq_length + 1
    if fortran or shape != (n_tokens,) or dtype.kind not in "iu" or hlen + dtype.itemsize * n_tokens != size0:
        return None
    npy_header = header[:hlen]
    out = np.empty((len(starts), n_tokens), dtype=dtype)
    for i, start in enumerate(starts):
        if data[start:start + hlen] != npy_header:  # every sample's npy header must be the same
            return None
        out[i] = np.frombuffer(data, dtype=dtype, count=n_tokens, offset=start + hlen)
    return out, meta


def _read_header(f, version) -> tuple:
    """(shape, fortran_order, dtype) of an ``.npy`` header, through numpy's public readers."""
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"npy version {version}")


# --------------------------------------------------------------------------- random access
class RegularLayout:
    """Where each sample of a shard in ``encode_shard``'s layout lies, from its first members only.

    In that layout sample ``i`` is one 512-byte header plus an ``.npy`` member of the same size
    for every sample, and sample 0 is followed by its ``meta.json`` member; so the header of
    sample ``i >= 1`` sits at ``first + (i - 1) * stride``, and a data-parallel rank can read just
    the samples it needs with positioned reads instead of decoding the whole shard.
    """

    def __init__(self, member_size: int, npy_header: bytes, dtype: np.dtype, n_tokens: int,
                 meta: bytes | None, first: int):
        self.member_size, self.npy_header, self.dtype, self.n_tokens = member_size, npy_header, dtype, n_tokens
        self.meta, self.first = meta, first
        self.stride = _BLOCK + _padded(member_size)

    def header_offset(self, i: int) -> int:
        """Byte offset of sample ``i``'s tar header."""
        return 0 if i == 0 else self.first + (i - 1) * self.stride

    def read_row(self, read, i: int) -> np.ndarray | None:
        """Tokens of sample ``i`` through ``read(offset, length) -> bytes``; None when the bytes
        there are not that sample's header and ``.npy`` (the shard changed under its layout)."""
        pos = self.header_offset(i)
        buf = read(pos, _BLOCK + self.member_size)
        m = _member(buf, 0)
        if m is None or m[1] != self.member_size or m[0].partition(b".")[2] != b"tokens.npy":
            return None
        hlen = len(self.npy_header)
        if buf[_BLOCK:_BLOCK + hlen] != self.npy_header or len(buf) < _BLOCK + self.member_size:
            return None
        return np.frombuffer(buf, dtype=self.dtype, count=self.n_tokens, offset=_BLOCK + hlen)


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def probe_layout(read, size: int, num_samples: int, seq_length: int) -> RegularLayout | None:
    """The :class:`RegularLayout` of a shard of ``size`` bytes said to hold ``num_samples`` samples,
    read through ``read(offset, length) -> bytes`` (a few small reads: the first two members and
    the end-of-archive blocks); None when the shard is not exactly that layout with that count."""
    m0 = _member(read(0, _BLOCK), 0)
    if m0 is None or m0[0].partition(b".")[2] != b"tokens.npy" or num_samples < 1:
        return None
    key0, member_size = m0[0].partition(b".")[0], m0[1]
    npy = read(_BLOCK, min(member_size, 4096))
    try:
        f = io.BytesIO(npy)
        shape, fortran, dtype = _read_header(f, np.lib.format.read_magic(f))
    except ValueError:
        return None
    hlen, n_tokens = f.tell(), seq_length + 1
    if fortran or shape != (n_tokens,) or dtype.kind not in "iu" or hlen + dtype.itemsize * n_tokens != member_size:
        return None
    first, meta = _BLOCK + _padded(member_size), None
    m1 = _member(read(first, _BLOCK), 0)
    if m1 is not None and m1[0] == key0 + b".meta.json":
        meta = read(first + _BLOCK, m1[1])
        first += _BLOCK + _padded(m1[1])
    layout = RegularLayout(member_size, npy[:hlen], dtype, n_tokens, meta, first)
    end = layout.header_offset(num_samples)
    if end + END_OF_ARCHIVE > size or not is_end_of_archive(read(end, END_OF_ARCHIVE)):  # exactly num_samples members
        return None
    if any(layout.read_row(read, i) is None for i in {1, num_samples - 1} if 0 < i < num_samples):
        return None  # other members between samples (the stride is wrong even if the end matched)
    if num_samples > 1 and read(layout.header_offset(1), 100).split(b"\0", 1)[0].partition(b".")[0] == key0:
        return None  # two samples under one key: webdataset would not read them as two
    return layout
