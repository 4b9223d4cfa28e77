"""Deterministic, resumable streaming of token shards for data-parallel training.

The design in one paragraph: the sample a run sees at global index ``g`` is a pure function of
``(seed, g)`` and the dataset. ``g`` splits into an epoch ``e = g // N`` and a position
``p = g % N`` (N = samples per epoch). Epoch ``e`` reads the shards in a seeded permutation of their
order (the "stream"); the stream is cut into blocks of ``shuffle_buffer`` samples, and inside
block ``b`` position ``p`` takes stream sample ``b*B + perm_{e,b}[p - b*B]``. Global batch ``s`` is
indices ``[s*G, (s+1)*G)``; data-parallel rank ``r`` yields its contiguous ``G/dp`` slice of it as
micro-batches. Nothing depends on the rank count, the worker count or webdataset's own (rank- and
worker-seeded) shuffling, so:

* the batch a model step sees is the same for any ``dp_size`` and ``num_workers``;
* ``state_dict()`` is a handful of integers (consumed samples, seed, ...), valid for any ``dp_size``;
* resuming opens only the shards of the current shuffle block: cost is bounded by one block,
  independent of how far into the epoch the run is; consumed shards are never read again;
* epoch ends fall wherever they fall inside a batch (the next epoch's order simply continues), so
  every rank always yields the same number of batches: no DDP hang with uneven shards.

What a rank reads: rank ``r`` needs ``1/dp`` of every shuffle block, so about ``1/dp`` of the rows
of every shard. With ``dp > 1`` each dataset is told which of its indices this rank yields
(``_Dataset.wanted``); a block materialises only those, and local shards in the writer's layout are
read only where those rows lie (:func:`read_rows`: positioned reads, offsets from the layout, no
index needed). So a rank's I/O and decoding follow what it yields, not ``dp`` times that. Shards read
whole instead (one rank; ``pipe:``/remote URLs, which cannot seek; other layouts; or
``partial_reads=False``) give the same rows, at the old dp-fold cost.

Shards are opened with webdataset's ``gopen`` (local paths, ``file:``, ``pipe:cmd``, http...) and
parsed with webdataset's tar iterators, so any URL a webdataset user would write works.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import numbers
import os
import re
import signal
import time
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from webdataset.gopen import gopen as wds_gopen
import webdataset.tariterators as wds_tar
from webdataset.shardlists import expand_urls

from ._io import file_identity, sha256_bytes
from .errors import DataError
from .fast_shard import decode_regular_shard, open_tar, probe_layout, tar_has_end_marker
from .shards import Manifest, check_field_types, load_manifest, reads_as_url
from .workers import SignalQuietPool

log = logging.getLogger(__name__)

STATE_VERSION = 1
DEFAULT_SHUFFLE_BUFFER = 8192
_ON_CORRUPT = ("error", "skip")
# An OSError while reading a shard is retried before the shard counts as corrupt (_retry_io)
IO_TRIES = 3  # attempts in all
IO_BACKOFF_S = 0.5  # wait before the second attempt, doubled before each further one
IO_BACKOFF_MAX_S = 2.0  # the longest wait


# =========================================================================== shard reading
@dataclass
class ShardSpec:
    """A shard as the loader knows it before opening it (count/checksum may be unknown for plain URLs)."""

    url: str
    num_samples: int
    sha256: str | None = None
    bytes: int | None = None

    @property
    def local_path(self) -> Path | None:
        """The file behind a plain or ``file:`` URL (None for pipes and remote URLs)."""
        if self.url.startswith("file:"):
            return Path(self.url[5:])
        if reads_as_url(self.url):
            return None
        return Path(self.url)


_META_TYPES = {"tokenizer_sha256": str, "seq_length": int, "vocab_size": int, "dtype": str}  # a shard's meta.json


class _CorruptShard(DataError):
    """A shard that cannot be used as stored (missing, truncated, bad checksum/tar/npy, empty).

    With ``on_corrupt="skip"`` these are skipped; every other DataError (wrong tokenizer, id out of
    vocabulary, wrong seq_length) always stops the run, since skipping would hide a config mistake.
    """


def _fetch_bytes(url: str) -> bytes:
    """Whole content of a shard URL through webdataset's gopen (tests patch this to count opens)."""
    stream = wds_gopen(url, "rb")
    try:
        return stream.read()
    finally:
        stream.close()


@dataclass
class ShardChecks:
    """What every shard of one dataset must agree with.

    ``tokenizer_from``: where ``tokenizer_sha256`` comes from when it is not the run's tokenizer
    (the dataset's manifest, or the first shard whose meta.json records one), for the error line."""

    seq_length: int
    tokenizer_sha256: str | None = None
    vocab_size: int | None = None
    tokenizer_from: str | None = None


def read_shard(spec: ShardSpec, checks: ShardChecks, verify_checksum: bool = True) -> np.ndarray:
    """Open, verify and decode a whole shard into a ``[num_samples, seq_length + 1]`` array.

    Every failure is a one-line DataError that names the shard URL; corruption is a ``_CorruptShard``.
    """
    return read_shard_and_meta(spec, checks, verify_checksum)[0]


def read_shard_and_meta(spec: ShardSpec, checks: ShardChecks, verify_checksum: bool = True) -> tuple[np.ndarray, dict]:
    """:func:`read_shard`, plus the shard's checked meta.json record ({} when it has none)."""
    try:
        data = _retry_io(spec.url, _fetch_bytes, spec.url)
    except Exception as e:  # gopen raises IOError/ValueError/OSError from pipes, http, ...
        raise _unreadable(spec.url, e) from None
    if verify_checksum and spec.sha256 and sha256_bytes(data) != spec.sha256:
        raise _CorruptShard(spec.url, f"sha256 mismatch (corrupt or modified shard; {len(data)} bytes, "
                                      f"manifest says {spec.bytes})")
    fast = decode_regular_shard(data, checks.seq_length)  # the layout encode_shard writes, vectorised
    if fast is not None:
        arr, raw_meta = fast
        meta = _check_meta(spec.url, raw_meta, checks) if raw_meta is not None else {}
        _check_dtype(spec.url, arr.dtype, meta)
        return _check_rows(spec, arr, meta, checks), meta
    samples = _parse_tar(spec.url, data)  # anything else: webdataset's parser and its precise errors
    return _decode_samples_and_meta(spec, samples, checks)


def _retry_io(url: str, fn, *args):
    """``fn(*args)``, tried up to IO_TRIES times while it raises OSError (waits of IO_BACKOFF_S,
    doubling, at most IO_BACKOFF_MAX_S); the last OSError is raised.

    Why: mid-run each rank judges the shards it reads alone (agreeing would cost a collective per
    read), and tensor/pipeline peers reading the same rows reach the same verdict only when the
    error is deterministic. Bad bytes and wrong sizes are the file's own, every reader meets them,
    so they are never retried; an EIO, ESTALE or timeout is one node's moment, and skipping the
    shard on it would give that rank other samples than its peers for the rest of the run (one
    still unreadable after the last attempt stops such a run: ``_Dataset._shard_rows``)."""
    for attempt in range(1, IO_TRIES + 1):
        try:
            return fn(*args)
        except OSError as e:
            if attempt >= IO_TRIES:
                raise
            delay = min(IO_BACKOFF_S * 2 ** (attempt - 1), IO_BACKOFF_MAX_S)
            log.warning("%s: %s: %s (attempt %d of %d, again in %.1f s)", url, type(e).__name__, e, attempt,
                        IO_TRIES, delay)
            _wait(delay)


def _wait(seconds: float) -> None:
    """The pause between read attempts (tests patch this)."""
    time.sleep(seconds)


class _UnreadableShard(_CorruptShard):
    """A shard this process could not open, stat or read (an OSError, after :func:`_retry_io`'s
    attempts when reading): unlike bad bytes, a fault of this node's view of the file, which the
    ranks reading the same rows may not share."""


def _unreadable(url: str, err: Exception) -> _UnreadableShard:
    """The corrupt-shard error for a shard that could not be opened, stat'ed or read: "missing
    shard" when it does not exist, else "cannot read shard (<ErrName>: <msg>)". The same line
    whichever path met it (whole read, positioned read, setup check), so skip mode skips it where
    the ranks agree on it (set-up checks, or no peer reads this rank's rows: see
    ``_Dataset._shard_rows``)."""
    if isinstance(err, FileNotFoundError):
        return _UnreadableShard(url, "missing shard (file not found)")
    return _UnreadableShard(url, f"cannot read shard ({type(err).__name__}: {err})")


