"""``data-pipeline`` command line: build-corpus, train-tokenizer, shard, merge, inspect.

Every data problem ends as one ``error: <file>: <problem>`` line on stderr and exit status 2,
never as a traceback. Long steps show tqdm progress bars (``--quiet`` turns them off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from ascender_dist.config.errors import UserError

from .errors import DataError

_INPUT_HELP = (".txt, .jsonl[.gz|.zst], .parquet, .tar, datasets.save_to_disk directories; directories and "
               "quoted globs of them")
_TOKENIZER_KEYS = {"vocab_size": int, "model_type": str, "pad_vocab_to_multiple_of": int,
                   "user_defined_symbols": list, "input_sentence_size": int}


def _parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per step of the pipeline."""
    p = argparse.ArgumentParser(prog="data-pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    quiet = argparse.ArgumentParser(add_help=False)  # after the step's name too (docs/data.md shows both)
    quiet.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("build-corpus", parents=[quiet], help="write the no-download default corpus (stdlib sources + docs) as JSONL")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--max-bytes", type=_count, default=6_000_000)

    t = sub.add_parser("train-tokenizer", parents=[quiet], help="train a sentencepiece tokenizer")
    t.add_argument("--input", type=Path, nargs="+", required=True, help=_INPUT_HELP)
    t.add_argument("--text-field", default="text", help="JSON field / parquet or datasets column holding the text")
    t.add_argument("--out-prefix", type=Path, required=True, help="writes PREFIX.model, .vocab, .json")
    t.add_argument("--config", type=Path, help="YAML with vocab_size, model_type, pad_vocab_to_multiple_of, "
                                                "user_defined_symbols, input_sentence_size (flags win)")
    t.add_argument("--vocab-size", type=_count)
    t.add_argument("--model-type", choices=["bpe", "unigram", "char", "word"])
    t.add_argument("--special-token", dest="user_defined_symbols", action="append",
                   help="user-defined symbol kept as one piece (repeatable)")
    t.add_argument("--pad-multiple", dest="pad_vocab_to_multiple_of", type=int)
    t.add_argument("--input-sentence-size", type=_count)

    s = sub.add_parser("shard", parents=[quiet], help="tokenize, pack and write webdataset shards + manifest.json")
    s.add_argument("--input", type=Path, nargs="+", required=True, help=_INPUT_HELP)
    s.add_argument("--text-field", default="text", help="JSON field / parquet or datasets column holding the text")
    s.add_argument("--tokenizer", type=Path, required=True, help="the .model file")
    s.add_argument("--out-dir", type=Path, required=True)
    s.add_argument("--seq-length", type=int, required=True)
    size = s.add_mutually_exclusive_group()
    size.add_argument("--samples-per-shard", type=_count)
    size.add_argument("--shard-max-bytes", type=_count)
    s.add_argument("--val-fraction", type=float, default=0.05)
    s.add_argument("--prefix", default="shard")
    s.add_argument("--pad-multiple", type=int, help="override the tokenizer sidecar's padding multiple")
    s.add_argument("--workers", type=int, default=1, help="tokenizing / shard-writing processes (same output)")
    s.add_argument("--job-index", type=int, help="this job's part of the input (with --job-count; then `merge`)")
    s.add_argument("--job-count", type=int, help="number of disjoint jobs (SLURM array tasks, nodes)")

    g = sub.add_parser("merge", parents=[quiet], help="write the shards + manifest of finished `shard --job-index` jobs")
    g.add_argument("out_dir", type=Path, help="the --out-dir every job was given")
    g.add_argument("--workers", type=int, default=1, help="shard-writing processes")
    g.add_argument("--keep-parts", action="store_true", help="keep OUT_DIR/.parts (token streams) after merging")

    i = sub.add_parser("inspect", parents=[quiet], help="counts, token histogram and a decoded sample of a sharded dataset")
    i.add_argument("dataset", type=Path, help="manifest.json or its directory")
    i.add_argument("--tokenizer", type=Path, help="the .model file (decodes pieces and the sample)")
    i.add_argument("--split", default="train", choices=["train", "val"])
    i.add_argument("--sample", type=int, default=0, help="which sample of the split to decode")
    i.add_argument("--top", type=int, default=20, help="most frequent ids to list")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _tokenizer_settings(args) -> dict:
    """Tokenizer settings from the YAML file, then overridden by any flag given."""
    settings: dict = {}
    if args.config is not None:
        settings.update(_read_yaml(args.config))
    for key in _TOKENIZER_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if "vocab_size" not in settings:
        raise DataError("train-tokenizer", "vocab_size is required (--vocab-size or in --config)")
    return settings


@dataclass
class TokenizerSettings:
    """The keys a ``train-tokenizer --config`` YAML may set (at top level or under ``tokenizer:``)."""

    # counts may be written as floats (4.5e2) if they are whole numbers
    vocab_size: Union[int, float, None] = None
    model_type: Optional[str] = None
    pad_vocab_to_multiple_of: Union[int, float, None] = None
    user_defined_symbols: Union[str, list[str], None] = None
    special_tokens: Union[str, list[str], None] = None  # another name for user_defined_symbols
    input_sentence_size: Union[int, float, None] = None


_COUNTS = ("vocab_size", "pad_vocab_to_multiple_of", "input_sentence_size")


def _read_yaml(path: Path) -> dict:
    """The settings a YAML file gives, read by the run configs' strict loader (unknown keys and
    wrong types are one line naming ``file:key``)."""
    from ascender_dist.config.errors import ConfigError
    from ascender_dist.config.loader import from_dict, read_yaml_file

    raw, section = read_yaml_file(path), ""
    if "tokenizer" in raw:
        raw, section = raw["tokenizer"], "tokenizer"
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}:tokenizer", f"expected a mapping of tokenizer settings (got {raw!r})")
    try:
        settings = from_dict(TokenizerSettings, raw, section)
    except ConfigError as exc:
        raise ConfigError(f"{path}:{exc.path}", exc.message) from None
    out = {k: v for k, v in dataclasses.asdict(settings).items() if v is not None}
    for key in _COUNTS:
        if key in out and not float(out[key]).is_integer():
            raise ConfigError(f"{path}:{section + '.' if section else ''}{key}", f"expected int (got {out[key]!r})")
        if key in out:
            out[key] = int(out[key])
    if "special_tokens" in out:
        if "user_defined_symbols" in out:  # one of the two lists would be dropped
            raise ConfigError(f"{path}:{section + '.' if section else ''}special_tokens",
                              "special_tokens and user_defined_symbols are one setting (two names): give one")
        out["user_defined_symbols"] = out.pop("special_tokens")
    if isinstance(out.get("user_defined_symbols"), str):
        out["user_defined_symbols"] = [out["user_defined_symbols"]]
    return out


