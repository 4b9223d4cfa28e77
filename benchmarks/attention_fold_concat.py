"""Would the fast path's folded-score GEMMs run faster as one GEMM over concatenated operands?

The fast path (docs/ascender.md, "Fast path") folds three parts into the score tile of a query
chunk, S = q' k^T + a khat^T + y Zr^T, one GEMM each (inner widths hd, hd and d_z + 2), and in
backward takes the query-side gradients dS k, dS khat, dS Zr and accumulates the key-side ones
dS^T q', dS^T a, dS^T y into one buffer per operand. Stored side by side ([k | khat | Zr], width
2 hd + d_z + 2), each group would be one GEMM with a wider inner or outer dimension, which MKL runs
at a higher rate, and S would be written once instead of once plus two read-modify-writes.

This script measures exactly that trade on the benchmark layer's shapes (8 heads x 64, d_z = 32,
n = 2048, causal 64-row chunks: the tile shapes of benchmarks/attention.py), one torch thread,
fp32: per round, SDPA's fwd+bwd once, then each GEMM group over every chunk, separate operands and
concatenated in a rotated order, by the thread's CPU time. The table gives each group's median
time and the median / minimum same-round ratio concatenated / separate, and the net change of a
fast-path fwd+bwd (the score GEMMs run twice, in forward and in backward's recompute; the
gradient groups once) as a multiple of the same round's SDPA.

    .venv/bin/python benchmarks/attention_fold_concat.py     # ~1 min on a 2-core CPU

    .venv/bin/python benchmarks/attention_fold_concat.py --rewrite   # md/png again from the json, no runs

Writes benchmarks/results/attention_fold_concat.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ascender_dist.machine import machine_record  # noqa: E402
from ascender_dist.plotting import plot_round_ratios  # noqa: E402
from ascender_dist.research.ablate.provenance import git_state  # noqa: E402
from benchmarks.attention import HEAD_DIM, HEADS, _layer, cpu_time, machine  # noqa: E402
from benchmarks.report import RESULTS, commit_text, cpus_text, publish, ratio_summary  # noqa: E402

CHUNK = 64  # rows per chunk of the fast path at n = 2048 with 8 heads (max_tile_elems // (8 * n))
D_Z = 32
WIDTHS = (HEAD_DIM, HEAD_DIM, D_Z + 2)  # k, khat, Zr
GROUPS = {  # name -> (description, runs per fast-path fwd+bwd)
    "scores": ("S = sum of q_part k_part^T", 2),
    "query-side grads": ("dS k_part per part", 1),
    "key-side grads": ("buffer_part += dS^T q_part", 1),
}


class FoldGemms:
    """The three GEMM groups of every causal chunk, on separate and on concatenated operands."""

    def __init__(self, n: int):
        import torch

        g = torch.Generator().manual_seed(0)
        self.n, B = n, HEADS
        self.keys = [torch.randn(B, n, e, generator=g) for e in WIDTHS]  # [B, s, e] per part
        self.keys_cat = torch.cat(self.keys, -1)  # [B, s, sum e]
        self.parts = [torch.randn(B, CHUNK, e, generator=g) for e in WIDTHS]  # query side [B, C, e]
        self.parts_cat = torch.cat(self.parts, -1)
        self.dS = torch.randn(B, CHUNK, n, generator=g)
        self.S = torch.empty(B * CHUNK * n)
        self.gbuf = [torch.zeros(B, n, e) for e in WIDTHS]
        self.gbuf_cat = torch.zeros(B, n, sum(WIDTHS))

    def ends(self):
        return range(CHUNK, self.n + 1, CHUNK)

    def run(self, group: str, concatenated: bool) -> list:
        """Every chunk's GEMMs of ``group``; returns the last chunk's results (concatenated: one
        tensor whose column blocks are the separate results; scores: the tile either way)."""
        import torch

        B = HEADS
        last = []
        for L in self.ends():
            dS = self.dS[:, :, :L]  # [B, C, L]
            if group == "scores":
                out = self.S[: B * CHUNK * L].view(B, CHUNK, L)
                if concatenated:
                    torch.bmm(self.parts_cat, self.keys_cat[:, :L].transpose(1, 2), out=out)
                else:
                    torch.bmm(self.parts[0], self.keys[0][:, :L].transpose(1, 2), out=out)
                    for qp, key in zip(self.parts[1:], self.keys[1:]):
                        out.baddbmm_(qp, key[:, :L].transpose(1, 2))
                last = [out]
            elif group == "query-side grads":
                last = [torch.bmm(dS, key[:, :L]) for key in ([self.keys_cat] if concatenated else self.keys)]
            else:
                pairs = [(self.gbuf_cat, self.parts_cat)] if concatenated else list(zip(self.gbuf, self.parts))
                for buf, qp in pairs:
                    buf[:, :L].baddbmm_(dS.transpose(1, 2), qp)
                last = [buf for buf, _ in pairs]
        return last


def measure(n: int, rounds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    state = git_state()
    sdpa, gemms = _layer("sdpa", n), FoldGemms(n)
    variants = [(group, cat) for group in GROUPS for cat in (False, True)]
    sdpa()
    for group, cat in variants:
        gemms.run(group, cat)
    load_start = os.getloadavg()[0]
    per_round = []
    for i in range(rounds):
        times = {"sdpa": cpu_time(sdpa)}
        for group, cat in variants[i % len(variants):] + variants[: i % len(variants)]:
            times[f"{group}/{'concatenated' if cat else 'separate'}"] = cpu_time(lambda: gemms.run(group, cat))
        per_round.append(times)
        print(f"round {i + 1}/{rounds}", flush=True)
    return dict(n=n, chunk=CHUNK, widths=WIDTHS, rounds=per_round, load_start=load_start,
                load_end=os.getloadavg()[0], threads=torch.get_num_threads(), machine=machine(),
                machine_record=machine_record(), **state)  # fmt: skip


def net_change_x_sdpa(rounds: list[dict]) -> list[float]:
    """Per round: (concatenated - separate) summed over the groups, each weighted by its runs per
    fwd+bwd, over that round's SDPA time."""
    return [sum(runs * (r[f"{g}/concatenated"] - r[f"{g}/separate"]) for g, (_, runs) in GROUPS.items()) / r["sdpa"]
            for r in rounds]  # fmt: skip


