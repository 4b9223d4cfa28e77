"""Would torch.compile (inductor, dynamic shapes) make the CPU fast path faster? Two measurements.

Issue 16 proposed compiling the fast path's per-tile functions to remove the time outside the
GEMMs. This script measures the two halves of that proposal on the current code, same layer as
benchmarks/attention.py (batch 1, 8 heads x 64, causal, fp32, one torch thread):

* ``layer``: one fwd+bwd of SDPA, of the fast path as it is (``eager``), and of the fast path
  with its per-row algebra (``row_algebra``, ``align_rows`` and their closed-form backwards, the
  ~200 small ops per chunk that make the fixed cost of a call) compiled with
  ``torch.compile(dynamic=True)``, swapped in with ``unittest.mock.patch`` for those calls only.
  One process, rotated order per round, thread CPU time; median and minimum of the same-round
  ratios to SDPA. The first compiled call's wall time (compilation) and the number of graphs
  dynamo built are recorded. The tile functions themselves (``kernel_tiles`` and the backward
  steps) cannot be compiled as written: inductor fails on their ``out=`` writes into the tile
  workspace under dynamic shapes.
* ``tile chain``: the forward elementwise passes of one chunk's kernel and Separation tiles
  (clamp, causal mask, exp2, row sums, relu, product, centring, variance; ``fast_tiles``'
  ``_kernel_weights`` + ``_separation_tile``) at the shape [8, 64, n] (a full-length tile):
  written as the fast path writes them (in place into existing tiles), as one pure function
  (fresh tensors, ``torch.where`` masks), and that pure function compiled (inductor fuses it
  into one loop). Per round each variant runs ``--calls`` times on fresh copies of the same
  inputs (the variants in a rotated order); the table gives the median over rounds of each round's
  minimum, in ms, and each variant's ratio to the in-place passes of the same round (median and
  minimum over the rounds).

    .venv/bin/python benchmarks/attention_compile.py            # ~4 min on a 2-core CPU
    .venv/bin/python benchmarks/attention_compile.py --rewrite  # md and png again from the .json, no runs

Writes benchmarks/results/attention_compile.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ascender_dist.machine import machine_record  # noqa: E402
from ascender_dist.plotting import plot_round_ratios  # noqa: E402
from ascender_dist.research.ablate.provenance import git_state  # noqa: E402
from benchmarks.attention import HEADS, _layer, cpu_time, machine  # noqa: E402
from benchmarks.report import cpus_text, ratio_summary  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
IN_PLACE = "in place (fast path)"  # the tile chain's baseline: what the fast path runs
ROW_FUNCTIONS = ("row_algebra", "row_algebra_backward", "align_rows", "align_backward")  # in fast_function
CHUNK_ROWS = 64


def compiled_row_algebra():
    """mock.patch.multiple context that swaps fast_function's per-row algebra for compiled copies."""
    import torch

    from ascender_dist.models.ascender import fast_function

    return mock.patch.multiple(fast_function, **{name: torch.compile(getattr(fast_function, name), dynamic=True)
                                                 for name in ROW_FUNCTIONS})  # fmt: skip