def _count(text: str) -> int:
    """A whole number written as the YAML files accept it (``6000000``, ``6_000_000``, ``6e6``):
    argparse's ``int`` refuses ``6e6``, which docs/data.md says is accepted."""
    digits = text.replace("_", "")
    try:
        return int(digits)  # exact, however large
    except ValueError:
        pass
    try:
        value = float(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def _cmd_build_corpus(args) -> int:
    from ._io import check_writable
    from .corpus import build_default_corpus
    check_writable(args.out)  # before collecting the documents, not after (an existing file: build_default_corpus)
    path = build_default_corpus(args.out, args.max_bytes, progress=not args.quiet)
    n = sum(1 for _ in open(path, "rb"))
    print(f"wrote {path} ({n} documents, {path.stat().st_size:,} bytes)")
    return 0


def _cmd_train_tokenizer(args) -> int:
    from .tokenizer import Tokenizer, train_tokenizer
    model = train_tokenizer(args.input, args.out_prefix, progress=not args.quiet, text_field=args.text_field,
                            **_tokenizer_settings(args))
    tok = Tokenizer.load(model)
    print(f"wrote {model} (vocab {tok.vocab_size}, padded {tok.padded_vocab_size}, sha256 {tok.sha256[:12]}...)")
    return 0


def _cmd_shard(args) -> int:
    from . import parallel
    from .shards import write_shards
    from .tokenizer import Tokenizer
    tok = Tokenizer.load(args.tokenizer, args.pad_multiple)
    if (args.job_index is None) != (args.job_count is None):
        raise DataError("shard", "--job-index and --job-count go together")
    parallel.check_workers(args.workers)
    if args.job_count is not None:
        parallel.check_shard_settings(args.out_dir, args.seq_length, args.val_fraction, args.samples_per_shard,
                                      args.shard_max_bytes, args.prefix)
        settings = parallel.shard_settings(args.seq_length, args.samples_per_shard, args.shard_max_bytes,
                                           args.val_fraction, args.prefix)
        mark = parallel.run_job(list(args.input), tok, args.out_dir / parallel.PARTS_DIR, settings,
                                job_index=args.job_index, job_count=args.job_count, workers=args.workers,
                                text_field=args.text_field)
        print(f"wrote {mark}; when all {args.job_count} jobs are done: data-pipeline merge {args.out_dir}")
        return 0
    if args.workers > 1:
        m = parallel.write_shards_parallel(list(args.input), tok, args.out_dir, args.seq_length, workers=args.workers,
                                           samples_per_shard=args.samples_per_shard,
                                           shard_max_bytes=args.shard_max_bytes, val_fraction=args.val_fraction,
                                           prefix=args.prefix, text_field=args.text_field)
    else:
        m = write_shards(list(args.input), tok, args.out_dir, args.seq_length,
                         samples_per_shard=args.samples_per_shard, shard_max_bytes=args.shard_max_bytes,
                         val_fraction=args.val_fraction, prefix=args.prefix, progress=not args.quiet,
                         text_field=args.text_field)
    _print_manifest(m)
    return 0


def _cmd_merge(args) -> int:
    from .parallel import merge
    _print_manifest(merge(args.out_dir, workers=args.workers, keep_parts=args.keep_parts))
    return 0


def _print_manifest(m) -> None:
    for split in ("train", "val"):
        shards = m.split_shards(split)
        print(f"{split}: {len(shards)} shards, {m.num_samples(split):,} samples, "
              f"{sum(s.num_tokens for s in shards):,} tokens")
    print(f"wrote {m.path}")


def _cmd_inspect(args) -> int:
    for flag in ("top", "sample"):  # a negative count would slice from the end: all rows but one
        if getattr(args, flag) < 0:
            raise DataError(f"--{flag}", f"must be >= 0 (got {getattr(args, flag)})")
    summary = inspect_dataset(args.dataset, tokenizer=args.tokenizer, split=args.split, sample=args.sample,
                              top=args.top, progress=not args.quiet)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"dataset {summary['manifest']}  seq_length {summary['seq_length']}  vocab {summary['vocab_size']} "
          f"(padded {summary['padded_vocab_size']})  tokenizer {summary['tokenizer_sha256'][:12]}...")
    for split, c in summary["splits"].items():
        print(f"  {split}: {c['shards']} shards, {c['samples']:,} samples, {c['tokens']:,} tokens")
    print(f"  documents {summary['num_documents']:,}, dropped tail tokens {summary['dropped_tokens']}")
    print(f"top {len(summary['top_tokens'])} token ids in {args.split} ({summary['histogram_tokens']:,} tokens):")
    for row in summary["top_tokens"]:
        print(f"  {row['id']:>7} {row['count']:>10,} {row['fraction']:7.2%}  {row.get('piece', '')!r}")
    print(f"sample {args.sample} of {args.split}:")
    print(summary.get("sample_text", summary["sample_ids"]))
    return 0


