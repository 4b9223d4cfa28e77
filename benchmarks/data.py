"""Data pipeline throughput on this machine, against what a cluster needs.

Run:  OMP_NUM_THREADS=1 python benchmarks/data.py [--max-bytes 6000000] [--repeats 5] [--sections ...]
      python benchmarks/data.py --render      # rewrite data.md / data.png from data.json, no runs

Measures: sharding MB/s with 1 and 2 worker processes, the two alternating within each of ``--repeats``
rounds (median and fastest run of each, and the median and minimum of the same-round speedup), and the
hours each scaling preset's corpus would take on 64 cores; tokenizer training's peak memory on a corpus larger than its sample;
loader tokens/s per rank with 0, 1 and 2 worker processes (and 2 at node-level DP) at each preset's
sequence length and micro-batch - the four settings rotated within each of ``max(5, --repeats)``
rounds, with the median and minimum of each one's ratio to workers=0 of the same round - beside one H100 SXM's consumption at 40% MFU for that preset (FLOPs/token from
``ascender_dist/models/counting.py``), and the loader's memory; per-rank decode work and tokens/s
at DP 2 and DP 64 with whole-shard reads (every rank decodes every shard) against reads of the
rank's own samples only, interleaved in one process; resume latency (median and minimum).

``--sections`` re-runs only some sections; the others keep the previous run's numbers from
``data.json`` (the report says which sections are from which run).

Writes ``benchmarks/results/data.md`` (naming CPU model, threads, load average, the git commit and the
sentencepiece / webdataset / numpy versions: the machine is shared, so every figure is a median of
``--repeats`` runs or of interleaved rounds), ``data.png`` (loader tokens/s per setting against the GPU's
consumption) and ``data.json`` (raw numbers, and the sha256 of every ``configs/scaling/*.yaml`` config read,
``provenance.config_hash``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_pipeline.corpus import build_default_corpus  # noqa: E402
from data_pipeline.loader import StreamingLoader  # noqa: E402
from data_pipeline.shards import load_manifest, write_shards  # noqa: E402
from data_pipeline.tokenizer import Tokenizer, iter_documents, train_tokenizer  # noqa: E402
from ascender_dist.machine import cpu_model  # noqa: E402
from ascender_dist.versions import package_versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
H100_SXM_BF16_TFLOPS = 989.0
MFU = 0.4
CORES = 64
PRESETS = ("small", "medium", "large")
VERSIONED = ("sentencepiece", "webdataset", "numpy")  # what tokenizes, reads the shards, holds the samples


# --------------------------------------------------------------------------- machine
def machine() -> dict:
    """CPU model, hardware threads, the threads this process may use, memory, versions, load."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    import torch
    return {"cpu": cpu_model(), "threads": os.cpu_count(), "usable_threads": len(os.sched_getaffinity(0)),
            "ram_gib": round(mem), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__, "versions": package_versions(VERSIONED),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "loadavg_start": os.getloadavg()}


def timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


