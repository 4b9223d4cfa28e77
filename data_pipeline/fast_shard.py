"""Vectorised decoding of the shards this pipeline writes, the loader's hot path.

Why: every data-parallel rank decodes every shard of the epoch (see loader.py), so decoding cost
is multiplied by the data-parallel size. Parsing a tar with Python's tarfile / webdataset and
``np.load``-ing each sample costs ~80 us per sample; the shards written by ``encode_shard`` have one
regular layout (per sample a 512-byte header + a ``.npy`` of identical header and size, one
``meta.json`` after the first sample), so a scan of the headers plus one numpy gather decodes a
whole shard at memory speed.

Anything that does not match that layout exactly (other member names, sizes, npy headers, a
truncated archive, ...) returns None and the caller takes the general webdataset path, which
also produces the precise error message. So this module never decides that a shard is bad.
"""

from __future__ import annotations

import io

import numpy as np

_BLOCK = 512


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
    if not starts or data[pos:pos + 2 * _BLOCK].count(0) != 2 * _BLOCK:  # the end-of-archive blocks
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