def inspect_dataset(dataset: Path, tokenizer: Path | None = None, split: str = "train", sample: int = 0,
                    top: int = 20, progress: bool = True) -> dict:
    """Counts per split, a histogram of token ids over ``split`` and one decoded sample, as a dict."""
    from tqdm import tqdm

    from .loader import ShardChecks, ShardSpec, read_shard
    from .shards import load_manifest
    from .tokenizer import Tokenizer
    m = load_manifest(dataset)
    tok = Tokenizer.load(tokenizer) if tokenizer else None
    if tok is not None and tok.sha256 != m.tokenizer_sha256:
        raise DataError(str(tokenizer), f"tokenizer mismatch: dataset made with {m.tokenizer_sha256[:12]}...")
    shards = m.split_shards(split)
    if not shards:
        raise DataError(str(m.path), f'no "{split}" shards')
    if not 0 <= sample < m.num_samples(split):
        raise DataError(str(m.path), f"sample {sample} out of range [0, {m.num_samples(split)})")
    checks = ShardChecks(m.seq_length, m.tokenizer_sha256, m.vocab_size)
    hist = np.zeros(m.padded_vocab_size, dtype=np.int64)
    seen, sample_ids = 0, None
    for s in tqdm(shards, desc=f"inspect {split}", unit="shard", disable=not progress):
        arr = read_shard(ShardSpec(m.shard_url(s), s.num_samples, s.sha256, s.bytes), checks)
        hist += np.bincount(arr.reshape(-1), minlength=len(hist))[: len(hist)]
        if sample_ids is None and sample < seen + len(arr):
            sample_ids = arr[sample - seen].tolist()
        seen += len(arr)
    total = int(hist.sum())
    order = np.argsort(-hist, kind="stable")[:top]
    top_rows = [{"id": int(i), "count": int(hist[i]), "fraction": float(hist[i] / max(total, 1))}
                for i in order if hist[i] > 0]
    if tok is not None:
        for row in top_rows:
            row["piece"] = tok.sp.id_to_piece(row["id"])
    summary = {
        "manifest": str(m.path), "seq_length": m.seq_length, "vocab_size": m.vocab_size,
        "padded_vocab_size": m.padded_vocab_size, "tokenizer_sha256": m.tokenizer_sha256,
        "num_documents": m.num_documents, "dropped_tokens": m.dropped_tokens,
        "splits": {sp: {"shards": len(m.split_shards(sp)), "samples": m.num_samples(sp),
                        "tokens": sum(x.num_tokens for x in m.split_shards(sp))} for sp in ("train", "val")},
        "histogram_tokens": total, "distinct_ids": int((hist > 0).sum()), "top_tokens": top_rows,
        "sample_ids": sample_ids,
    }
    if tok is not None:
        summary["sample_text"] = tok.decode(sample_ids)
    return summary