# --------------------------------------------------------------------------- presets
def preset_needs(preset: str) -> dict:
    """Sequence length, micro-batch, layout and one H100 SXM's token rate at 40% MFU for the
    ``gpt-<preset>`` scaling config (GPT has the fewest FLOPs/token of the three architectures,
    so it consumes tokens fastest), and the corpus tokens of the hungriest architecture."""
    from ascender_dist.config.loader import to_dict
    from ascender_dist.config.resolve import load_config
    from ascender_dist.models.counting import count_model
    from ascender_dist.research.ablate.provenance import config_hash

    hashes = {}
    cfg = load_config(REPO / "configs" / "scaling" / f"gpt-{preset}.yaml")
    flops = count_model(cfg.model, 32000, cfg.parallel.tensor_model_parallel_size).flops_per_token
    per_gpu = MFU * H100_SXM_BF16_TFLOPS * 1e12 / flops
    p = cfg.parallel
    replica = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    tokens = 0
    for arch in ("gpt", "ascender", "connection"):
        c = load_config(REPO / "configs" / "scaling" / f"{arch}-{preset}.yaml")
        hashes[f"configs/scaling/{arch}-{preset}.yaml"] = config_hash(to_dict(c))
        tokens = max(tokens, c.train.train_steps * c.train.global_batch_size * c.model.seq_length)
    return {"config_sha256": hashes, "seq_length": cfg.model.seq_length, "micro_batch_size": cfg.train.micro_batch_size,
            "flops_per_token": flops, "gpu_tokens_per_s": per_gpu, "replica_gpus": replica,
            # every rank of a model replica (TP/PP peers) loads the replica's batch
            "rank_needs_tokens_per_s": per_gpu * replica, "node_dp": 8 // replica, "corpus_tokens": tokens}


# --------------------------------------------------------------------------- sharding
def bench_sharding(corpus: Path, model: Path, work: Path, args) -> dict:
    """Seconds of `data-pipeline shard` (a fresh process, as a user runs it) with 1 and 2 workers, the two
    run back to back in each of ``args.repeats`` rounds (1 worker first in even rounds, 2 in odd ones): per
    setting the median and minimum time and every run; the same-round speedup (1-worker time / 2-worker
    time), median and minimum."""
    from benchmarks.report import ratio_summary

    times: dict = {1: [], 2: []}
    for r in range(args.repeats):
        for workers in ((1, 2) if r % 2 == 0 else (2, 1)):
            dest = work / f"shards-w{workers}-{r}"
            cmd = [sys.executable, "-m", "data_pipeline", "--quiet", "shard", "--input", str(corpus), "--tokenizer",
                   str(model), "--out-dir", str(dest), "--seq-length", "1024", "--samples-per-shard",
                   str(args.samples_per_shard), "--workers", str(workers)]
            _, seconds = timed(subprocess.run, cmd, check=True, capture_output=True, cwd=REPO)
            times[workers].append(seconds)
    out: dict = {}
    for workers, ts in times.items():
        out[f"shard_s_w{workers}"], out[f"shard_s_w{workers}_min"] = median(ts), min(ts)
    out["shard_runs"] = {f"w{w}": ts for w, ts in times.items()}
    out["shard_speedup_w2"] = ratio_summary(times[1], times[2])
    out["shard_outputs_identical"] = (work / "shards-w1-0" / "manifest.json").read_bytes() == \
        (work / "shards-w2-0" / "manifest.json").read_bytes()  # the manifest holds every shard's sha256
    return out


def repeated(corpus: Path, copies: int, path: Path) -> Path:
    """The corpus file ``copies`` times over (a larger input for throughput runs)."""
    data = corpus.read_bytes()
    path.write_bytes(data * copies)
    return path


# --------------------------------------------------------------------------- tokenizer memory
_TOK_MEM = """
import resource, sys, time
from pathlib import Path
from data_pipeline.tokenizer import train_tokenizer
t = time.perf_counter()
train_tokenizer([Path(p) for p in sys.argv[3:]], Path(sys.argv[1]), 8192, input_sentence_size=int(sys.argv[2]),
                progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.perf_counter() - t)
"""


def tokenizer_files(prefix: Path) -> list[Path]:
    """The files train_tokenizer writes for ``prefix`` (it refuses to replace them)."""
    return [prefix.with_name(prefix.name + suffix) for suffix in (".model", ".vocab", ".json")]


def remove_previous(*paths: Path) -> None:
    """Delete a previous run's outputs in the work directory: each step is timed again, and the
    corpus and tokenizer steps refuse to replace an existing file."""
    for path in paths:
        path.unlink(missing_ok=True)


def tokenizer_peak_memory(files, prefix: Path, sample_lines: int) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of a tokenizer training run in a fresh process."""
    remove_previous(*tokenizer_files(prefix))
    out = subprocess.run([sys.executable, "-c", _TOK_MEM, str(prefix), str(sample_lines), *map(str, files)],
                         capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    rss, seconds = out.stdout.split()
    return int(rss), float(seconds)


def big_corpus(corpus: Path, work: Path, copies: int) -> list[Path]:
    """``copies`` variants of the corpus as one .txt and one .jsonl.zst (a corpus larger than the sample)."""
    import zstandard
    docs = list(iter_documents([corpus]))
    txt, zst = work / "big.txt", work / "big.jsonl.zst"
    with open(txt, "w", encoding="utf-8") as f:
        for c in range(copies // 2):
            for d in docs:
                f.write(d.replace("def ", f"def v{c}_"))
    with open(zst, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
        for c in range(copies // 2, copies):
            for d in docs:
                f.write((json.dumps({"text": d.replace("def ", f"def v{c}_")}) + "\n").encode())
    return [txt, zst]


# --------------------------------------------------------------------------- loader
def bench_loader(ds: Path, seq: int, mbs: int, num_workers: int, dp_size: int, micro_batches: int,
                 shuffle_buffer: int) -> float:
    """Tokens per second this rank's loader yields (rank 0 of ``dp_size``), after a warm-up that
    also absorbs the worker processes' start."""
    ld = StreamingLoader(ds, seq_length=seq, micro_batch_size=mbs, global_batch_size=mbs * dp_size * 4, dp_rank=0,
                         dp_size=dp_size, seed=1, num_workers=num_workers, shuffle_buffer=shuffle_buffer)
    it = iter(ld)
    for _ in range(8):
        next(it)
    t = time.perf_counter()
    tokens = sum(next(it)["tokens"].numel() for _ in range(micro_batches))
    rate = tokens / (time.perf_counter() - t)
    ld.close()
    return rate


def bench_own_rows(ds: Path, seq: int, mbs: int, dp_size: int, partial: bool, micro_batches: int,
                   shuffle_buffer: int) -> tuple[float, float]:
    """(tokens/s, samples decoded per sample yielded) of rank 0 of ``dp_size`` without worker
    processes (the CPU work one process does), reading whole shards (``partial=False``: every rank
    decodes every shard of the blocks it touches) or only its own samples. One micro-batch per rank
    per step, so every shuffle block holds samples of every rank, as in a run whose global batch is
    smaller than the shuffle buffer."""
    ld = StreamingLoader(ds, seq_length=seq, micro_batch_size=mbs, global_batch_size=mbs * dp_size, dp_rank=0,
                         dp_size=dp_size, seed=1, shuffle_buffer=shuffle_buffer, partial_reads=partial)
    it = iter(ld)
    for _ in range(4):
        next(it)
    rows0 = ld.rows_read
    t = time.perf_counter()
    tokens = sum(next(it)["tokens"].numel() for _ in range(micro_batches))
    seconds = time.perf_counter() - t
    return tokens / seconds, (ld.rows_read - rows0) / (micro_batches * mbs)


def own_rows_section(ds_of: dict, presets: dict, args) -> dict:
    """Whole-shard vs own-sample reads at DP 2 and DP 64, interleaved, ``max(5, repeats)`` rounds."""
    settings = [(p, dp, partial) for p in presets for dp in (2, 64) for partial in (False, True)]
    runs: dict = {k: [] for k in settings}
    for _ in range(max(5, args.repeats)):
        for p, dp, partial in settings:
            seq, mbs = presets[p]["seq_length"], presets[p]["micro_batch_size"]
            n = max(args.micro_batches // 3, math.ceil(8 * args.shuffle_buffer / (mbs * dp)))  # >= 8 blocks
            runs[(p, dp, partial)].append(bench_own_rows(ds_of[p], seq, mbs, dp, partial, n, args.shuffle_buffer))
    from benchmarks.report import ratio_stats

    out = {}
    for (p, dp, partial), vals in runs.items():
        rates = [v[0] for v in vals]
        out.setdefault(p, {})[f"dp{dp}_{'own' if partial else 'whole'}"] = {
            "median": median(rates), "min": min(rates), "runs": len(rates), "rates": rates,
            "decoded_per_yielded": median([v[1] for v in vals])}
    for p, row in out.items():  # own / whole of the same round (the two ran back to back)
        for dp in (2, 64):
            stats = ratio_stats(row[f"dp{dp}_own"]["rates"], row[f"dp{dp}_whole"]["rates"])
            row[f"dp{dp}_own"]["over_whole"] = {"median": stats["median"], "min": stats["min"]}
    return out


_LOADER_MEM = """
import resource, sys
from data_pipeline.loader import StreamingLoader
seq, mbs, workers, n, buffer, dp = map(int, sys.argv[2:8])
ld = StreamingLoader(sys.argv[1], seq_length=seq, micro_batch_size=mbs, global_batch_size=mbs * dp * 4, dp_rank=0,
                     dp_size=dp, seed=1, num_workers=workers, shuffle_buffer=buffer)
it = iter(ld)
for _ in range(n):
    next(it)
import psutil
workers = [c.memory_info().rss for c in psutil.Process().children(recursive=True)]
ld.close()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, max(workers or [0]))
"""


def loader_memory(ds: Path, seq: int, mbs: int, workers: int, batches: int, shuffle_buffer: int,
                  dp_size: int = 1) -> tuple[int, int]:
    """(peak RSS of the training process, largest RSS of a worker process at the end), in bytes,
    for rank 0 of ``dp_size``."""
    out = subprocess.run([sys.executable, "-c", _LOADER_MEM, str(ds), str(seq), str(mbs), str(workers), str(batches),
                          str(shuffle_buffer), str(dp_size)], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    main_rss, child_rss = map(int, out.stdout.split())
    return main_rss, child_rss


def bench_resume(ds: Path, seq: int, mbs: int, fraction: float, shuffle_buffer: int) -> tuple[float, int]:
    """Seconds from construction + load_state_dict at ``fraction`` of an epoch to the first batch,
    and the shards read."""
    gbs = mbs * 4
    t = time.perf_counter()
    ld = StreamingLoader(ds, seq_length=seq, micro_batch_size=mbs, global_batch_size=gbs, dp_rank=0, dp_size=1,
                         seed=1, shuffle_buffer=shuffle_buffer)
    consumed = int(ld.samples_per_epoch * fraction) // gbs * gbs
    ld.load_state_dict({"seed": 1, "consumed_samples": consumed, "global_batch_size": gbs})
    next(iter(ld))
    return time.perf_counter() - t, ld.shards_read


# --------------------------------------------------------------------------- main
SECTIONS = ("sharding", "tokenizer", "loader", "own_rows", "resume")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-bytes", type=int, default=6_000_000, help="default-corpus size")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--samples-per-shard", type=int, default=128)
    p.add_argument("--shuffle-buffer", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=300, help="loader micro-batches timed per setting")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median reported; >= 5)")
    p.add_argument("--copies", type=int, default=4, help="corpus copies sharded and loaded (a larger dataset)")
    p.add_argument("--big-copies", type=int, default=16, help="corpus copies for the tokenizer-memory run")
    p.add_argument("--sample-lines", type=int, default=100_000, help="tokenizer input_sentence_size there")
    p.add_argument("--work-dir", type=Path, help="keep intermediate files here (default: a temp dir)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} to run; the others keep the numbers "
                        "of the previous run's data.json")
    p.add_argument("--render", action="store_true", help="rewrite data.md and data.png from data.json, no runs")
    args = p.parse_args(argv)
    if args.render:
        write_results(json.loads((RESULTS / "data.json").read_text()), json_too=False)
        return 0
    if args.repeats < 5:
        p.error("--repeats must be >= 5 (the machine is shared: a median of fewer runs is noise)")
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    from ascender_dist.research.ablate.provenance import git_state  # research extra, only when run

    res: dict = previous_results(sections)
    res.update({"machine": machine(), "settings": {k: v for k, v in vars(args).items() if k != "work_dir"},
                **git_state()})
    res.setdefault("section_runs", {}).update({x: res["machine"]["loadavg_start"] for x in sections})
    res.setdefault("section_commits", {}).update({x: {k: res[k] for k in ("git_commit", "git_dirty")}
                                                  for x in sections})

    remove_previous(work / "corpus.jsonl", *tokenizer_files(work / "tok"))  # a --work-dir used before
    corpus, res["corpus_s"] = timed(build_default_corpus, work / "corpus.jsonl", args.max_bytes, progress=False)
    text_bytes = sum(len(t.encode("utf-8")) for t in iter_documents([corpus]))
    res["text_mb"] = text_bytes / 1e6
    model, res["tokenizer_train_s"] = timed(train_tokenizer, [corpus], work / "tok", args.vocab_size, progress=False)
    tok = Tokenizer.load(model)

    # sharding: the corpus `copies` times over, 1 vs 2 processes
    big_input = repeated(corpus, args.copies, work / "corpus-x.jsonl")
    if "sharding" in sections:
        res.update(bench_sharding(big_input, model, work, args))
        for w in (1, 2):
            res[f"shard_mb_per_s_w{w}"] = args.copies * res["text_mb"] / res[f"shard_s_w{w}"]
            res[f"shard_mb_per_s_w{w}_best"] = args.copies * res["text_mb"] / res[f"shard_s_w{w}_min"]
        print(f"sharding: {res['shard_mb_per_s_w1']:.2f} / {res['shard_mb_per_s_w2']:.2f} MB/s", flush=True)
    elif not (work / "shards-w1-0" / "manifest.json").exists():
        write_shards([big_input], tok, work / "shards-w1-0", 1024, samples_per_shard=args.samples_per_shard,
                     progress=False)
    m = load_manifest(work / "shards-w1-0")
    res["bytes_per_token"] = args.copies * text_bytes / (sum(s.num_tokens for s in m.shards) + m.dropped_tokens)

    if "tokenizer" in sections:  # the corpus vs one `big_copies` times larger, same sample size
        big = big_corpus(corpus, work, args.big_copies)
        res["big_corpus_mb"] = sum(f.stat().st_size for f in big[:1]) / 1e6 + \
            sum(len(t.encode()) for t in iter_documents(big[1:])) / 1e6
        res["tok_rss_small"], res["tok_s_small"] = tokenizer_peak_memory([corpus], work / "tm-small",
                                                                         args.sample_lines)
        res["tok_rss_big"], res["tok_s_big"] = tokenizer_peak_memory(big, work / "tm-big", args.sample_lines)
        print(f"tokenizer peak RSS: {res['tok_rss_small'] / 2**20:.0f} / {res['tok_rss_big'] / 2**20:.0f} MiB",
              flush=True)

    needs = {preset: preset_needs(preset) for preset in PRESETS}
    res["config_sha256"] = {path: h for need in needs.values() for path, h in need.pop("config_sha256").items()}
    ds_of = {}
    for preset, need in needs.items():
        seq = need["seq_length"]
        ds_of[preset] = work / "shards-w1-0" if seq == 1024 else work / f"ds-{seq}"
        if not (ds_of[preset] / "manifest.json").exists():
            write_shards([big_input], tok, ds_of[preset], seq, samples_per_shard=args.samples_per_shard,
                         progress=False)
    if "loader" in sections:
        res["presets"] = {}
        for preset, need in needs.items():
            res["presets"][preset] = loader_section(ds_of[preset], need, args)
    if "own_rows" in sections:
        res["own_rows"] = own_rows_section(ds_of, needs, args)
        for preset, row in res["own_rows"].items():
            print(f"own rows {preset}: DP64 {row['dp64_whole']['median']:,.0f} -> {row['dp64_own']['median']:,.0f} "
                  "tokens/s", flush=True)
    if "resume" in sections:
        for frac in (0.1, 0.9):
            for tag, buf in (("", args.shuffle_buffer), ("_small_buffer", args.samples_per_shard)):
                key = f"{int(frac * 100)}{tag}"
                runs = [bench_resume(m.path.parent, 1024, 8, frac, buf) for _ in range(args.repeats)]
                res[f"resume_s_{key}"] = median([r[0] for r in runs])
                res[f"resume_s_{key}_min"] = min(r[0] for r in runs)
                res[f"resume_s_{key}_runs"] = [r[0] for r in runs]
                res[f"resume_shards_{key}"] = runs[0][1]
    res["train_samples_1024"] = m.num_samples("train")
    res["train_shards_1024"] = len(m.split_shards("train"))
    res["train_samples_2048"] = load_manifest(work / "ds-2048").num_samples("train")
    res["machine"]["loadavg_end"] = os.getloadavg()

    write_results(res)
    return 0


def write_results(res: dict, json_too: bool = True) -> None:
    """data.md and data.png (and data.json, unless re-rendering it); prints the report."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    if json_too:
        (RESULTS / "data.json").write_text(json.dumps(res, indent=2) + "\n")
    has_plot = plot(res, RESULTS / "data.png")
    (RESULTS / "data.md").write_text(render(res, has_plot))
    print((RESULTS / "data.md").read_text())


PLOT_SETTINGS = (("w0", "workers=0"), ("w1", "1 worker"), ("w2", "2 workers"), ("w2_node_dp", "2 workers, node DP"))


def plot(r: dict, path: Path) -> bool:
    """data.png: per preset, the loader's tokens/s per rank for each setting (bar: median over the rounds;
    tick: the slowest round) against one H100 SXM's consumption at 40% MFU (the GPU need per rank of the
    loader table). False (nothing drawn) when the results hold no loader section."""
    if not r.get("presets"):
        return False
    from ascender_dist.plotting import pyplot

    plt = pyplot()  # one line naming the research extra when matplotlib is missing
    presets = list(r["presets"])
    fig, ax = plt.subplots(figsize=(11, 4.6))
    width = 0.8 / len(PLOT_SETTINGS)
    for i, (key, label) in enumerate(PLOT_SETTINGS):
        xs = [j + (i - (len(PLOT_SETTINGS) - 1) / 2) * width for j in range(len(presets))]
        meds = [r["presets"][p].get(key, float("nan")) for p in presets]
        ax.bar(xs, meds, width, label=label)
        lows = [min(r["presets"][p]["loader_runs"][key]) if key in r["presets"][p].get("loader_runs", {})
                else float("nan") for p in presets]
        ax.plot(xs, lows, "k_", markersize=10, label="slowest round" if i == 0 else None)
    needs = [r["presets"][p]["rank_needs_tokens_per_s"] for p in presets]
    for j, need in enumerate(needs):
        ax.hlines(need, j - 0.45, j + 0.45, colors="red", linestyles="--", zorder=3,
                  label="GPU need per rank (1 H100 SXM, 40% MFU)" if j == 0 else None)
        ax.annotate(f"{need / 1e6:.2f} M", (j + 0.45, need), fontsize=7, color="red", textcoords="offset points",
                    xytext=(2, -3))
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(needs) / 3)
    ax.set_xticks(range(len(presets)),
                  [f"{p}\nseq {r['presets'][p]['seq_length']} x mb {r['presets'][p]['micro_batch_size']}"
                   for p in presets])
    ax.set_ylabel("tokens/s per rank (median over rounds)")
    ax.set_title("StreamingLoader throughput vs the GPU's consumption", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    mc = r["machine"]
    fig.suptitle(f"{mc['cpu']}, {mc['threads']} hardware threads (shared), OMP_NUM_THREADS={mc['omp_num_threads']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _kept_repeats(r: dict) -> str:
    """How many runs the sections kept from an earlier invocation took (their medians' size)."""
    if "machine_previous" not in r:
        return ""
    n = r.get("settings_previous", {}).get("repeats")
    kept = f"{n} runs" if n else "3 runs (that run's default; its settings were not kept)"
    return f" in this invocation's sections; {kept} in the sections kept from the full run"


def previous_results(sections: list[str]) -> dict:
    """The previous data.json when only some sections run (its machine line kept as ``machine_previous``)."""
    path = RESULTS / "data.json"
    if set(sections) == set(SECTIONS) or not path.exists():
        return {}
    prev = json.loads(path.read_text())
    prev["machine_previous"] = prev.get("machine_previous") or prev["machine"]
    if "git_previous" not in prev:
        prev["git_previous"] = {k: prev.get(k) for k in ("git_commit", "git_dirty")}
    prev.setdefault("settings_previous", prev.get("settings", {}))  # the full run's, before this one's replace them
    return prev


LOADER_SETTINGS = ("w0", "w1", "w2", "w2_node_dp")


def loader_section(ds: Path, need: dict, args) -> dict:
    """Tokens/s of rank 0 with 0, 1, 2 workers at DP 1 and with 2 workers at node DP, the four settings
    run back to back in an order rotated by one each round, ``max(5, repeats)`` rounds: per setting the
    median rate and the median and minimum of its ratio to the same round's workers=0 rate; memory."""
    from benchmarks.report import ratio_summary

    seq, mbs = need["seq_length"], need["micro_batch_size"]
    row = dict(need)
    setting = {f"w{w}": (w, 1, args.micro_batches) for w in (0, 1, 2)}
    setting["w2_node_dp"] = (2, need["node_dp"], args.micro_batches // 2)
    runs: dict = {k: [] for k in LOADER_SETTINGS}
    load_start = os.getloadavg()[0]
    for r in range(max(5, args.repeats)):
        for k in LOADER_SETTINGS[r % len(LOADER_SETTINGS):] + LOADER_SETTINGS[: r % len(LOADER_SETTINGS)]:
            workers, dp, batches = setting[k]
            runs[k].append(bench_loader(ds, seq, mbs, workers, dp, batches, args.shuffle_buffer))
    for k, rates in runs.items():
        row[k] = median(rates)
    row["loader_runs"] = runs
    row["loader_rounds"] = len(runs["w0"])
    row["loader_load"] = [load_start, os.getloadavg()[0]]
    row["loader_x_w0"] = {k: ratio_summary(runs[k], runs["w0"])
                          for k in LOADER_SETTINGS[1:]}
    row["loader_w2_x_w1"] = ratio_summary(runs["w2"], runs["w1"])
    row["rss_main"], row["rss_worker"] = loader_memory(ds, seq, mbs, 2, 200, args.shuffle_buffer)
    row["rss_main_dp64"], row["rss_worker_dp64"] = loader_memory(ds, seq, mbs, 2, 200, args.shuffle_buffer, 64)
    print(f"loader {seq}x{mbs}: {row['w1']:,.0f} / {row['w2']:,.0f} tokens/s "
          f"(needs {row['rank_needs_tokens_per_s']:,.0f})", flush=True)
    return row


def loader_method(r: dict) -> list[str]:
    """How the loader table's figures were taken (interleaved rounds, or an older run's back-to-back medians)."""
    rows = [row for row in r["presets"].values() if "loader_rounds" in row]
    if not rows:
        return [f"Each figure: the median of {r['settings']['repeats']} back-to-back runs of one setting (an older "
                "run, before the settings were interleaved).", ""]
    return [f"Interleaved: per preset, {rows[0]['loader_rounds']} rounds, each running the four settings (0, 1, 2 "
            "workers at DP 1; 2 workers at node DP) back to back in an order rotated by one each round. Rates: "
            "medians over the rounds; in brackets the same round's ratio to workers=0, median and minimum; "
            "'2 / 1 workers': the same-round ratio, median (min). `load`: 1-minute load average at the start / "
            "end of the preset's rounds. Raw rates per round: `loader_runs` in data.json.", ""]


def own_rows_lines(r: dict) -> list[str]:
    """The whole-shard vs own-samples table (per-rank work and rate at DP 2 and DP 64)."""
    runs = next(iter(r["own_rows"].values()))["dp2_own"]["runs"]
    lines = ["### What each rank reads: whole shards vs its own samples", "",
             "Rank 0 of DP 2 and of DP 64 (simulated: one process that is rank 0), no worker processes (the "
             "work of one process), one micro-batch per rank per step, timed over at least 8 shuffle blocks; "
             f"interleaved in one process, {runs} rounds, median (min). 'whole' (`partial_reads=False`) reads, "
             "checksums and decodes every shard of the blocks it touches, as every rank did before ranks read "
             "their own samples (and as the loader still does at DP 1, for pipe/remote URLs and for shards not "
             "in the layout `encode_shard` writes); 'own' (the default with DP > 1) reads only the rank's "
             "samples. 'decoded / yielded' is samples decoded per sample the rank yields.", "",
             "| preset | DP | whole: tokens/s | own: tokens/s | own / whole | decoded / yielded: whole | own | "
             "own vs GPU need |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p, row in r["own_rows"].items():
        need = r["presets"][p]["rank_needs_tokens_per_s"] if p in r.get("presets", {}) else float("nan")
        for dp in (2, 64):
            w, o = row[f"dp{dp}_whole"], row[f"dp{dp}_own"]
            if "over_whole" in o:  # median (min) of the same-round ratios
                ratio = f"**{o['over_whole']['median']:.1f}x** ({o['over_whole']['min']:.1f})"
            else:  # an older run recorded no rounds: the ratio of its medians
                ratio = f"**{o['median'] / w['median']:.1f}x** (ratio of medians)"
            lines.append(f"| {p} | {dp} | {w['median'] / 1e6:.2f} M ({w['min'] / 1e6:.2f}) | "
                         f"{o['median'] / 1e6:.1f} M ({o['min'] / 1e6:.1f}) | {ratio} | "
                         f"{w['decoded_per_yielded']:.1f} | {o['decoded_per_yielded']:.2f} | "
                         f"{o['median'] / need:.0f}x |")
    lines += ["", "With whole reads a rank's decoding grows with DP (every sample of the blocks it touches: tens "
              "of samples per sample it yields at DP 64); with own-sample reads it stays at one, so at DP 64 one process without workers delivers the rate "
              "above, against the GPU's need in the last column. Own-sample reads check each sample's tar and npy "
              "headers, the shard's size, meta.json and end-of-archive position, but not the sha256 of the whole "
              "shard (that needs every byte; `partial_reads=False` restores it at any DP).", ""]
    return lines


def provenance(r: dict) -> list[str]:
    """Which sections this report's numbers come from, when some were kept from a previous run."""
    if "machine_previous" not in r:
        return []
    from benchmarks.report import commit_text

    load = lambda t: " / ".join(f"{x:.2f}" for x in t)  # noqa: E731
    commits = r.get("section_commits", {})
    fresh = ", ".join(f"{k} (load {load(v)}; {commit_text(commits.get(k)).lower()})" for k, v in r["section_runs"].items())

    return [f"Sections re-run after the last full run (each with its load average): {fresh}. The others are from that full run, "
            f"load average at its start {load(r['machine_previous']['loadavg_start'])}, "
            f"{commit_text(r.get('git_previous')).lower()}.", ""]


def _versions(mc: dict) -> str:
    """``, sentencepiece 0.2.0, webdataset 1.0.2, numpy 2.1.0`` (records before versions were kept: empty)."""
    return "".join(f", {name} {version or 'not installed'}" for name, version in mc.get("versions", {}).items())


def _sharding_lines(r: dict, w1: float, w2: float) -> list[str]:
    """The sharding table and its same-round speedup (older records: medians only)."""
    best = lambda w: f" ({r[f'shard_mb_per_s_w{w}_best']:.2f})" if f"shard_mb_per_s_w{w}_best" in r else ""  # noqa: E731
    head = "MB/s of text: median (fastest run)" if "shard_mb_per_s_w1_best" in r else "MB/s of text (median)"
    lines = [f"| processes | {head} | per process |", "|---:|---:|---:|",
             f"| 1 (`shard`) | {w1:.2f}{best(1)} | {w1:.2f} |",
             f"| 2 (`shard --workers 2`) | {w2:.2f}{best(2)} | {w2 / 2:.2f} |", ""]
    sp = r.get("shard_speedup_w2")
    if sp:
        runs = len(r.get("shard_runs", {}).get("w1", []))
        lines.append(f"Scaling 1 -> 2 processes, the two alternating in each of {runs} rounds: same-round speedup "
                     f"{sp['median']:.2f}x median, {sp['min']:.2f}x minimum (efficiency {min(1.0, sp['median'] / 2):.0%}; "
                     "includes starting the worker processes and the merge). Outputs byte-identical: "
                     f"{'yes' if r['shard_outputs_identical'] else 'NO'}.")
    else:  # an older run: all 1-worker runs, then all 2-worker runs
        lines.append(f"Scaling 1 -> 2 processes: {w2 / w1:.2f}x, the ratio of the medians of back-to-back runs of "
                     f"each (an older run, before the two were alternated; efficiency {min(1.0, w2 / (2 * w1)):.0%}; "
                     "includes starting the worker processes and the merge). Outputs byte-identical: "
                     f"{'yes' if r['shard_outputs_identical'] else 'NO'}.")
    return lines + [""]


def _resume_ms(r: dict, key: str) -> str:
    """``123 ms`` (median), ``(min 110)`` beside it when recorded."""
    low = r.get(f"resume_s_{key}_min")
    return f"{r[f'resume_s_{key}'] * 1000:.0f} ms" + (f" (min {low * 1000:.0f})" if low is not None else "")


def render(r: dict, has_plot: bool = False) -> str:
    """The markdown report."""
    from benchmarks.report import commit_text

    s, mc = r["settings"], r["machine"]
    load = lambda t: " / ".join(f"{x:.2f}" for x in t)  # noqa: E731
    w1, w2 = r["shard_mb_per_s_w1"], r["shard_mb_per_s_w2"]
    sp = r.get("shard_speedup_w2")
    eff = min(1.0, sp["median"] / 2) if sp else min(1.0, w2 / (2 * w1))
    lines = ["# Data pipeline benchmark", "",
             f"Machine: {mc['cpu']}, {mc['threads']} hardware threads ({mc['usable_threads']} usable by this "
             f"process), {mc['ram_gib']} GiB RAM, {mc['os']}, Python {mc['python']}, torch {mc['torch']}"
             f"{_versions(mc)}, OMP_NUM_THREADS={mc['omp_num_threads']}. {commit_text(r)} (the latest invocation).",
             "",
             f"Load average (1/5/15 min) at start {load(mc['loadavg_start'])}, at end {load(mc['loadavg_end'])}: the "
             "machine is shared with other jobs, so these figures are noisy (each is the median of "
             f"{s['repeats']} runs{_kept_repeats(r)}, or of interleaved rounds where a table says so) and, where the "
             "load exceeds the thread count, low.", "",
             *provenance(r),
             "## Sharding (tokenize + pack + write)", "",
             f"Input: the default corpus ({r['text_mb']:.2f} MB of text) {s['copies']} times over in one .jsonl; "
             f"`data-pipeline shard` as a fresh process; vocab {s['vocab_size']}, seq 1024, "
             f"{r['bytes_per_token']:.2f} bytes of text per token.", "",
             *_sharding_lines(r, w1, w2),
             f"Hours to shard each preset's corpus on {CORES} cores (jobs or workers), from the per-core rate "
             f"{w1:.2f} MB/s and the measured efficiency {eff:.0%} (assumed to hold to {CORES}; the corpus is the "
             "largest of the three architectures' 20-tokens-per-parameter budgets; a 32k vocabulary packs more "
             "text per token than this 8k one, so real corpora are larger in bytes):", "",
             "| preset | corpus tokens | text GB (at this bytes/token) | hours, 1 core | hours, 64 cores "
             f"(efficiency {eff:.0%}) | hours, 64 cores (linear) |",
             "|---|---:|---:|---:|---:|---:|"]
    for preset, row in r["presets"].items():
        gb = row["corpus_tokens"] * r["bytes_per_token"] / 1e9
        h1 = gb * 1e3 / w1 / 3600
        h64, lin = h1 / (CORES * eff), h1 / CORES
        lines.append(f"| {preset} | {row['corpus_tokens'] / 1e9:.1f} B | {gb:.1f} | {h1:.1f} | "
                     f"{h64:.3f} ({h64 * 60:.1f} min) | {lin:.3f} ({lin * 60:.1f} min) |")
    lines += ["", "Tokenizing (sentencepiece's encode) is ~90% of a process's time and every part is independent "
              "until the merge, so the work divides across processes; a 1 -> 2 efficiency below ~90% here means "
              "the second process did not get a free core (see the load average above)."]
    lines += ["", "## Tokenizer training memory (streamed input)", "",
              f"Same settings (BPE, vocab 8192, `input_sentence_size` {s['sample_lines']:,} lines), peak RSS of a "
              "fresh process (`ru_maxrss`):", "",
              "| corpus | size | peak RSS | time |", "|---|---:|---:|---:|",
              f"| default corpus (.jsonl) | {r['text_mb']:.0f} MB | {r['tok_rss_small'] / 2**20:.0f} MiB | "
              f"{r['tok_s_small']:.0f} s |",
              f"| {s['big_copies']} variants of it (.txt + .jsonl.zst) | {r['big_corpus_mb']:.0f} MB | "
              f"{r['tok_rss_big'] / 2**20:.0f} MiB | {r['tok_s_big']:.0f} s |", "",
              "Inputs are streamed (a `.txt` line by line, other formats record by record) and sentencepiece keeps "
              "only its reservoir sample of `input_sentence_size` lines, so peak memory follows the sample, not "
              "the corpus.", "",
              "## Loader against one H100 SXM at 40% MFU", "",
              f"Per rank, `StreamingLoader` with worker **processes**; each preset's sequence length and micro-batch "
              f"(`configs/scaling/gpt-*.yaml`), datasets of {r['train_samples_1024']:,} (seq 1024) and "
              f"{r['train_samples_2048']:,} (seq 2048) samples in shards of {s['samples_per_shard']}, shuffle buffer "
              f"{s['shuffle_buffer']}, page cache warm. GPU need = 0.4 x {H100_SXM_BF16_TFLOPS:.0f} TFLOP/s / "
              "training FLOPs per token (GPT, 32k vocabulary: the fastest consumer of the three architectures), "
              "times the GPUs of one model replica (TP x PP: every rank of a replica loads the replica's batch).", "",
              *loader_method(r),
              "| preset | seq x micro-batch | GPU need / rank | workers=0 | 1 worker | 2 workers | 2 workers / GPU need | "
              "2 / 1 workers | 2 workers at node DP | node DP / GPU need | workers for 20x at node DP | load |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for preset, row in r["presets"].items():
        need = row["rank_needs_tokens_per_s"]
        implied = math.ceil(20 * need / (row["w2_node_dp"] / 2))  # at node DP, each worker adding its share
        x = row.get("loader_x_w0", {})
        rel = lambda k: f" ({x[k]['median']:.2f}x, min {x[k]['min']:.2f}x)" if k in x else ""  # noqa: E731
        w21 = row.get("loader_w2_x_w1")  # an older run: the ratio of the medians
        w21 = f"{w21['median']:.2f}x (min {w21['min']:.2f}x)" if w21 else f"{row['w2'] / row['w1']:.2f}x"
        lines.append(
            f"| {preset} | {row['seq_length']} x {row['micro_batch_size']} | {need / 1e6:.2f} M | "
            f"{row['w0'] / 1e6:.1f} M | {row['w1'] / 1e6:.1f} M{rel('w1')} | {row['w2'] / 1e6:.1f} M{rel('w2')} | "
            f"**{row['w2'] / need:.0f}x** | {w21} | "
            f"{row['w2_node_dp'] / 1e6:.1f} M at DP{row['node_dp']}{rel('w2_node_dp')} | "
            f"**{row['w2_node_dp'] / need:.0f}x** | {implied} | "
            + (" / ".join(f"{v:.1f}" for v in row["loader_load"]) if "loader_load" in row else "") + " |")
    lines += ["", "Tokens/s per rank. 'node DP' is rank 0 of a data-parallel group of one 8-GPU node's size; with "
              "more than one rank each rank reads only the samples it yields (positioned reads of local shards, "
              "see below), so the rate a rank delivers no longer falls with DP beyond the cost of the reads "
              "themselves. 'workers for 20x' extrapolates the node-DP rate linearly from 2 workers (each worker "
              "adding half the 2-worker rate); the training process still assembles the rank's part of every "
              "shuffle block, which caps that scaling.", ""]
    if has_plot:
        lines += ["![loader tokens/s per rank against the GPU's need](data.png)", ""]
    if "own_rows" in r:
        lines += own_rows_lines(r)
    lines += ["Loader memory per rank (2 workers, 200 micro-batches, peak RSS): "
              + "; ".join(f"{p} {row['rss_main'] / 2**20:.0f} MiB peak in the training process + "
                          f"{row['rss_worker'] / 2**20:.0f} MiB per worker at DP 1"
                          + (f", {row['rss_main_dp64'] / 2**20:.0f} + {row['rss_worker_dp64'] / 2**20:.0f} MiB "
                             "as rank 0 of 64" if "rss_main_dp64" in row else "")
                          for p, row in r["presets"].items())
              + ". Bounded by design: two shuffle blocks of the rank's own samples, the next block's reads in "
              "flight, and (for shards read whole) (workers + 2) decoded shards + the shards one block spans, "
              "plus one batch, beyond the imports (torch and webdataset are most of each figure).", "",
              "## Resume", "",
              "| Measurement | Result |", "|---|---|",
              f"| Resume at 10% of an epoch (construct + load_state_dict + first batch), shuffle buffer "
              f"{s['shuffle_buffer']} | {_resume_ms(r, '10')}, {r['resume_shards_10']} shard(s) read |",
              f"| Resume at 90%, shuffle buffer {s['shuffle_buffer']} | {_resume_ms(r, '90')}, "
              f"{r['resume_shards_90']} shard(s) read |",
              f"| Resume at 10% / 90%, shuffle buffer {s['samples_per_shard']} (= shard size) | "
              f"{_resume_ms(r, '10_small_buffer')} / {_resume_ms(r, '90_small_buffer')}, "
              f"{r['resume_shards_10_small_buffer']} / {r['resume_shards_90_small_buffer']} shard(s) read |", "",
              (f"Each resume figure: the median of {len(r['resume_s_10_runs'])} runs, the fastest in brackets."
               if "resume_s_10_runs" in r else "Each resume figure: a median of repeated runs (an older run: no "
               "minimum kept)."),
              "",
              "A resume reads only the shards overlapping the current shuffle block (never consumed ones), so its "
              "cost follows the buffer/shard ratio, not the position in the epoch.", "",
              "Reproduce: `OMP_NUM_THREADS=1 python benchmarks/data.py` (`--sections loader,own_rows` for the "
              "loader tables only). Raw numbers: `data.json`"
              + (f"; the sha256 of the {len(r['config_sha256'])} `configs/scaling/*.yaml` configs read "
                 "(`provenance.config_hash`): `config_sha256` there." if r.get("config_sha256") else "."), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