def measure_layer(n: int, rounds: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    sdpa, fast = _layer("sdpa", n), _layer("fast", n)
    sdpa(), fast()
    patch = compiled_row_algebra()
    with patch:
        t0 = time.perf_counter()
        fast()
        compile_s = time.perf_counter() - t0
    graphs = int(counters["stats"]["unique_graphs"])
    runs = {"eager": fast, "compiled row algebra": fast}
    per_round = []
    for i in range(rounds):
        sdpa_s = cpu_time(sdpa)
        names = list(runs)[i % 2:] + list(runs)[: i % 2]
        times = {}
        for name in names:
            if name == "eager":
                times[name] = cpu_time(fast)
            else:
                with patch:
                    times[name] = cpu_time(fast)
        per_round.append(dict(sdpa_s=sdpa_s, fast_s=times))
        print(f"round {i + 1}/{rounds}: " + ", ".join(f"{k} {v / sdpa_s:.2f}x" for k, v in times.items()), flush=True)
    torch._dynamo.reset()
    return dict(rounds=per_round, compile_s=compile_s, graphs=graphs)


def chain_in_place(x, r, upper, c0: int, lo: float, count, scratch):
    """The fast path's forward tile passes as it runs them (in place into x and r)."""
    import torch

    x.clamp_(min=lo, max=0)
    x[:, :, c0:].masked_fill_(upper, -math.inf)
    w = x.exp2_()
    rho = w.sum(-1)
    r.clamp_(min=0)
    dev = r.mul_(w)
    mu = dev.sum(-1) / count
    dev.sub_(mu[:, :, None])
    dev[:, :, c0:].masked_fill_(upper, 0.0)
    var = torch.mul(dev, dev, out=scratch).sum(-1) / count
    return w, dev, rho, mu, var


def chain_pure(x, r, upper_full, lo: float, count):
    """The same passes as one pure function (what inductor can fuse); upper_full: [C, L] mask."""
    import torch

    w = torch.where(upper_full, 0.0, torch.exp2(x.clamp(min=lo, max=0)))
    rho = w.sum(-1)
    phi = r.clamp(min=0) * w
    mu = phi.sum(-1) / count
    dev = torch.where(upper_full, 0.0, phi - mu[..., None])
    var = (dev * dev).sum(-1) / count
    return w, dev, rho, mu, var


def measure_chain(n: int, rounds: int, calls: int) -> dict:
    import torch

    B, C, L = HEADS, CHUNK_ROWS, n
    c0 = L - C
    gen = torch.Generator().manual_seed(0)
    x0, r0 = -10 * torch.rand(B, C, L, generator=gen), torch.randn(B, C, L, generator=gen)
    upper = torch.ones(C, C, dtype=torch.bool).triu(1)
    upper_full = torch.cat([torch.zeros(C, c0, dtype=torch.bool), upper], 1)
    lo = math.log2(torch.finfo(torch.float32).tiny) * 0.999
    count = torch.arange(c0 + 1, L + 1, dtype=torch.float32)
    scratch = torch.empty(B, C, L)
    compiled = torch.compile(chain_pure, dynamic=True)
    t0 = time.perf_counter()
    compiled(x0, r0, upper_full, lo, count)
    compile_s = time.perf_counter() - t0
    variants = {
        IN_PLACE: lambda x, r: chain_in_place(x, r, upper, c0, lo, count, scratch),
        "pure, eager": lambda x, r: chain_pure(x, r, upper_full, lo, count),
        "pure, compiled": lambda x, r: compiled(x, r, upper_full, lo, count),
    }
    ref = chain_in_place(x0.clone(), r0.clone(), upper, c0, lo, count, scratch)
    got = compiled(x0.clone(), r0.clone(), upper_full, lo, count)
    max_rel = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, ref))
    per_round = []
    for i in range(rounds):
        names = list(variants)[i % 3:] + list(variants)[: i % 3]
        best = {}
        for name in names:
            ts = []
            for _ in range(calls):
                x, r = x0.clone(), r0.clone()
                ts.append(cpu_time(lambda: variants[name](x, r)))
            best[name] = min(ts)
        per_round.append(best)
    torch._dynamo.reset()
    return dict(rounds=per_round, compile_s=compile_s, shape=[B, C, L], max_rel_diff=max_rel)


def chain_rows(chain: dict) -> list[dict]:
    """Per tile-chain variant: the median over rounds of the round's minimum (s), and the same-round ratio
    to the in-place passes (variant / in place of that round), median and minimum over the rounds."""
    rounds = chain["rounds"]
    base = [x[IN_PLACE] for x in rounds]
    out = []
    for name in rounds[0]:
        times = [x[name] for x in rounds]
        out.append(dict(variant=name, median_s=statistics.median(times),
                        x_in_place=ratio_summary(times, base)))
    return out