_COMMANDS = {"build-corpus": _cmd_build_corpus, "train-tokenizer": _cmd_train_tokenizer,
             "shard": _cmd_shard, "merge": _cmd_merge, "inspect": _cmd_inspect}


class _Terminated(BaseException):
    """SIGTERM in the main process, raised so that every ``finally`` removes its temporary files."""


def _stop_with_cleanup(main_pid: int):
    """A SIGTERM / SIGINT handler for the main process: it ends the worker processes (--workers: a
    pool's exit would wait for their current task, forever for a worker blocked in a read) and
    raises _Terminated (SIGTERM: what timeout, scancel and docker stop send) or KeyboardInterrupt,
    so that every ``finally`` removes its temporary files. A forked worker that inherited it dies
    as the signal's default would have it."""
    import os
    import signal

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        import multiprocessing

        for child in multiprocessing.active_children():
            child.terminate()
        raise _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``data-pipeline`` / ``python -m data_pipeline``); returns the exit status.
    SIGTERM and Ctrl-C end a command through its cleanup (its temporary directories removed; a
    merge stopped after it published keeps what it published) with one line, not a traceback:
    exit 143 / 130."""
    import os
    import signal
    import threading

    args = _parser().parse_args(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        handler = _stop_with_cleanup(os.getpid())
        for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if signal.getsignal(signum) == default:  # an ignored signal stays ignored
                previous[signum] = signal.signal(signum, handler)
    try:
        return _COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (_Terminated, KeyboardInterrupt) as e:
        name, status = ("SIGTERM", 143) if isinstance(e, _Terminated) else ("SIGINT", 130)
        print(f"error: data-pipeline {args.command}: stopped by {name} (its temporary files were removed)",
              file=sys.stderr)
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