# magic numbers of the compressions tarfile / webdataset would undo transparently
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _parse_tar(url: str, data: bytes) -> list[dict]:
    """Samples of a tar held in memory, grouped by key with webdataset's own tar iterators; a tar
    without its end-of-archive marker is refused (see :func:`_check_tar_end`), and so is a
    compressed one: token shards are plain tars (the writer never compresses), and decompressing
    a 200 KB file into a 200 MB member cost every rank and loader worker that much memory before
    the shard was found bad."""
    kind = next((name for magic, name in _COMPRESSED.items() if data.startswith(magic)), None)
    if kind is not None:
        raise _CorruptShard(url, f"a {kind}-compressed file, not a plain tar (token shards are not compressed)")
    try:
        files = wds_tar.tar_file_iterator(io.BytesIO(data))
        tagged = ({**f, "__url__": url} for f in files)
        samples = list(wds_tar.group_by_keys(tagged))
    except Exception as e:  # tarfile.ReadError, EOFError, ValueError (duplicate names) ...
        raise _CorruptShard(url, f"truncated or corrupt tar ({type(e).__name__}: {e})") from None
    _check_tar_end(url, data)
    return samples


def _check_tar_end(url: str, data: bytes) -> None:
    """A tar cut off exactly at a member boundary (or at an unreadable header) parses as a shorter
    whole one, its lost samples unnoticed: where the members stop, the end-of-archive marker must
    follow. A second pass over the headers only, on the general path (shards not in the writer's
    layout, whose fast decoder checks the marker itself)."""
    try:
        with open_tar(fileobj=io.BytesIO(data)) as tf:
            tf.getmembers()
            whole = tar_has_end_marker(tf)
    except Exception as e:  # as in _parse_tar: tarfile.ReadError, EOFError, zlib.error ...
        raise _CorruptShard(url, f"truncated or corrupt tar ({type(e).__name__}: {e})") from None
    if not whole:
        raise _CorruptShard(url, "truncated tar (no end-of-archive marker)")


def _decode_samples_and_meta(spec: ShardSpec, samples: list[dict], checks: ShardChecks) -> tuple[np.ndarray, dict]:
    """Stack the ``tokens.npy`` of every sample and check shape, count, tokenizer and id range;
    returns them with the checked meta.json of the first sample ({} without one)."""
    if not samples:
        raise _CorruptShard(spec.url, "empty shard (no samples)")
    meta = _check_meta(spec.url, samples[0]["meta.json"], checks) if "meta.json" in samples[0] else {}
    rows = [_decode_tokens(spec.url, s, checks.seq_length) for s in samples]
    for row in rows:
        _check_dtype(spec.url, row.dtype, meta)
    return _check_rows(spec, np.stack(rows), meta, checks), meta


def _check_dtype(url: str, dtype: np.dtype, meta: dict) -> None:
    """Tokens stored in the dtype the shard's meta.json records: ids read in a narrower one would
    have wrapped already (uint8 for uint16 ids: 300 reads as 44) and pass every range check."""
    recorded = meta.get("dtype")
    if recorded is None:
        return
    try:
        expected = np.dtype(recorded)
    except TypeError:
        raise DataError(url, f"meta.json dtype {recorded!r} is not a numpy dtype") from None
    if np.dtype(dtype) != expected:  # not skipped like a damaged shard: its writer mislabelled it
        raise DataError(url, f"tokens stored as {np.dtype(dtype).name}, meta.json says {expected.name}")


def _check_rows(spec: ShardSpec, arr: np.ndarray, meta: dict, checks: ShardChecks) -> np.ndarray:
    """Sample count against the manifest and the id range of a decoded ``[n, seq_length + 1]`` shard."""
    if spec.num_samples >= 0 and len(arr) != spec.num_samples:
        raise _CorruptShard(spec.url, f"holds {len(arr)} samples, manifest says {spec.num_samples}")
    return _check_ids(spec, arr, meta, checks)