def report(result: dict) -> list[str]:
    rounds = result["rounds"]
    lines = [
        "# ASCender fast path on CPU: folded-score GEMMs on separate vs concatenated operands",
        "",
        f"Machine: {result['machine']}. {commit_text(result)}. Generated by `benchmarks/attention_fold_concat.py` "
        "(see its docstring).",
        "",
        f"n = {result['n']}, causal {result['chunk']}-row chunks, {HEADS} heads, operand widths "
        f"{' + '.join(map(str, result['widths']))}, fp32, {len(rounds)} interleaved rounds, thread CPU time; load "
        f"{result['load_start']:.1f} / {result['load_end']:.1f} (1-minute average at start / end{cpus_text(result)}).",
        "",
        "| GEMM group | runs per fwd+bwd | separate (ms, median) | concatenated (ms, median) "
        "| concatenated / separate median | min |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for group, (what, runs) in GROUPS.items():
        sep = [r[f"{group}/separate"] for r in rounds]
        cat = [r[f"{group}/concatenated"] for r in rounds]
        ratio = ratio_summary(cat, sep)
        lines.append(f"| {group}: {what} | {runs} | {1e3 * statistics.median(sep):.1f} | "
                     f"{1e3 * statistics.median(cat):.1f} | {ratio['median']:.2f} | {ratio['min']:.2f} |")
    net = net_change_x_sdpa(rounds)
    lines += [
        "",
        f"Net change of one fast-path fwd+bwd, concatenated - separate, as a multiple of the same round's SDPA "
        f"fwd+bwd: median {statistics.median(net):+.3f}, minimum {min(net):+.3f} (negative: faster).",
        "",
    ]
    return lines


def plot(result: dict) -> None:
    """attention_fold_concat.png: each group's same-round ratio concatenated / separate."""
    rounds = result["rounds"]
    groups = [(group, [r[f"{group}/concatenated"] / r[f"{group}/separate"] for r in rounds]) for group in GROUPS]
    title = f"ASCender fold GEMMs, n = {result['n']}: concatenated vs separate"
    plot_round_ratios(RESULTS / "attention_fold_concat.png", title,
                      [("concatenated / separate (thread CPU time)", groups, {"no change": 1.0})])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--rewrite", action="store_true", help="only re-render md/png from attention_fold_concat.json")
    args = ap.parse_args()
    if args.rewrite:
        result = json.loads((RESULTS / "attention_fold_concat.json").read_text())
    else:
        if args.rounds < 5:
            ap.error("--rounds must be >= 5 (median and minimum of at least five same-round ratios)")
        result = measure(args.n, args.rounds)
    if publish("attention_fold_concat", report(result), result, write=not args.no_write):
        plot(result)


if __name__ == "__main__":
    main()
