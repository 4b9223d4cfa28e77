"""Sharding in parallel: worker processes on one machine, disjoint jobs across nodes, one merge.

Why two phases: a sample is cut from the *concatenated* token stream of the whole corpus (each
document + EOS), so where part j's samples begin depends on how many tokens parts 0..j-1 gave,
which nobody knows until they are tokenized. So

1. **tokenize** (parallel, the expensive part): the ordered inputs are split into contiguous parts
   (whole files, byte ranges of ``.jsonl``, row-group ranges of ``.parquet``; balanced by bytes);
   each process writes its part's token stream (document tokens + EOS, in the dataset's dtype) to
   ``OUT/.parts/``. A job ``--job-index I --job-count J`` does part I of J (split again over its
   ``--workers``) and writes ``job-IIIII-of-JJJJJ.json`` (five-digit, zero-padded) last, as its completion mark.
2. **merge** (parallel over shards): the part streams, concatenated in order, are exactly the
   single-process stream, cut into the same samples and shards; each shard is written from
   memory-mapped parts, then the manifest. The result is byte-identical to a one-process run.

Nothing is visible in ``OUT`` before merge succeeds (shards in a temporary directory, manifest
last, atomically); a failed job leaves no part file and no completion mark; merge removes the
parts only after the manifest is written, and then the old shards it does not list (as
:func:`data_pipeline.shards.write_shards` does). What commits data is written after that data is
on disk (see :mod:`data_pipeline._io`): part files and their directory are fsynced before the
job mark, shards before the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._io import atomic_write_json, fsync_dir, make_dirs, run_temp_dir, sha256_bytes, write_durably, writing_into
from .errors import DataError
from .formats import DEFAULT_TEXT_FIELD, Piece, expand_inputs, iter_piece, kind_of, parquet_file
from .shards import (Manifest, ShardInfo, _samples_per_shard, check_shard_prefix, check_shard_settings, commit,
                     encode_shard, encoded_documents, token_dtype)
from .tokenizer import Tokenizer
from .workers import SignalQuietPool

PARTS_DIR = ".parts"


# =========================================================================== splitting the input
@dataclass
class _Unit:
    """A piece of input and how it may be cut: anywhere ("bytes"), at row groups ("groups"), or not."""

    piece: Piece
    size: int
    kind: str
    group_sizes: tuple[int, ...] = ()


def _units(pieces: list[Piece]) -> list[_Unit]:
    """Sizes and cut rules of the pieces (parquet row-group sizes come from the file footer)."""
    out = []
    for piece in pieces:
        path = Path(piece.path)
        kind = kind_of(path)
        if kind == "jsonl":
            hi = path.stat().st_size if piece.hi < 0 else piece.hi
            out.append(_Unit(Piece(piece.path, piece.lo, hi), hi - piece.lo, "bytes"))
        elif kind == "parquet":
            meta = parquet_file(path).metadata
            hi = meta.num_row_groups if piece.hi < 0 else piece.hi
            sizes = tuple(max(1, meta.row_group(g).total_byte_size) for g in range(piece.lo, hi))
            out.append(_Unit(Piece(piece.path, piece.lo, hi), sum(sizes), "groups", sizes))
        else:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
                else path.stat().st_size
            out.append(_Unit(piece, size, "whole"))
    return out


def partition(pieces: list[Piece], n: int) -> list[list[Piece]]:
    """``n`` contiguous, order-preserving parts of ``pieces`` of about equal bytes: concatenating
    the parts' documents gives the documents of ``pieces``. A piece goes to the part that holds its
    first byte; ``.jsonl`` pieces are cut at the part boundaries, ``.parquet`` at row groups."""
    units = _units(pieces)
    total = sum(u.size for u in units)
    parts: list[list[Piece]] = [[] for _ in range(n)]

    def part_of(offset: int) -> int:
        return min(n - 1, offset * n // total) if total else 0

    offset = 0
    for u in units:
        if u.kind == "whole":
            parts[part_of(offset)].append(u.piece)
        elif u.kind == "bytes":
            cuts = [u.piece.lo] + [u.piece.lo + (-(-k * total // n) - offset) for k in range(1, n)
                                   if offset < -(-k * total // n) < offset + u.size] + [u.piece.hi]
            for lo, hi in zip(cuts, cuts[1:]):
                if hi > lo:
                    parts[part_of(offset + lo - u.piece.lo)].append(Piece(u.piece.path, lo, hi))
        else:
            start, group_offset = u.piece.lo, offset
            for g, size in enumerate(u.group_sizes):
                p = part_of(group_offset)
                group_offset += size
                if g + 1 == len(u.group_sizes) or part_of(group_offset) != p:  # next group starts elsewhere
                    parts[p].append(Piece(u.piece.path, start, u.piece.lo + g + 1))
                    start = u.piece.lo + g + 1
        offset += u.size
    return parts


def plan_fingerprint(files: list[Path], text_field: str) -> str:
    """Identity of a job plan (inputs, their sizes, text field): every job of one merge must agree."""
    desc = [[str(p.resolve()), p.stat().st_size if p.is_file() else -1] for p in files] + [text_field]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()


# =========================================================================== phase 1: tokenize
def _tokenize_part(pieces: list[Piece], model_path: str, dtype_name: str, text_field: str, out_path: str) -> dict:
    """(Worker process.) Token stream of ``pieces`` (each document + EOS) written to ``out_path`` and
    fsynced: the job mark written after it vouches for it by its size alone, so its bytes must be on
    disk first (a part whose size persisted without its data would merge into shards of token 0)."""
    tok = Tokenizer.load(Path(model_path))
    dtype = np.dtype(dtype_name)
    n_docs = n_tokens = n_bytes = 0
    docs = (text for piece in pieces for text in iter_piece(piece, text_field))
    with open(out_path, "wb") as f:
        for ids, end, text_bytes in encoded_documents(docs, tok):
            n_docs += end
            n_bytes += text_bytes
            arr = np.empty(len(ids) + end, dtype=dtype)
            arr[: len(ids)] = ids
            if end:
                arr[-1] = tok.eos_id
            f.write(arr.tobytes())
            n_tokens += len(arr)
        f.flush()
        os.fsync(f.fileno())
    return {"num_documents": n_docs, "num_tokens": n_tokens, "text_bytes": n_bytes}


def check_workers(workers: int, command: str = "shard") -> None:
    """``--workers`` is a process count: >= 1 (below 1 would quietly mean one process, or crash the pool)."""
    if workers < 1:
        raise DataError(command, f"--workers must be >= 1 (got {workers})")


def _pool(workers: int) -> SignalQuietPool:
    """Worker processes that leave Ctrl-C to the main process, which alone reports it
    (data_pipeline.cli ends the workers), without a traceback per worker."""
    return SignalQuietPool(workers, (signal.SIGINT,))


def run_job(inputs, tokenizer: Tokenizer, parts_dir: Path, settings: dict, *, job_index: int = 0,
            job_count: int = 1, workers: int = 1, text_field: str = DEFAULT_TEXT_FIELD,
            pool: ProcessPoolExecutor | None = None) -> Path:
    """Tokenize part ``job_index`` of ``job_count`` of ``inputs`` with ``workers`` processes into
    ``parts_dir``; write the completion mark ``job-IIIII-of-JJJJJ.json`` last and return its path.
    ``settings`` (seq_length, shard sizes, val_fraction, prefix) travel with it to the merge.
    ``pool``: processes to use instead of starting ``workers`` new ones."""
    if not (job_count >= 1 and 0 <= job_index < job_count):
        raise DataError("shard", f"--job-index must be in [0, --job-count) (got {job_index} of {job_count})")
    check_workers(workers)
    tokenizer.check_document_separator()
    if tokenizer.model_path is None:
        raise DataError("shard", "parallel sharding needs a tokenizer loaded from a .model file")
    files = expand_inputs(inputs)
    mine = partition([Piece(str(p)) for p in files], job_count)[job_index]
    sub = partition(mine, workers) if mine else [[] for _ in range(workers)]
    make_dirs(parts_dir)
    stem = f"job-{job_index:05d}-of-{job_count:05d}"
    tmp = run_temp_dir(parts_dir, stem)
    try:
        dtype = token_dtype(tokenizer.padded_vocab_size).name
        args = [(pieces, str(tokenizer.model_path), dtype, text_field, str(tmp / f"{stem}.{k:03d}.bin"))
                for k, pieces in enumerate(sub)]
        with _pool(workers) if pool is None else nullcontext(pool) as p, writing_into(parts_dir):
            futures = [p.submit(_tokenize_part, *a) for a in args]  # input errors arrive as DataErrors
            results = [f.result() for f in futures]
        parts = []
        for (_, _, _, _, path), res in zip(args, results):
            final = parts_dir / Path(path).name
            os.replace(path, final)
            parts.append({"file": final.name, **res})
        fsync_dir(parts_dir)  # the parts' names on disk before the mark that lists them
        mark = parts_dir / f"{stem}.json"
        atomic_write_json(mark, {"job_index": job_index, "job_count": job_count,
                                 "plan": plan_fingerprint(files, text_field), "tokenizer": tokenizer.describe(),
                                 "settings": settings, "parts": parts})
        return mark
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# =========================================================================== phase 2: merge
class _TokenStream:
    """The concatenated token streams of the parts, read through memory maps.

    Where each part starts in the stream comes from the token counts of the job marks (the merge
    has checked every part's size against them), so nothing is opened up front: a slice maps only
    the parts it lies in, on first use. A shard task needs one or two of the jobs x workers parts;
    mapping all of them cost ~240 ms per shard at 1024 parts."""

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype):
        self.files, self.counts, self.dtype = list(files), [int(n) for n in counts], np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def part(self, k: int) -> np.ndarray:
        """Part ``k``'s tokens, memory-mapped on first use (an empty part has no map)."""
        if k not in self._maps:
            n = self.counts[k]
            self._maps[k] = np.memmap(self.files[k], dtype=self.dtype, mode="r", shape=(n,)) if n \
                else np.empty(0, self.dtype)
        return self._maps[k]

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of the whole stream."""
        if not 0 <= lo <= hi <= len(self):
            raise ValueError(f"token range [{lo}, {hi}) outside the stream's {len(self)} tokens")
        out = []
        k = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            a = lo - int(self.starts[k])
            take = min(hi - lo, self.counts[k] - a)
            if take > 0:
                out.append(np.asarray(self.part(k)[a:a + take]))
                lo += take
            k += 1
        return np.concatenate(out) if len(out) != 1 else out[0]


def _check_part_ids(stream: "_TokenStream", files, rows: np.ndarray, start: int, vocab_size: int) -> None:
    """Every token of a shard's rows below the vocabulary size, or a DataError naming the part file
    that holds the first one past it: a part damaged after its job finished (the job marks record
    sizes only) would otherwise be vouched for by the new manifest's sha256."""
    bad = np.flatnonzero(rows.reshape(-1) >= vocab_size)
    if bad.size:
        pos = start + int(bad[0])
        k = int(np.searchsorted(stream.starts, pos, side="right")) - 1
        raise DataError(str(files[k]), f"token id {int(rows.reshape(-1)[bad[0]])} >= vocab size {vocab_size} at "
                                       f"token {pos - int(stream.starts[k])}: the part is damaged; run its job again")


def _write_shard(files, counts, dtype_name: str, meta: dict, first: int, count: int, sample_len: int,
                 path: str) -> tuple[str, dict]:
    """(Worker process.) Shard of samples ``[first, first + count)`` written to ``path`` and fsynced
    (the merge's move and manifest commit it); only the parts those samples lie in are opened."""
    stream = _TokenStream([Path(f) for f in files], counts, np.dtype(dtype_name))
    rows = stream.slice(first * sample_len, (first + count) * sample_len).reshape(count, sample_len)
    _check_part_ids(stream, files, rows, first * sample_len, meta["vocab_size"])
    data = encode_shard(list(rows), np.dtype(dtype_name), meta)
    write_durably(Path(path), data)
    return path, {"num_samples": count, "num_tokens": count * sample_len, "sha256": sha256_bytes(data),
                  "bytes": len(data)}


# what run_job writes into a job mark: field -> type (nested objects by their own table)
_MARK_FIELDS = {"job_index": int, "job_count": int, "plan": str, "tokenizer": dict, "settings": dict, "parts": list}
_MARK_TOKENIZER = {"tokenizer_sha256": str, "vocab_size": int, "padded_vocab_size": int, "eos_id": int,
                   "pad_id": int}
_MARK_SETTINGS = {"seq_length": int, "samples_per_shard": (int, type(None)), "shard_max_bytes": (int, type(None)),
                  "val_fraction": (int, float), "prefix": str}
_MARK_PART = {"file": str, "num_documents": int, "num_tokens": int}


def _check_record(where: str, record, fields: dict, prefix: str = "") -> None:
    """``record`` is an object holding every field of ``fields`` with its type (a bool is no
    number); a one-line DataError naming ``where`` and the field otherwise."""
    if not isinstance(record, dict):
        raise DataError(where, f"{prefix.rstrip('.') or 'job mark'}: expected a JSON object, "
                               f"got {type(record).__name__}")
    for key, kind in fields.items():
        if key not in record:
            raise DataError(where, f"{prefix}{key}: missing")
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise DataError(where, f"{prefix}{key}: expected {names}, got {type(value).__name__} {value!r}")


def _check_mark(path: Path, mark) -> None:
    """A job mark has the shape :func:`run_job` writes, so merge never trips over a KeyError."""
    _check_record(str(path), mark, _MARK_FIELDS)
    _check_record(str(path), mark["tokenizer"], _MARK_TOKENIZER, "tokenizer.")
    _check_record(str(path), mark["settings"], _MARK_SETTINGS, "settings.")
    for i, part in enumerate(mark["parts"]):
        _check_record(str(path), part, _MARK_PART, f"parts[{i}].")


def _read_marks(parts_dir: Path) -> list[dict]:
    """Completion marks of every job, checked to belong to one plan with every job present."""
    marks = []
    for path in sorted(parts_dir.glob("job-*-of-*.json")):
        try:
            marks.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise DataError(str(path), f"unreadable job mark ({e})") from None
        _check_mark(path, marks[-1])
    if not marks:
        raise DataError(str(parts_dir), "no finished shard jobs to merge (run `shard --job-index I --job-count J`)")
    count = marks[0]["job_count"]
    for m in marks:
        for key in ("job_count", "plan", "tokenizer", "settings"):
            if m[key] != marks[0][key]:
                raise DataError(str(parts_dir / f"job-{m['job_index']:05d}-of-{m['job_count']:05d}.json"),
                                f"{key} differs from job {marks[0]['job_index']}'s: jobs of different runs")
    missing = sorted(set(range(count)) - {m["job_index"] for m in marks})
    if missing:
        raise DataError(str(parts_dir), f"jobs {missing} of {count} have not finished")
    return sorted(marks, key=lambda m: m["job_index"])


def merge(out_dir: Path, *, parts_dir: Path | None = None, workers: int = 1, keep_parts: bool = False,
          pool: ProcessPoolExecutor | None = None) -> Manifest:
    """Cut the finished jobs' token streams into shards and write the manifest (see module docstring)."""
    check_workers(workers, "merge")
    out_dir = Path(out_dir)
    parts_dir = Path(parts_dir) if parts_dir is not None else out_dir / PARTS_DIR
    marks = _read_marks(parts_dir)
    tok, settings = marks[0]["tokenizer"], marks[0]["settings"]
    check_shard_prefix(settings["prefix"])  # jobs of an older version may carry any prefix
    parts = [p for m in marks for p in m["parts"]]
    files, counts = [str(parts_dir / p["file"]) for p in parts], [int(p["num_tokens"]) for p in parts]
    for f, n in zip(files, counts):
        if not Path(f).is_file() or Path(f).stat().st_size != n * token_dtype(tok["padded_vocab_size"]).itemsize:
            raise DataError(f, f"missing or wrong-size part file (expected {n} tokens)")
    dtype = token_dtype(tok["padded_vocab_size"])
    sample_len = settings["seq_length"] + 1
    capacity = _samples_per_shard(settings["samples_per_shard"], settings["shard_max_bytes"], sample_len, dtype)
    n_tokens = sum(counts)
    n_samples = n_tokens // sample_len
    if n_samples == 0:
        raise DataError(str(out_dir), f"documents gave fewer than {sample_len} tokens: not one sample to write")
    meta = {"tokenizer_sha256": tok["tokenizer_sha256"], "seq_length": settings["seq_length"], "dtype": dtype.name,
            "vocab_size": tok["vocab_size"]}
    tmp_dir = run_temp_dir(out_dir, "shards")
    try:
        jobs = [(files, counts, dtype.name, meta, i, min(capacity, n_samples - i), sample_len,
                 str(tmp_dir / f"{i // capacity:06d}.tar")) for i in range(0, n_samples, capacity)]
        with writing_into(out_dir):  # a full disk: one line naming the output folder
            if pool is not None or workers > 1:
                with _pool(workers) if pool is None else nullcontext(pool) as p:
                    results = list(p.map(_write_shard, *zip(*jobs)))
            else:
                results = [_write_shard(*j) for j in jobs]
        written = [(Path(p), ShardInfo(name="", split="", **info)) for p, info in results]
        manifest = commit(written, tmp_dir, out_dir, settings["prefix"], settings["val_fraction"],
                          seq_length=settings["seq_length"], tokenizer_sha256=tok["tokenizer_sha256"],
                          vocab_size=tok["vocab_size"], padded_vocab_size=tok["padded_vocab_size"],
                          eos_id=tok["eos_id"], pad_id=tok["pad_id"], dtype=dtype.name,
                          num_documents=sum(p["num_documents"] for p in parts),
                          dropped_tokens=n_tokens - n_samples * sample_len)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if not keep_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)
    return manifest