def _check_ids(spec: ShardSpec, arr: np.ndarray, meta: dict, checks: ShardChecks) -> np.ndarray:
    """Every token id of ``arr`` in ``[0, vocab size)`` (the run's, else the shard's meta.json)."""
    if not arr.size:
        return arr
    limit = checks.vocab_size if checks.vocab_size is not None else meta.get("vocab_size")
    if limit is not None:
        top = int(arr.max())
        if top >= limit:
            raise DataError(spec.url, f"token id {top} >= vocab size {limit}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise DataError(spec.url, f"negative token id {int(arr.min())}")
    return arr


def _check_meta(url: str, raw: bytes, checks: ShardChecks) -> dict:
    """A shard's own record of its tokenizer and seq_length must match the run's; returns the record."""
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _CorruptShard(url, "unreadable meta.json") from None
    if not isinstance(meta, dict):
        raise _CorruptShard(url, f"meta.json must be a JSON object, got {type(meta).__name__}")
    check_field_types(url, meta, _META_TYPES, prefix="meta.json ", error=_CorruptShard, nullable=set(_META_TYPES))
    sha = meta.get("tokenizer_sha256")
    if checks.tokenizer_sha256 and sha and sha != checks.tokenizer_sha256:
        ref = f"{checks.tokenizer_from} with" if checks.tokenizer_from else "run uses"
        raise DataError(url, f"tokenizer mismatch: shard made with {sha[:12]}..., {ref} "
                             f"{checks.tokenizer_sha256[:12]}...")
    if meta.get("seq_length") not in (None, checks.seq_length):
        raise DataError(url, f"seq_length {meta['seq_length']} != run's {checks.seq_length}")
    return meta


def _decode_tokens(url: str, sample: dict, seq_length: int) -> np.ndarray:
    """One sample's ``tokens.npy`` as a 1-D integer array of ``seq_length + 1``."""
    key = sample.get("__key__", "?")
    if "tokens.npy" not in sample:
        raise _CorruptShard(url, f"sample {key} has no tokens.npy (fields: {sorted(k for k in sample if not k.startswith('__'))})")
    try:
        arr = np.load(io.BytesIO(sample["tokens.npy"]), allow_pickle=False)
    except Exception as e:
        raise _CorruptShard(url, f"sample {key}: unreadable tokens.npy ({type(e).__name__})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise _CorruptShard(url, f"sample {key}: tokens must be a 1-D integer array (got {arr.dtype} {arr.shape})")
    if len(arr) != seq_length + 1:
        raise DataError(url, f"sample {key} has {len(arr)} tokens, expected seq_length + 1 = {seq_length + 1}")
    return arr


def _open_local(path: Path) -> int:
    """A file descriptor for positioned reads of a local shard (tests patch this to count opens)."""
    return os.open(path, os.O_RDONLY)


def read_rows(spec: ShardSpec, checks: ShardChecks, rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """Samples ``rows`` of a local shard as ``[len(rows), seq_length + 1]`` (the shard's dtype), and
    whether the whole shard had to be read for them.

    A shard in the layout ``encode_shard`` writes is read only where those samples lie (plus its
    first members and end-of-archive blocks, which locate them): the cost follows ``len(rows)``,
    not the shard. Any other layout (older or foreign shards) falls back to :func:`read_shard`.

    Checks made: the file size against the manifest, the shard's meta.json, the count implied by
    the end-of-archive position, each sample's tar and npy header, the id range. The sha256 of the
    whole shard needs the whole shard, so it is checked only on the fallback. Every rank reads the
    same head and tail, so those verdicts (skip or stop) agree across ranks; a bad sample header
    deeper in is seen only by the rank that owns the sample, so it always stops the run. An I/O
    error (open, stat or read) is the whole-shard path's "cannot read shard" error, once
    :func:`_retry_io`'s attempts are spent (skippable as there: see ``_Dataset._shard_rows``).
    """
    try:
        return _retry_io(spec.url, _read_rows_once, spec, checks, rows)
    except OSError as e:  # EIO and the like from open, fstat or a pread
        raise _unreadable(spec.url, e) from None


def _read_rows_once(spec: ShardSpec, checks: ShardChecks, rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """One attempt of :func:`read_rows`: open, read, close (OSErrors are left to the caller)."""
    fd = _open_local(spec.local_path)
    try:
        return _read_rows_at(fd, spec, checks, rows)
    finally:
        os.close(fd)


def _read_rows_at(fd: int, spec: ShardSpec, checks: ShardChecks, rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """:func:`read_rows` on an open file descriptor (OSErrors are left to the caller)."""
    st = os.fstat(fd)
    if spec.bytes is not None and st.st_size != spec.bytes:
        raise _CorruptShard(spec.url, f"truncated or modified shard: {st.st_size} bytes, "
                                      f"manifest says {spec.bytes}")
    read = functools.partial(_pread, fd)
    probed = _probe(spec, checks, st, read)
    if probed is None:
        return read_shard(spec, checks)[rows], True
    layout, meta = probed
    out = np.empty((len(rows), layout.n_tokens), dtype=layout.dtype)
    for j in np.argsort(rows, kind="stable").tolist():  # ascending offsets: sequential reads
        i = int(rows[j])
        row = layout.read_row(read, i)
        if row is None:
            raise DataError(spec.url, f"sample {i} is not at byte {layout.header_offset(i)} where the shard's "
                                      "layout puts it (corrupt or modified shard; a partial read cannot skip it "
                                      "consistently on every rank: replace the shard)")
        out[j] = row
    return _check_ids(spec, out, meta, checks), False


_PROBES: "OrderedDict[tuple, tuple]" = OrderedDict()  # (file identity, count, checks) -> (layout, meta)
_MAX_PROBES = 4096


def _probe(spec: ShardSpec, checks: ShardChecks, st: os.stat_result, read):
    """(layout, checked meta) of a regular shard, None for any other layout; remembered per file
    version (device, inode, size, mtime, ctime), so a shard read once per block is probed once."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, spec.num_samples, checks.seq_length,
           checks.tokenizer_sha256, checks.vocab_size)
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key]
    layout = probe_layout(read, st.st_size, spec.num_samples, checks.seq_length)
    if layout is None:
        return None
    meta = _check_meta(spec.url, layout.meta, checks) if layout.meta is not None else {}
    _check_dtype(spec.url, layout.dtype, meta)
    _PROBES[key] = (layout, meta)
    while len(_PROBES) > _MAX_PROBES:
        _PROBES.popitem(last=False)
    return layout, meta


def _pread(fd: int, offset: int, length: int) -> bytes:
    return os.pread(fd, length, offset)


def read_rows_many(jobs: list[tuple[ShardSpec, np.ndarray]], checks: ShardChecks) -> list:
    """:func:`read_rows` for several shards in one worker task; a shard's DataError is returned in
    its place (not raised), so one bad shard does not lose the rows read from the others."""
    out: list = []
    for spec, rows in jobs:
        try:
            out.append(read_rows(spec, checks, rows))
        except DataError as e:
            out.append(e)
    return out


def _result_at(fut: Future, j: int):
    """Entry ``j`` of a :func:`read_rows_many` task's result."""
    return fut.result()[j]


# =========================================================================== one dataset
def _resolve_source(src, *, seq_length: int, tokenizer_sha256: str | None, vocab_size: int | None,
                    split: str, url_template: str | None):
    """(name, shard specs, checks) from a Manifest, a manifest path/dir, a URL pattern or a list of URLs.

    Plain URLs carry no split: they are read as ``split``, except that shards named as the writer
    names the OTHER split's (``...-train-NNNNNN.tar`` for a val loader) are refused, see
    :func:`_check_url_split`."""
    if isinstance(src, (str, Path)) and not str(src).strip() or isinstance(src, (list, tuple)) and not src:
        raise DataError("data.manifest", "not set (set it to a manifest.json, or use data.mixture)")
    if isinstance(src, (str, Path)) and (str(src).endswith(".json") or Path(src).is_dir()):
        src = load_manifest(src)
    if isinstance(src, Manifest):
        return _from_manifest(src, seq_length, tokenizer_sha256, vocab_size, split, url_template)
    urls = _expand(src) if isinstance(src, (str, Path)) else [u for s in src for u in _expand(s)]
    if not urls:
        raise DataError(str(src), "no shard URLs")
    _check_url_split(urls, split)
    checks = ShardChecks(seq_length, tokenizer_sha256, vocab_size)
    return (urls[0] if len(urls) == 1 else f"{urls[0]} (+{len(urls) - 1})"), \
        [ShardSpec(u, -1) for u in urls], checks


def _expand(pattern) -> list[str]:
    """webdataset's expansion of a URL pattern (braces; ``${X}`` from the environment variable
    ``WDS_X``), its failures as one-line DataErrors: each is this rank's input, and the set-up pools
    DataErrors across ranks (an unset variable on one node must not leave the others waiting)."""
    try:
        urls = expand_urls(str(pattern))
    except (ValueError, AssertionError, KeyError) as exc:  # unbalanced braces; a ${X} without WDS_X
        raise DataError(str(pattern), f"cannot expand the URL pattern ({type(exc).__name__}: "
                                      f"{' '.join(str(exc).split())[:160]})") from None
    for url in urls:
        _refuse_glob(url)
    return urls


def _refuse_glob(url: str) -> None:
    """A local shard URL holding ``*`` or ``?`` that names no file was meant as a glob, which shard
    URLs are not (it would fail as a missing shard after the read retries)."""
    local = url.removeprefix("file:")
    if "://" in local or local.startswith("pipe:") or not any(c in local for c in "*?") or os.path.exists(local):
        return
    raise DataError(url, "shard URLs are not globbed: list the shards with a brace range "
                         "(shard-train-{000000..000099}.tar) or give the dataset's manifest.json")


# a shard the writer named (shards.py: ``{prefix}-{split}-NNNNNN.tar``), anywhere in a URL (a pipe's
# command may follow the name); the last such name in the URL is the shard's
_SPLIT_NAME = re.compile(r"-(train|val)-\d{6,}\.tar(?![\w.])")


def _url_split(url: str) -> str | None:
    """The split a shard URL's file name says it belongs to ("train"/"val"), None when its name is
    not the writer's."""
    found = _SPLIT_NAME.findall(url)
    return found[-1] if found else None


def _check_url_split(urls: list[str], split: str) -> None:
    """Refuse plain shard URLs whose names say they are the other split's shards.

    Without a manifest nothing says which split a URL is: read as ``split`` whatever it is,
    ``evaluate`` over a train pattern would report a "validation loss" on training data, and a train
    loader over a glob of the dataset directory would train on its val shards. Names the writer did
    not give (no ``-train-``/``-val-NNNNNN.tar``) stay readable as the requested split."""
    other = "val" if split == "train" else "train"
    for url in urls:
        if _url_split(url) == other:
            raise DataError(url, f'plain URLs carry no split: this is a {other}-split shard by its name, but '
                                 f'the loader wants "{split}" shards; pass the manifest (or only {split} shards)')


def _from_manifest(m: Manifest, seq_length, tokenizer_sha256, vocab_size, split, url_template):
    """Shard specs of one split of a manifest, after the manifest-level consistency checks."""
    name = str(m.path or "manifest")
    if m.seq_length != seq_length:
        raise DataError(name, f"dataset seq_length {m.seq_length} != run's seq_length {seq_length}")
    if tokenizer_sha256 and m.tokenizer_sha256 != tokenizer_sha256:
        raise DataError(name, f"tokenizer mismatch: dataset made with {m.tokenizer_sha256[:12]}..., run uses "
                              f"{tokenizer_sha256[:12]}...")
    if vocab_size is not None and m.vocab_size > vocab_size:
        raise DataError(name, f"dataset vocab size {m.vocab_size} > run's vocab size {vocab_size}")
    shards = m.split_shards(split)
    if not shards:
        raise DataError(name, f'no "{split}" shards in manifest')
    specs = [ShardSpec(m.shard_url(s, url_template), s.num_samples, s.sha256, s.bytes) for s in shards]
    checks = ShardChecks(seq_length, tokenizer_sha256 or m.tokenizer_sha256,
                         vocab_size if vocab_size is not None else m.vocab_size,
                         tokenizer_from=None if tokenizer_sha256 else name)
    return name, specs, checks


class _Dataset:
    """One dataset: its shards, its deterministic sample order, and the samples of the current
    shuffle blocks that this rank yields (``wanted``), read either by positioned reads of just those
    samples (``partial``) or from a small cache of whole decoded shards."""

    def __init__(self, name: str, specs: list[ShardSpec], checks: ShardChecks, *, seed: int, stream_id: int,
                 shuffle: bool, shuffle_buffer: int, on_corrupt: str, pool: Executor | None,
                 prefetch: int, workers: int = 0, progress: bool = False, all_gather=None,
                 peers_share_rows: bool = False):
        self.name, self.checks, self.seed, self.stream_id = name, checks, seed, stream_id
        self.peers_share_rows = peers_share_rows
        self.shuffle, self.on_corrupt, self.pool, self.prefetch = shuffle, on_corrupt, pool, prefetch
        self.workers = max(1, workers)
        self.skipped_shards = 0
        self.skipped_names: set[str] = set()  # where each skipped shard is (its URL)
        self.shards_read = 0
        self.rows_read = 0  # samples read and decoded (all of a shard's when it is read whole)
        self.bad: set[int] = set()
        self.whole: set[int] = set()  # shards not in the regular layout: read whole even when partial
        self.wanted = None  # local indices -> mask of those this rank yields; None: all
        self.partial = False  # read only wanted samples (set by the loader for local shards)
        self._futures: "OrderedDict[int, Future]" = OrderedDict()
        self._blocks: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._pending: "OrderedDict[tuple, list]" = OrderedDict()
        self._orders: "OrderedDict[int, tuple]" = OrderedDict()
        self.specs, self.bad = self._usable_specs(specs, progress, all_gather)
        self.counts = np.array([s.num_samples for s in self.specs], dtype=np.int64)
        self.num_samples = int(self.counts.sum())
        self.set_shuffle_buffer(shuffle_buffer)

    def set_shuffle_buffer(self, shuffle_buffer: int) -> None:
        """Samples per shuffle block (the order depends on it); blocks built for another size are dropped."""
        self.block = max(1, int(shuffle_buffer))  # also bounds memory when not shuffling (val)
        # decoded shards kept: the prefetched ones, the ones one block spans, and two in use
        self.max_cached = self.prefetch + 2 + shards_one_block_spans(self.counts, self.block)
        self.forget_blocks()

    def forget_blocks(self) -> None:
        """Drop the shuffle blocks materialised or pending for this rank (its samples changed)."""
        self._blocks.clear()
        self._pending.clear()

    # ---------------------------------------------------------------- setup checks
    def _usable_specs(self, specs: list[ShardSpec], progress: bool, all_gather=None) -> tuple[list[ShardSpec], set]:
        """Skip (skip mode) or reject (error mode) shards that are visibly unusable before any read:
        missing or wrong-size local files, empty shards; count plain-URL shards by a first scan.
        Returns (the shards of the order, the indices among them to skip).

        A skipped shard whose sample count the manifest gives keeps its place in the order, marked
        bad: its slots are filled from the next healthy shard, exactly as when a read finds it bad
        mid-run, so the order does not depend on when a fault was found (a job that restarts after a
        shard went bad resumes the order it saved, not a permutation over fewer shards that re-read
        consumed samples and missed others). An empty shard, or one whose count no rank knew before
        reading (a plain URL: each rank counts it in its own scan), has no slots: it is left out.

        With ``all_gather`` (see StreamingLoader) the verdict is taken on every rank's findings: a
        shard any rank could not use is dropped on all, and in error mode every rank raises the same
        line. A rank deciding alone (a shard briefly invisible or failing with EIO on one node) would
        have other shards, counts and orders than its peers for the whole run: other tokens on its
        tensor/pipeline peers, samples missed or repeated across data-parallel ranks, a validation
        length of its own, or in error mode a raise while its peers wait in a collective."""
        known = [spec.num_samples for spec in specs]  # before the scan counts plain URLs, each rank its own
        skipped = set()
        for idx, where, problem, corrupt, ranks in _agreed_faults(self._scan(specs, progress), all_gather):
            if not corrupt:  # a config mistake (wrong tokenizer, id out of range): never skipped
                raise DataError(where, problem + _found_by(ranks))
            self._skip_or_raise(_CorruptShard(where, problem + _found_by(ranks)))
            skipped.add(idx)
        # a skipped shard keeps its place only with a count every rank knew before reading anything
        kept = [i for i in range(len(specs)) if i not in skipped or known[i] > 0]
        bad = {new for new, old in enumerate(kept) if old in skipped}
        if len(bad) == len(kept):
            raise DataError(self.name, "no readable shards left (all missing, empty or corrupt)")
        return [specs[i] for i in kept], bad

    def _scan(self, specs: list[ShardSpec], progress: bool) -> list[tuple[int, str, str, bool]]:
        """This rank's set-up faults, ``(shard index, where, problem, corrupt)`` in shard order; the
        scan stops at the first fault that stops the run (any fault in error mode)."""
        faults = []
        for i, spec in enumerate(tqdm(specs, desc=f"scan {self.name}", unit="shard",
                                      disable=not progress or specs[0].num_samples >= 0)):
            try:
                if spec.num_samples < 0:
                    arr, meta = read_shard_and_meta(spec, self.checks)
                    spec.num_samples = len(arr)
                    self.shards_read += 1
                    self._adopt_tokenizer(spec.url, meta)
                self._precheck(spec)
            except DataError as e:
                corrupt = isinstance(e, _CorruptShard)
                faults.append((i, e.where, e.problem, corrupt))
                if not corrupt or self.on_corrupt != "skip":
                    break
        return faults

    def _adopt_tokenizer(self, url: str, meta: dict) -> None:
        """Plain-URL shards in a run that names no tokenizer: the first shard whose meta.json records
        one sets the tokenizer every later shard is checked against (by :func:`_check_meta`, in this
        scan and whenever a shard is read again) and that every other dataset of a mixture must
        share (:func:`_check_one_tokenizer`); shards of two tokenizers must not mix unnoticed.

        The scan reads every such shard anyway (to count it), so this costs no read. Every rank
        reaches the same reference: the shards' bytes are the same for all, and a rank that could
        not read the first shard (a fault the ranks pool) would meet a mismatch at the shard it took
        instead only if the two differ, and a mismatch found by any rank stops every rank."""
        sha = meta.get("tokenizer_sha256")
        if sha and self.checks.tokenizer_sha256 is None:
            self.checks.tokenizer_sha256, self.checks.tokenizer_from = sha, url

    @staticmethod
    def _precheck(spec: ShardSpec) -> None:
        """Cheap checks that need no read: empty shards, and existence/size of local files."""
        if spec.num_samples == 0:
            raise _CorruptShard(spec.url, "empty shard (manifest says 0 samples)")
        path = spec.local_path
        if path is None:
            return
        try:
            size = path.stat().st_size
        except OSError as e:  # missing, or a directory on the way that is not one / may not be entered
            raise _unreadable(spec.url, e) from None
        if spec.bytes is not None and size != spec.bytes:
            raise _CorruptShard(spec.url, f"truncated or modified shard: {size} bytes, manifest says {spec.bytes}")

    def _skip_or_raise(self, err: _CorruptShard) -> None:
        """Skip mode: warn and count; error mode: stop with the one-line error."""
        if self.on_corrupt != "skip":
            raise DataError(err.where, err.problem) from None
        self.skipped_shards += 1
        self.skipped_names.add(err.where)
        log.warning("skipping corrupt shard %s: %s", err.where, err.problem)

    # ---------------------------------------------------------------- order
    def _rng(self, *key: int) -> np.random.Generator:
        """A generator keyed by (seed, stream, *key): platform-independent (PCG64 + SeedSequence)."""
        seed = self.seed % 2**64  # SeedSequence wants non-negative entropy; negative seeds stay distinct
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, self.stream_id, *key])))

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, stream offset where each ordered shard starts) for ``epoch``."""
        if epoch not in self._orders:
            n = len(self.specs)
            order = self._rng(epoch, 0).permutation(n) if self.shuffle else np.arange(n)
            starts = np.concatenate([[0], np.cumsum(self.counts[order])[:-1]])
            self._orders[epoch] = (order, starts)
            while len(self._orders) > 3:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def block_perm(self, epoch: int, block: int, length: int) -> np.ndarray:
        """Within-block order: a seeded permutation (identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(length)
        return self._rng(epoch, 1, block).permutation(length)

    # ---------------------------------------------------------------- fetching
    def rows(self, gidx: np.ndarray) -> np.ndarray:
        """Samples at global indices ``gidx`` (any values >= 0; epochs roll over) as ``[len, seq+1]``."""
        gidx = np.asarray(gidx, dtype=np.int64)
        epoch, pos = np.divmod(gidx, self.num_samples)
        blk, off = np.divmod(pos, self.block)
        out = np.empty((len(gidx), self.checks.seq_length + 1), dtype=np.int64)
        for e, b in sorted(set(zip(epoch.tolist(), blk.tolist()))):
            sel = (epoch == e) & (blk == b)
            out[sel] = self._block_rows(e, b, off[sel])
        return out

    def _block_rows(self, epoch: int, block: int, off: np.ndarray) -> np.ndarray:
        """Samples at offsets ``off`` of a shuffle block: this rank's from the materialised block,
        any other (a caller asking for another rank's samples) read on demand."""
        own, data = self._block(epoch, block)
        at = np.minimum(np.searchsorted(own, off), max(len(own) - 1, 0))
        hit = own[at] == off if len(own) else np.zeros(len(off), dtype=bool)
        if hit.all():
            return data[at]
        out = np.empty((len(off), self.checks.seq_length + 1), dtype=np.int64)
        out[hit] = data[at[hit]]
        out[~hit] = self._collect(epoch, self._groups(epoch, self._stream_positions(epoch, block, off[~hit])))
        return out

    def _block_span(self, block: int) -> tuple[int, int]:
        """(first stream position, length) of a shuffle block."""
        start = block * self.block
        return start, min(self.block, self.num_samples - start)

    def _stream_positions(self, epoch: int, block: int, off: np.ndarray) -> np.ndarray:
        """Stream positions of block offsets: ``block * B + perm_{e,b}[off]``."""
        start, length = self._block_span(block)
        return start + self.block_perm(epoch, block, length)[off]

    def _own_offsets(self, epoch: int, block: int) -> np.ndarray:
        """Sorted offsets of the block's samples that this rank yields."""
        start, length = self._block_span(block)
        off = np.arange(length)
        return off if self.wanted is None else off[self.wanted(epoch * self.num_samples + start + off)]

    def _block(self, epoch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(own offsets, their samples ``[len(own), seq+1]``) of one block, materialised once and
        kept while in use; only this rank's samples are read (all of them with one rank)."""
        key = (epoch, block)
        if key not in self._blocks:
            own = self._own_offsets(epoch, block)
            groups = self._pending.pop(key, None)
            if groups is None:
                groups = self._groups(epoch, self._stream_positions(epoch, block, own))
                self._submit_rows(epoch, groups)
            start, length = self._block_span(block)
            if not self.partial:
                self._submit_block(epoch, start, start + length)
            self._blocks[key] = (own, self._collect(epoch, groups))
            while len(self._blocks) > 2:
                self._blocks.popitem(last=False)
            self._prefetch_after(epoch, block)
        return self._blocks[key]

    def _groups(self, epoch: int, pos: np.ndarray) -> list[list]:
        """Stream positions grouped by shard: ``[k (in the epoch's order), indices into pos, rows
        inside that shard, result getter or None]`` per shard touched."""
        _, starts = self.epoch_order(epoch)
        k = np.searchsorted(starts, pos, side="right") - 1
        by_shard = np.argsort(k, kind="stable")
        ks, first = np.unique(k[by_shard], return_index=True)
        return [[int(kk), sel, pos[sel] - int(starts[kk]), None]
                for kk, sel in zip(ks.tolist(), np.split(by_shard, first[1:]))]

    def _collect(self, epoch: int, groups: list[list]) -> np.ndarray:
        """The samples of ``groups`` as one ``[n, seq+1]`` array in the order of their positions."""
        n = sum(len(g[1]) for g in groups)
        parts = [(sel, self._shard_rows(epoch, k, rows, got)) for k, sel, rows, got in groups]
        dtype = np.result_type(*(p.dtype for _, p in parts)) if parts else np.int64
        out = np.empty((n, self.checks.seq_length + 1), dtype=dtype)
        for sel, p in parts:
            out[sel] = p
        return out

    def _shard_rows(self, epoch: int, k: int, rows: np.ndarray, got=None) -> np.ndarray:
        """Rows of the ``k``-th shard in ``epoch``'s order; a skipped corrupt shard is replaced by the
        next healthy shard of the order (rows taken modulo its length), so counts and batches stay
        identical on every rank.

        Mid-run each rank judges its reads alone. Bad bytes are the file's, met by every reader, so
        peers reading the same rows skip the same shard; an unreadable shard (an I/O error that
        outlived the retries) may be this node's alone, so with ``peers_share_rows`` it stops the
        run even in skip mode: skipping it would feed this rank other tokens than its tensor /
        pipeline peers for the rest of the run, silently."""
        order, _ = self.epoch_order(epoch)
        n = len(order)
        for step in range(n):
            idx = int(order[(k + step) % n])
            if idx in self.bad:
                continue
            try:
                if step == 0:
                    return self._read(idx, rows, got)
                return self._read(idx, rows % int(self.counts[idx]))
            except _CorruptShard as e:
                if isinstance(e, _UnreadableShard) and self.peers_share_rows:
                    raise DataError(e.where, f"{e.problem}; not skipped: this rank's tensor/pipeline peers read "
                                             "the same samples and would go on with other ones (resume from the last "
                                             "checkpoint once the shard reads)") from None
                self.bad.add(idx)
                self._skip_or_raise(e)
        raise DataError(self.name, "no readable shards left (all corrupt)")

    def _read(self, idx: int, rows: np.ndarray, got=None) -> np.ndarray:
        """Rows of shard ``idx``: a partial read (its prefetched result when ``got`` is given), or
        rows of the whole decoded shard."""
        if not self.partial or idx in self.whole:
            return self._load(idx)[rows]
        if got is None:
            self.shards_read += 1
            self.rows_read += len(rows)
            res = read_rows(self.specs[idx], self.checks, rows)
        else:
            res = got()
        if isinstance(res, Exception):
            raise res
        arr, whole = res
        if whole:
            self._read_whole_from_now(idx)
        return arr

    def _read_whole_from_now(self, idx: int) -> None:
        """Shard ``idx`` is not in the regular layout: read it whole (and cached) from now on."""
        if not self.whole:
            log.info("%s: %s is not in the layout this pipeline writes (older or foreign shard): every rank "
                     "reads such shards whole", self.name, self.specs[idx].url)
        self.whole.add(idx)
        self.rows_read += int(self.counts[idx])

    def _submit_rows(self, epoch: int, groups: list[list]) -> None:
        """Partial mode with workers: hand the groups' reads to the workers, split into one task per
        worker (a task per shard would cost more in pickling than the reads themselves)."""
        if not self.partial or self.pool is None:
            return
        order, _ = self.epoch_order(epoch)
        todo = [g for g in groups if int(order[g[0]]) not in self.bad | self.whole]
        for chunk in np.array_split(np.arange(len(todo)), min(self.workers, len(todo)) or 1):
            if not len(chunk):
                continue
            jobs = [(self.specs[int(order[todo[i][0]])], todo[i][2]) for i in chunk.tolist()]
            fut = self.pool.submit(read_rows_many, jobs, self.checks)
            self.shards_read += len(jobs)
            self.rows_read += sum(len(r) for _, r in jobs)
            for j, i in enumerate(chunk.tolist()):
                todo[i][3] = functools.partial(_result_at, fut, j)

    def _prefetch_after(self, epoch: int, block: int) -> None:
        """Queue the reads of what comes after ``block`` so workers overlap them with training:
        the next block's own samples (partial mode), else the next shards."""
        if self.pool is None:
            return
        start, length = self._block_span(block)
        if not self.partial:
            self._schedule_prefetch(epoch, start + length)
            return
        nxt = (epoch, block + 1) if start + length < self.num_samples else (epoch + 1, 0)
        if nxt in self._pending or nxt in self._blocks:
            return
        groups = self._groups(nxt[0], self._stream_positions(*nxt, self._own_offsets(*nxt)))
        self._submit_rows(nxt[0], groups)
        self._pending[nxt] = groups
        while len(self._pending) > 2:
            self._pending.popitem(last=False)

    def _load(self, idx: int) -> np.ndarray:
        """Decoded shard ``idx``, from the prefetch/cache table or read now."""
        fut = self._futures.get(idx)
        if fut is None:
            fut = self._submit(idx)
        self._futures.move_to_end(idx)
        try:
            return fut.result()
        except _CorruptShard:
            self._futures.pop(idx, None)
            raise

    def _submit(self, idx: int) -> Future:
        """Start reading shard ``idx`` (in a worker process when there are workers, else right now)."""
        self.shards_read += 1
        self.rows_read += int(self.counts[idx])
        if self.pool is not None:
            fut = self.pool.submit(read_shard, self.specs[idx], self.checks)
        else:
            fut = Future()
            try:
                fut.set_result(read_shard(self.specs[idx], self.checks))
            except Exception as e:  # delivered through .result() like a worker's exception
                fut.set_exception(e)
        self._futures[idx] = fut
        while len(self._futures) > self.max_cached:
            self._futures.popitem(last=False)
        return fut

    def _submit_block(self, epoch: int, lo: int, hi: int) -> None:
        """Hand every shard of stream samples ``[lo, hi)`` to the workers at once, so they decode in
        parallel instead of one after another as the block is assembled."""
        if self.pool is None:
            return
        order, starts = self.epoch_order(epoch)
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))
        for idx in order[first:last].tolist():
            if idx not in self._futures and idx not in self.bad:
                self._submit(idx)

    def _schedule_prefetch(self, epoch: int, stream_pos: int) -> None:
        """Queue reads of the shards the next block(s) will need, so workers overlap I/O and decoding."""
        if self.pool is None or self.prefetch <= 0:
            return
        for idx in self._upcoming(epoch, stream_pos, self.prefetch):
            if idx not in self._futures and idx not in self.bad:
                self._submit(idx)

    def _upcoming(self, epoch: int, stream_pos: int, count: int) -> list[int]:
        """The next ``count`` shard indices in stream order from ``stream_pos`` (crossing into the next epoch)."""
        out: list[int] = []
        while len(out) < count:
            if stream_pos >= self.num_samples:
                epoch, stream_pos = epoch + 1, 0
            order, starts = self.epoch_order(epoch)
            k = int(np.searchsorted(starts, stream_pos, side="right")) - 1
            out.extend(int(i) for i in order[k:k + count - len(out)])
            stream_pos = self.num_samples
        return out