def write_results(result: dict) -> None:
    layer, chain = result["layer"], result["chain"]
    rows = layer["rounds"]
    lines = [
        "# ASCender fast path on CPU: what torch.compile would change",
        "",
        f"Machine: {result['machine']}. Commit {str(result['git_commit'])[:12]}"
        f"{' (dirty)' if result['git_dirty'] else ''}. Generated by `benchmarks/attention_compile.py` "
        "(see its docstring).",
        "",
        f"Layer: n = {result['n']}, causal, 8 heads x 64, fp32, fwd+bwd, {len(rows)} interleaved rounds, thread CPU "
        f"time; load {result['load_start']:.1f} / {result['load_end']:.1f} (1-minute average at start / end"
        f"{cpus_text(result)}).",
        "",
        "| fast path | CPU s (median) | x SDPA median | x SDPA min |",
        "|---|---:|---:|---:|",
    ]
    for name in rows[0]["fast_s"]:
        ratios = [x["fast_s"][name] / x["sdpa_s"] for x in rows]
        lines.append(f"| {name} | {statistics.median(x['fast_s'][name] for x in rows):.3f} | "
                     f"{statistics.median(ratios):.2f} | {min(ratios):.2f} |")
    lines += [f"| SDPA | {statistics.median(x['sdpa_s'] for x in rows):.3f} | 1.00 | 1.00 |", "",
              f"Compiling the per-row algebra: first call {layer['compile_s']:.1f} s, {layer['graphs']} graphs "
              "(dynamo splits the functions at graph breaks).", "",
              f"Tile chain: forward kernel + Separation passes of one chunk, shape {chain['shape']}, "
              f"{len(chain['rounds'])} rounds, the variants in a rotated order; ms per call (median over rounds of "
              "the round's minimum); x in place: the variant's time over the in-place passes' time of the same "
              "round, median and minimum over the rounds.", "",
              "| variant | ms | x in place median | x in place min |", "|---|---:|---:|---:|"]
    for row in chain_rows(chain):
        lines.append(f"| {row['variant']} | {1e3 * row['median_s']:.2f} | {row['x_in_place']['median']:.2f} | "
                     f"{row['x_in_place']['min']:.2f} |")
    lines += ["", f"Compiled chain: first call {chain['compile_s']:.1f} s; largest difference from the in-place "
              f"passes {chain['max_rel_diff']:.1e} relative to each output's largest entry.", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attention_compile.md").write_text("\n".join(lines))
    (RESULTS / "attention_compile.json").write_text(json.dumps(result, indent=1))
    plot(result)


def plot(result: dict) -> None:
    """attention_compile.png: the layer's same-round ratios to SDPA, the tile chain's to the in-place passes."""
    layer_rows, chain = result["layer"]["rounds"], result["chain"]
    layer = [(name, [x["fast_s"][name] / x["sdpa_s"] for x in layer_rows]) for name in layer_rows[0]["fast_s"]]
    base = [x[IN_PLACE] for x in chain["rounds"]]
    tiles = [(name, [x[name] / b for x, b in zip(chain["rounds"], base)]) for name in chain["rounds"][0]]
    plot_round_ratios(RESULTS / "attention_compile.png", f"ASCender fast path, n = {result['n']}: torch.compile",
                      [("layer fwd+bwd / SDPA (thread CPU time)", layer, {"target (issue 16)": 4.0}),
                       ("tile chain / in-place passes", tiles, {"in-place passes": 1.0})])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="tile-chain calls per variant and round")
    ap.add_argument("--rewrite", action="store_true", help="only re-render md/png from attention_compile.json")
    args = ap.parse_args(argv)
    if args.rewrite:
        write_results(json.loads((RESULTS / "attention_compile.json").read_text()))
        print((RESULTS / "attention_compile.md").read_text())
        return
    if args.rounds < 5:
        ap.error("--rounds must be >= 5 (median and minimum of at least five same-round ratios)")
    import torch

    torch.set_num_threads(1)
    state = git_state()  # the code that runs: taken before measuring
    load_start = os.getloadavg()[0]
    result = dict(n=args.n, layer=measure_layer(args.n, args.rounds),
                  chain=measure_chain(args.n, args.rounds, args.calls))
    result.update(load_start=load_start, load_end=os.getloadavg()[0], threads=torch.get_num_threads(),
                  machine=machine(), machine_record=machine_record(), **state)
    write_results(result)
    print((RESULTS / "attention_compile.md").read_text())


if __name__ == "__main__":
    main()