def write_shards_parallel(inputs, tokenizer: Tokenizer, out_dir: Path, seq_length: int, *, workers: int,
                          samples_per_shard: int | None = None, shard_max_bytes: int | None = None,
                          val_fraction: float = 0.05, prefix: str = "shard",
                          text_field: str = DEFAULT_TEXT_FIELD) -> Manifest:
    """:func:`data_pipeline.shards.write_shards` with ``workers`` processes: same bytes, same manifest."""
    out_dir = Path(out_dir)
    check_workers(workers)
    tokenizer.check_document_separator()  # before the output directory is made
    check_shard_settings(out_dir, seq_length, val_fraction, samples_per_shard, shard_max_bytes, prefix)
    parts_dir = run_temp_dir(out_dir, "parts")
    try:
        with _pool(workers) as pool:  # one set of processes for both phases
            run_job(inputs, tokenizer, parts_dir, shard_settings(seq_length, samples_per_shard, shard_max_bytes,
                                                                  val_fraction, prefix),
                    workers=workers, text_field=text_field, pool=pool)
            return merge(out_dir, parts_dir=parts_dir, workers=workers, pool=pool)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)


def shard_settings(seq_length, samples_per_shard, shard_max_bytes, val_fraction, prefix) -> dict:
    """What the merge needs besides the tokens (recorded in every job's mark)."""
    return {"seq_length": seq_length, "samples_per_shard": samples_per_shard, "shard_max_bytes": shard_max_bytes,
            "val_fraction": val_fraction, "prefix": prefix}