# loader workers ignore the signals a scheduler or a terminal sends to every process of a job (Ctrl-C,
# a time-limit warning, a preemption): the training process decides what they mean (save and stop,
# say) and ends its workers itself. A worker whose owner dies exits on its own (data_pipeline.workers).
WORKER_IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")


def _agreed_faults(mine: list[tuple[int, str, str, bool]], all_gather=None) -> list[tuple]:
    """Every rank's set-up faults merged: ``(shard index, where, problem, corrupt, ranks that found
    it)`` per faulty shard, in shard order, as the lowest of those ranks saw it (a fault that stops
    the run outranks a corrupt-shard one). The same list on every rank; without ``all_gather``
    this process's own faults, no ranks named."""
    reports = [mine] if all_gather is None else all_gather(mine)
    merged: dict[int, list] = {}
    for rank, faults in enumerate(reports):
        for idx, where, problem, corrupt in faults:
            seen = merged.get(idx)
            if seen is None or (seen[3] and not corrupt):
                merged[idx] = [idx, where, problem, corrupt, [rank] if all_gather is not None else []]
            elif seen[3] == corrupt and all_gather is not None:
                seen[4].append(rank)
    return [tuple(merged[i]) for i in sorted(merged)]


def _agreed_setup(build, all_gather=None):
    """``build()``, with its DataError agreed on by every rank: each rank's error (or None) goes
    through one ``all_gather``, and if any rank failed EVERY rank raises the lowest failing rank's
    line, naming the ranks that met that same line (``(found by rank 1)``).

    For the set-up steps before the pooled shard checks (loading manifests, expanding URLs,
    ``_check_distinct_shards``): a rank raising there alone (its mount missing, a manifest it
    cannot read) left its peers in the shard checks' first all_gather, a raw "Connection closed by
    peer" on gloo, a hang until the timeout on NCCL. Without ``all_gather`` this is ``build()``."""
    if all_gather is None:
        return build()
    try:
        result, mine = build(), None
    except DataError as e:
        result, mine = None, (e.where, e.problem)
    reports = all_gather(mine)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        first = failed[0][1]
        where, problem = first
        raise DataError(where, problem + _found_by([rank for rank, report in failed if report == first])) from None
    return result


def _found_by(ranks: list[int]) -> str:
    """`` (found by rank 1)`` / `` (found by ranks 0, 1)``; nothing when no rank is named."""
    if not ranks:
        return ""
    return f" (found by rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def shards_one_block_spans(counts: np.ndarray, block: int) -> int:
    """The most shards ``block`` consecutive samples can touch, whatever the shard order: the
    shards inside such a window, all but its first and last, hold at most ``block - 2`` samples
    together, so at most as many as the smallest shards whose counts sum below ``block``. A bound
    from the smallest shard alone (block / min + 1) grows with a writer's short tail shard: a
    10-sample tail among 64 MiB shards kept ~800 decoded shards per rank (~44 GB)."""
    smallest_first = np.cumsum(np.sort(counts))
    return min(len(counts), int(np.searchsorted(smallest_first, block)) + 2)


# =========================================================================== mixtures
MIXTURE_MAX_PERIOD = 100_000  # slots in one mixture period (one int64 pair per slot, laid out once)
MIXTURE_SHARE_RTOL = 1e-3  # each dataset's share within 0.1% (relative) of its weight's share


def mixture_counts(weights: Sequence[float], names: Sequence[str]) -> np.ndarray:
    """Integer slots per period ``n_d`` whose shares ``n_d / sum n`` match the weights' shares.

    The shortest period (at most MIXTURE_MAX_PERIOD) that gives every share within MIXTURE_SHARE_RTOL
    of the request: exact for weights like [3, 1] (period 4) or [0.7, 0.2, 0.1] (period 10), and a
    small share keeps its size (weights [1, 3000] give a 3001-slot period, not 1:1). Beyond that
    the longest period, rounded; a dataset whose share rounds to no slot is refused by name, never
    raised to one slot (which would give it far more than asked)."""
    p = np.asarray(weights, dtype=np.float64) / float(sum(weights))  # [d]
    periods = np.arange(1, MIXTURE_MAX_PERIOD + 1, dtype=np.float64)[:, None]  # [T, 1]
    counts = np.rint(periods * p)  # [T, d]
    shares = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    ok = np.all((counts >= 1) & (np.abs(shares - p) <= MIXTURE_SHARE_RTOL * p), axis=1)
    best = counts[int(np.argmax(ok))] if ok.any() else counts[-1]
    for name, share, n in zip(names, p, best):
        if n < 1:
            raise DataError(name, f"mixture weight is {share:.2g} of the total, below the "
                                  f"1/{2 * MIXTURE_MAX_PERIOD} a mixture resolves: raise it or drop the dataset")
    counts = best.astype(np.int64)
    return counts // math.gcd(*counts.tolist())


class _Mixture:
    """Deterministic weighted interleaving: global index ``g`` -> (dataset d, its own index k).

    Weights become integers ``n_d`` (mixture_counts) and one period of ``T = sum n_d`` slots is
    laid out by smooth weighted round-robin; ``k = (g // T) * n_d + (slots of d before g % T)``.
    O(1) per index, so resuming at any position costs nothing.
    """

    def __init__(self, datasets: list[_Dataset], weights: list[float]):
        self.counts = mixture_counts(weights, [d.name for d in datasets])
        self.period = int(self.counts.sum())
        self.pattern, self.rank_in_period = self._layout(self.counts)
        self.slots = [np.flatnonzero(self.pattern == d) for d in range(len(self.counts))]
        self.datasets = datasets

    @staticmethod
    def _layout(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Smooth weighted round-robin over one period: even spacing of each dataset's slots."""
        total = int(counts.sum())
        current = np.zeros(len(counts), dtype=np.int64)
        pattern = np.empty(total, dtype=np.int64)
        rank = np.empty(total, dtype=np.int64)
        seen = np.zeros(len(counts), dtype=np.int64)
        for t in range(total):
            current += counts
            d = int(np.argmax(current))
            current[d] -= total
            pattern[t], rank[t] = d, seen[d]
            seen[d] += 1
        return pattern, rank

    def global_index(self, d: int, k: np.ndarray) -> np.ndarray:
        """Mixture index of dataset ``d``'s own index ``k`` (the inverse of :meth:`rows`' mapping)."""
        n = int(self.counts[d])
        return (k // n) * self.period + self.slots[d][k % n]

    def rows(self, gidx: np.ndarray) -> np.ndarray:
        """Samples at mixture indices ``gidx``, each fetched from its dataset's own deterministic order."""
        gidx = np.asarray(gidx, dtype=np.int64)
        cycle, slot = np.divmod(gidx, self.period)
        which = self.pattern[slot]
        local = cycle * self.counts[which] + self.rank_in_period[slot]
        out = np.empty((len(gidx), self.datasets[0].checks.seq_length + 1), dtype=np.int64)
        for d in np.unique(which).tolist():
            sel = which == d
            out[sel] = self.datasets[d].rows(local[sel])
        return out


class _Concat:
    """Datasets one after another (validation of a mixture)."""

    def __init__(self, datasets: list[_Dataset]):
        self.datasets = datasets
        self.starts = np.cumsum([0] + [d.num_samples for d in datasets])

    def global_index(self, d: int, k: np.ndarray) -> np.ndarray:
        """Concatenated index of dataset ``d``'s own index ``k``."""
        return k + int(self.starts[d])

    def rows(self, gidx: np.ndarray) -> np.ndarray:
        """Samples at concatenated indices (wrapping around after the last dataset)."""
        gidx = np.asarray(gidx, dtype=np.int64) % int(self.starts[-1])
        which = np.searchsorted(self.starts, gidx, side="right") - 1
        out = np.empty((len(gidx), self.datasets[0].checks.seq_length + 1), dtype=np.int64)
        for d in np.unique(which).tolist():
            sel = which == d
            out[sel] = self.datasets[d].rows(gidx[sel] - self.starts[d])
        return out


def _rank_slice_mask(g: np.ndarray, *, period: int, width: int, rank: int, end: int | None,
                     offset: int = 0) -> np.ndarray:
    """Indices in slot ``rank`` of width ``width`` of every ``period`` counted from ``offset`` (and
    before ``end``)."""
    mask = ((g - offset) % period) // width == rank
    return mask if end is None else mask & (g < end)


def _mask_of_local(mine, global_index, d: int, k: np.ndarray) -> np.ndarray:
    """``mine`` applied to dataset ``d``'s own indices ``k`` (through the mixture/concat mapping)."""
    return mine(global_index(d, k))


def _templates_per_dataset(url_template, count: int) -> list:
    """One shard URL template (or None) per dataset: a single template serves every dataset, a
    sequence gives each its own (a mixture whose datasets live in different buckets)."""
    if url_template is None or isinstance(url_template, str):
        return [url_template] * count
    templates = list(url_template)
    if len(templates) != count:
        raise DataError("url_template", f"{len(templates)} templates for {count} datasets (give one, or one each)")
    return templates


def _check_distinct_shards(resolved) -> None:
    """Every shard is read once per epoch: none may be listed twice in one dataset (a URL list or
    brace patterns that overlap, ``x.tar`` and ``./x.tar``), nor belong to two datasets of a
    mixture (two datasets whose shards share names, the writer's default prefix, would read each
    other's shards through one URL template; one dataset listed twice would be drawn at the sum of
    its weights). ``resolved``: ``(name, specs, checks)`` per dataset, checked before any read."""
    owner: dict[str, tuple[int, int]] = {}  # shard identity -> (dataset, shard) where first listed
    content: dict[str, tuple[int, int]] = {}  # a manifest's sha256 -> (dataset, shard) where first listed
    for i, (name, specs, _) in enumerate(resolved):
        for k, spec in enumerate(specs):
            j, m = owner.setdefault(_shard_identity(spec), (i, k))
            if (j, m) == (i, k) and spec.sha256:  # within one dataset equal bytes are fine: a repetitive
                j, m = content.setdefault(spec.sha256, (i, k))  # corpus gives equal shards
                if j != i:
                    raise DataError(name, f"shard {spec.url} has the same bytes (sha256 {spec.sha256[:12]}...) as "
                                          f"{resolved[j][1][m].url} of {resolved[j][0]} (mixture dataset {j}): "
                                          "a dataset and its copy would be drawn at the sum of their weights; "
                                          "list the dataset once")
                j, m = i, k
            if (j, m) == (i, k):
                continue
            if j == i:
                first = specs[m].url
                also = "" if first == spec.url else f" (first as {first})"
                raise DataError(spec.url, f"shard listed twice in dataset {name}{also}: list each shard once "
                                          "(it would be read twice per epoch)")
            raise DataError(name, f"shard URL {spec.url} is also a shard of {resolved[j][0]} (mixture "
                                  f"dataset {j}): give each dataset its own shards (its own url_template, "
                                  "or list it once)")


def _shard_identity(spec: ShardSpec) -> str:
    """What makes two shard URLs one shard: the resolved file of a local path (``x.tar``,
    ``./x.tar``, ``file:x.tar`` and a symlink to it are one), else the URL as written."""
    path = spec.local_path
    return spec.url if path is None else file_identity(path)


def _check_one_tokenizer(datasets) -> None:
    """The datasets of a mixture must share one tokenizer (each is checked against the run's
    tokenizer only when the run names one; else against its manifest's, or for plain URLs the first
    shard's, see ``_Dataset._adopt_tokenizer``): token ids of two vocabularies must not be mixed."""
    made_with = {}
    for ds in datasets:
        if ds.checks.tokenizer_sha256:
            made_with.setdefault(ds.checks.tokenizer_sha256, ds.checks.tokenizer_from or ds.name)
    if len(made_with) > 1:
        (sha_a, name_a), (sha_b, name_b) = list(made_with.items())[:2]
        raise DataError(name_b, f"tokenizer mismatch inside the mixture: made with {sha_b[:12]}..., {name_a} "
                                f"with {sha_a[:12]}... (one tokenizer for every dataset)")


# =========================================================================== the loader
class StreamingLoader:
    """Deterministic, resumable, data-parallel iterator over token shards (see module docstring).

    ``manifest_or_urls``: a Manifest, a ``manifest.json`` path or its directory, a webdataset URL
    or brace pattern (``"pipe:cat data/shard-train-{000000..000009}.tar"``), a list of those, or a
    list of ``(source, weight)`` pairs for a weighted mixture. Plain URLs without a manifest are
    counted by a first scan that reads every shard once (use a manifest to avoid it).

    ``split="train"`` iterates forever (epochs roll over); ``split="val"`` iterates the validation
    shards once, in stored order, without shuffling (see :meth:`__len__`).

    ``url_template``: where a manifest's shards are read from (``{name}`` is the shard file name),
    one for every dataset or a list with one per dataset of a mixture; default: next to the manifest.

    ``all_gather``: for a loader built by several processes together (every rank of a job), a
    collective ``f(obj) -> [obj of rank 0, obj of rank 1, ...]`` of small picklable objects (the
    trainer's uses ``torch.distributed.all_gather_object``). The set-up shard checks are then
    decided on the union of every rank's findings, so shards, sample counts and orders are the same
    on every rank (see ``_Dataset._usable_specs``); before those, a DataError met while loading the
    manifests / resolving the URLs is pooled too (:func:`_agreed_setup`: a rank whose mount is
    missing stops every rank with its line instead of leaving them in a collective). It is called
    once for the sources, then once per dataset, in order. None: this process decides alone.

    ``peers_share_rows``: other processes read this one's rows (its tensor / pipeline peers): a
    shard it cannot read mid-run then stops the run in skip mode too (see ``_Dataset._shard_rows``).
    """

    def __init__(self, manifest_or_urls, *, seq_length: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, split: str = "train", num_workers: int = 0,
                 tokenizer_sha256: str | None = None, vocab_size: int | None = None, on_corrupt: str = "error",
                 shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER, url_template: str | None = None,
                 with_index: bool = False, progress: bool = False, partial_reads: bool | None = None,
                 all_gather=None, peers_share_rows: bool = False):
        self._check_args(micro_batch_size, global_batch_size, dp_rank, dp_size, split, on_corrupt, num_workers)
        self.seq_length, self.micro_batch_size, self.global_batch_size = seq_length, micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.split = dp_rank, dp_size, int(seed), split
        self.num_workers, self.with_index = num_workers, with_index
        # worker PROCESSES read and decode shards (threads would share the trainer's GIL); started
        # fresh (spawn), so they are safe next to CUDA, NCCL and DeepSpeed's threads
        self._pool = SignalQuietPool(num_workers, [getattr(signal, name) for name in WORKER_IGNORED_SIGNALS]) \
            if num_workers > 0 else None
        sources = self._as_weighted(manifest_or_urls)

        def resolve():
            templates = _templates_per_dataset(url_template, len(sources))
            resolved = [_resolve_source(src, seq_length=seq_length, tokenizer_sha256=tokenizer_sha256,
                                        vocab_size=vocab_size, split=split, url_template=template)
                        for (src, _), template in zip(sources, templates)]
            _check_distinct_shards(resolved)
            return resolved

        resolved = _agreed_setup(resolve, all_gather)
        self.datasets = [
            _Dataset(*r, seed=self.seed, stream_id=i, shuffle=(split == "train"), shuffle_buffer=shuffle_buffer,
                     on_corrupt=on_corrupt, pool=self._pool, prefetch=max(1, num_workers), workers=num_workers,
                     progress=progress, all_gather=all_gather, peers_share_rows=peers_share_rows)
            for i, r in enumerate(resolved)
        ]
        _check_one_tokenizer(self.datasets)
        self.weights = [w for _, w in sources]
        self._source = self._make_source()
        self._batch_start = 0   # global index where the current global batch begins
        self._partial_reads = dp_size > 1 if partial_reads is None else bool(partial_reads)
        self._restrict_reads()
        self._micro_done = 0    # micro-batches of the current global batch this rank has yielded

    def _make_source(self):
        """One dataset as is; several: weighted interleave for train, plain concatenation for val
        (a validation pass should visit every val sample of every dataset exactly once)."""
        if len(self.datasets) == 1:
            return self.datasets[0]
        if self.split == "val":
            return _Concat(self.datasets)
        return _Mixture(self.datasets, self.weights)

    def _restrict_reads(self) -> None:
        """Tell each dataset which of its samples this rank yields, so it reads only those: by
        positioned reads of just those samples (``partial``, local shards), else from whole shards.

        Partial reads default to ``dp_size > 1``: one rank needs every sample anyway, and reading
        shards whole keeps their sha256 check (a partial read cannot hash the whole shard)."""
        partial = self._partial_reads
        mine = self._rank_mask() if self.dp_size > 1 else None
        for d, ds in enumerate(self.datasets):
            if mine is not None:
                ds.wanted = mine if len(self.datasets) == 1 else \
                    functools.partial(_mask_of_local, mine, self._source.global_index, d)
            ds.partial = partial and all(s.local_path is not None for s in ds.specs)
            ds.forget_blocks()
            if partial and not ds.partial:
                log.info("%s: shards are not local files (pipe or remote URLs): every rank reads them whole",
                         ds.name)

    def _rank_mask(self):
        """``mask(g)``: which global indices ``g`` this rank yields (see the iterators below); global
        batches start at ``_batch_start`` plus multiples of the global batch size (a resume at another
        global batch size may start them off a multiple of it)."""
        if self.split == "train":
            return functools.partial(_rank_slice_mask, period=self.global_batch_size,
                                     width=self.global_batch_size // self.dp_size, rank=self.dp_rank, end=None,
                                     offset=self._batch_start % self.global_batch_size)
        step = self.micro_batch_size * self.dp_size
        return functools.partial(_rank_slice_mask, period=step, width=self.micro_batch_size, rank=self.dp_rank,
                                 end=len(self) * step)

    # ---------------------------------------------------------------- argument checks
    @staticmethod
    def _check_args(mbs, gbs, rank, size, split, on_corrupt, workers) -> None:
        """Batch geometry and options must be consistent; otherwise one clear line."""
        if mbs < 1 or size < 1 or gbs < 1:
            raise DataError("loader", f"micro_batch_size, dp_size and global_batch_size must be >= 1 "
                                      f"(got {mbs}, {size}, {gbs})")
        if gbs % (mbs * size):
            raise DataError("loader", f"global_batch_size {gbs} is not divisible by micro_batch_size * dp_size "
                                      f"= {mbs} * {size}")
        if not 0 <= rank < size:
            raise DataError("loader", f"dp_rank {rank} not in [0, {size})")
        if split not in ("train", "val"):
            raise DataError("loader", f'split must be "train" or "val" (got {split!r})')
        if on_corrupt not in _ON_CORRUPT:
            raise DataError("loader", f'on_corrupt must be "error" or "skip" (got {on_corrupt!r})')
        if workers < 0:
            raise DataError("loader", f"num_workers must be >= 0 (got {workers})")

    @staticmethod
    def _as_weighted(src) -> list[tuple[Any, float]]:
        """Normalise the source argument to ``[(source, weight), ...]``; weights must be > 0."""
        if isinstance(src, (list, tuple)) and src and all(isinstance(x, tuple) and len(x) == 2 for x in src):
            out = []
            for i, (s, w) in enumerate(src):
                name = str(getattr(s, "path", None) or s) if not isinstance(s, list) else f"dataset {i}"
                if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                    raise DataError(name, f"mixture weight must be > 0 (got {w})")
                out.append((s, float(w)))
            return out
        return [(src, 1.0)]

    # ---------------------------------------------------------------- public counters
    @property
    def skipped_shards(self) -> int:
        """Corrupt shards skipped so far (``on_corrupt="skip"``), for TensorBoard."""
        return sum(d.skipped_shards for d in self.datasets)

    @property
    def skipped_shard_names(self) -> frozenset[str]:
        """Where the shards counted by ``skipped_shards`` are (URLs): a run pools them over its
        data-parallel ranks, which meet different shards (training.callbacks.SkippedShards)."""
        return frozenset().union(*(d.skipped_names for d in self.datasets))

    @property
    def shards_read(self) -> int:
        """Shard reads started so far (a resume test checks consumed shards are not read again)."""
        return sum(d.shards_read for d in self.datasets)

    @property
    def rows_read(self) -> int:
        """Samples read and decoded so far (whole shards count all theirs): the per-rank decode work."""
        return sum(d.rows_read for d in self.datasets)

    @property
    def samples_per_epoch(self) -> int:
        """Samples in one pass over the split (sum over datasets for a mixture)."""
        return sum(d.num_samples for d in self.datasets)

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed, counting every rank as having done what this rank did."""
        return self._batch_start + self._micro_done * self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches per rank in one validation pass (train iterates forever: no length)."""
        if self.split != "val":
            raise TypeError("a train StreamingLoader is infinite; len() is defined for split='val'")
        return self.samples_per_epoch // (self.micro_batch_size * self.dp_size)

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[dict]:
        """Micro-batches ``dict(tokens=LongTensor[micro_batch_size, seq_length + 1])`` for this rank."""
        return self._iter_val() if self.split == "val" else self._iter_train()

    def _iter_train(self) -> Iterator[dict]:
        """Forever: global batch after global batch, this rank's contiguous slice of each."""
        per_rank = self.global_batch_size // self.dp_size
        micro_per_rank = per_rank // self.micro_batch_size
        while True:
            while self._micro_done < micro_per_rank:
                start = self._batch_start + self.dp_rank * per_rank + self._micro_done * self.micro_batch_size
                batch = self._make_batch(np.arange(start, start + self.micro_batch_size))
                self._micro_done += 1
                yield batch
            self._batch_start += self.global_batch_size
            self._micro_done = 0

    def _iter_val(self) -> Iterator[dict]:
        """One pass over the validation shards in stored order; the tail that does not fill a step of
        ``micro_batch_size * dp_size`` samples is dropped so every rank yields the same count."""
        step = self.micro_batch_size * self.dp_size
        for t in range(len(self)):
            start = t * step + self.dp_rank * self.micro_batch_size
            yield self._make_batch(np.arange(start, start + self.micro_batch_size))

    def _make_batch(self, gidx: np.ndarray) -> dict:
        """Fetch rows and wrap them as the trainer expects."""
        batch = {"tokens": torch.from_numpy(self._source.rows(gidx))}
        if self.with_index:
            batch["index"] = torch.from_numpy(gidx)
        return batch

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """A few integers that, with the same data and seed, pin the exact next sample. Global, not per
        rank: it is valid for any ``dp_size`` (and any ``global_batch_size`` at a batch boundary)."""
        consumed = self.consumed_samples
        batch_start = self._batch_start
        if consumed - batch_start == self.global_batch_size:  # batch finished: report the boundary
            batch_start = consumed
        return {"version": STATE_VERSION, "seed": self.seed, "consumed_samples": consumed,
                "epoch": consumed // self.samples_per_epoch, "samples_per_epoch": self.samples_per_epoch,
                "global_batch_size": self.global_batch_size, "batch_start": batch_start,
                "shuffle_buffer": self.datasets[0].block, "micro_batch_size": self.micro_batch_size,
                "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken; nothing already consumed is read again."""
        _check_state(state)
        consumed, seed = int(state["consumed_samples"]), int(state["seed"])
        batch_start = int(state.get("batch_start", consumed))
        within = consumed - batch_start
        # mid-batch, each rank has consumed the head of its own slice: only the same geometry continues it
        saved = [int(state.get(key, -1 if key == "global_batch_size" else mine)) for key, mine in
                 (("global_batch_size", None), ("micro_batch_size", self.micro_batch_size), ("dp_size", self.dp_size))]
        if within and (saved != [self.global_batch_size, self.micro_batch_size, self.dp_size]
                       or within % (self.micro_batch_size * self.dp_size)):
            raise DataError("loader state", f"saved in the middle of a global batch ({within} samples in) with global "
                                            f"batch, micro batch and dp sizes {saved}; resuming there needs the same "
                                            f"sizes (this loader: {self.global_batch_size}, {self.micro_batch_size}, "
                                            f"{self.dp_size})")
        if state.get("samples_per_epoch", self.samples_per_epoch) != self.samples_per_epoch:
            log.warning("resuming on a dataset of %d samples/epoch, state was taken on %s: the order differs",
                        self.samples_per_epoch, state.get("samples_per_epoch"))
        if seed != self.seed:
            log.warning("loader seed %d replaced by the checkpoint's seed %d for an exact resume", self.seed, seed)
            self._reseed(seed)
        self._adopt_shuffle_buffer(state.get("shuffle_buffer"))
        realign = (batch_start - self._batch_start) % self.global_batch_size
        self._batch_start = batch_start
        self._micro_done = within // (self.micro_batch_size * self.dp_size)
        if realign and self.split == "train" and self.dp_size > 1:  # this rank's slices moved
            self._restrict_reads()

    def _adopt_shuffle_buffer(self, saved) -> None:
        """The sample order depends on the shuffle block size: the checkpoint's wins, as its seed does
        (states written before it was recorded carry none and keep the configured size)."""
        if saved is None or int(saved) == self.datasets[0].block:
            return
        log.warning("data.shuffle_buffer %d replaced by the checkpoint's %d for an exact resume",
                    self.datasets[0].block, int(saved))
        for d in self.datasets:
            d.set_shuffle_buffer(int(saved))

    def _reseed(self, seed: int) -> None:
        """Adopt another seed: cached orders and blocks of the old seed are no longer valid."""
        self.seed = seed
        for d in self.datasets:
            d.seed = seed
            d._orders.clear()
            d.forget_blocks()

    def close(self) -> None:
        """Stop the worker processes (pending prefetches are abandoned)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# what state_dict() writes: field -> (least, most); None: any integer. The bound on sample counts keeps
# every index computed from them inside int64. consumed_samples and seed are required, the rest are
# absent from states of older versions (shuffle_buffer may also be None there).
_MAX_SAMPLES = 2**62
_STATE_RANGES = {"consumed_samples": (0, _MAX_SAMPLES), "seed": None, "version": None,
                 "epoch": (0, _MAX_SAMPLES), "samples_per_epoch": (0, _MAX_SAMPLES),
                 "global_batch_size": (1, _MAX_SAMPLES), "batch_start": (0, _MAX_SAMPLES),
                 "shuffle_buffer": (1, _MAX_SAMPLES), "micro_batch_size": (1, _MAX_SAMPLES),
                 "dp_size": (1, _MAX_SAMPLES)}


def _check_state(state) -> None:
    """Each field :meth:`StreamingLoader.state_dict` writes that ``state`` holds is an integer in its
    range (:data:`_STATE_RANGES`; consumed_samples and seed must be there), and ``batch_start`` lies
    within the global batch that ends at ``consumed_samples``; a one-line DataError naming the field
    otherwise, not a ValueError, TypeError or OverflowError from deep inside the order later."""
    if not isinstance(state, dict):
        raise DataError("loader state", f"expected a dict, got {type(state).__name__}")
    for key in ("consumed_samples", "seed"):
        if key not in state:
            raise DataError("loader state", f"{key}: missing")
    for key, bounds in _STATE_RANGES.items():
        value = state.get(key)
        if value is None and key == "shuffle_buffer" or key not in state:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise DataError("loader state", f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise DataError("loader state", f"{key}: must be in [{bounds[0]}, {bounds[1]}] (got {value})")
    within = state["consumed_samples"] - state.get("batch_start", state["consumed_samples"])
    if not 0 <= within < state.get("global_batch_size", within + 1):  # state_dict: batch_start <= consumed
        raise DataError("loader state", f"batch_start {state['batch_start']} is not within the global batch "
                                        f"before consumed_samples {state['consumed_samples']}")


class MixtureLoader(StreamingLoader):
    """A :class:`StreamingLoader` over several datasets interleaved deterministically by weight.

    ``datasets`` is ``[(manifest_or_urls, weight), ...]``; a weight <= 0 is a DataError naming the dataset.
    """

    def __init__(self, datasets: Sequence[tuple[Any, float]], **kwargs):
        if not datasets:
            raise DataError("MixtureLoader", "needs at least one (dataset, weight) pair")
        super().__init__([tuple(d) for d in datasets], **kwargs)
