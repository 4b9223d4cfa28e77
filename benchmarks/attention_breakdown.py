"""Where the CPU fast path's time goes, and what the allocator setting changes.

Same layer as benchmarks/attention.py (batch 1, 8 heads x 64, causal, fp32, one torch thread).
For each n and each allocator setting - glibc's defaults, and ``keep_freed_memory`` below (freed
blocks stay in the heap for reuse: the chunked path allocates and frees some twenty few-MiB
tiles per chunk, which with the defaults come back as fresh pages that the kernel faults in and
zeroes) - a fresh process times SDPA and the fast path interleaved (--reps rounds, each one
fwd+bwd of SDPA and of the fast path, SDPA first in every other round; median and minimum of the
same-round ratios, the per-round times kept in the json), counts the page faults
one fast fwd+bwd takes, and profiles one fast fwd+bwd to split its time into three parts, each
its share of the profiled self time scaled to the unprofiled median wall time:

* GEMMs: bmm / baddbmm / addmm / mm / matmul kernels;
* elementwise: every other op averaging >= 50 us per call (passes over [b*np, rows, keys]
  tiles: exp, softmax, masks, products; per-row ops of a chunk take a few us);
* overhead: the rest (the per-row algebra of each chunk and its autograd re-run, index and
  view ops, dispatch) plus the wall time the profiler does not attribute to any op.

"GEMM x SDPA" is the time of the fast path's GEMMs alone against SDPA's whole fwd+bwd: no
amount of work on the elementwise passes can bring the ratio below it.

A second split, by step of the algorithm (``STEPS``: the fast path's own functions), comes from
one fwd+bwd under cProfile without builtins (it times Python functions only, so the torch ops
cost no extra): each step's cumulative time (``fold_scores`` counted where the forward calls
it; backward's recompute is inside the softmax backward) as a share of the profiled wall time,
scaled to the unprofiled ratio; "rest" is what no step claims (the loop bodies themselves, the
output assembly, aux losses).

    .venv/bin/python benchmarks/attention_breakdown.py            # ~3 min on a 2-core CPU

Writes benchmarks/results/attention_breakdown.{json,md,png} (``--name STEM``: STEM.{json,md,png}, e.g. a
table per CPU model beside the others).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ascender_dist.research.ablate.provenance import git_state  # noqa: E402
from benchmarks.attention import HEAD_DIM, HEADS, _layer, _median, _timed, machine  # noqa: E402
from benchmarks.report import commit_text, ratio_stats  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEM = "attention_breakdown"  # the results' file name; --name gives another, e.g. one per CPU model
ALLOCATORS = ("glibc default", "keep_freed_memory")
GEMM_OPS = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::addmm", "aten::addmm_", "aten::mm",
            "aten::matmul")


def keep_freed_memory() -> None:
    """glibc mallopt: blocks up to 32 MiB (its maximum) from the heap, no heap trimming below 1 GiB."""
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mallopt(m_mmap_threshold, 32 << 20) != 1 or mallopt(m_trim_threshold, 1 << 30) != 1:
        raise SystemExit("glibc refused the mallopt settings")


TILE_OP_US = 50.0  # average self time per call above which a non-GEMM op counts as a tile pass

# step of the algorithm -> the fast path's functions (module, name[, the caller it is counted under]) whose
# cumulative time it is; no function is nested in another of the list under the callers given
STEPS = {
    "neighbour search": [("neighbour_rule", "search_vectors"), ("fast_neighbours", "neighbours")],
    "whole-sequence operands and gradients": [("fast_function", "_all_operands"), ("fast_function", "_grad_buffers"),
                                              ("fast_grads", "input_grads")],
    "kernel + Separation tiles (fwd, bwd recompute)": [("fast_tiles", "kernel_tiles")],
    "per-row algebra (fwd, bwd recompute, closed-form bwd, scatter)": [
        ("fast_rows", "row_inputs"), ("fast_rows", "row_algebra"), ("fast_rows", "align_rows"),
        ("fast_row_grads", "row_algebra_backward"), ("fast_row_grads", "align_backward"),
        ("fast_rows", "scatter_row_grads"), ("fast_rows", "store_rows")],
    "scores + softmax (fwd)": [("fast_tiles", "fold_scores", "_forward_chunk"),
                               ("fast_tiles", "softmax_into", "_forward_chunk")],
    "softmax bwd (scores recomputed, dP, dV)": [("fast_function", "_softmax_backward")],
    "folded-score gradients (query and key sides)": [("fast_function", "_fold_grads")],
    "Separation + kernel bwd": [("fast_function", "_separation_dphi"), ("fast_function", "_separation_backward"),
                                ("fast_function", "_kernel_backward")],
}  # fmt: skip


def _step_shares(run) -> dict:
    """{step: fraction of one cProfiled fwd+bwd's wall time} for STEPS, plus "rest"."""
    import cProfile
    import pstats
    import time

    prof = cProfile.Profile(builtins=False)
    t0 = time.perf_counter()
    prof.runcall(run)
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    by_name = {(Path(f).stem, name): v for (f, _, name), v in stats.items() if "models/ascender" in f}
    shares = {}
    for step, funcs in STEPS.items():
        total = 0.0
        for module, name, *caller in funcs:
            entry = by_name.get((module, name))
            if entry is None:
                continue
            if caller:
                total += sum(c[3] for (_, _, cname), c in entry[4].items() if cname == caller[0])
            else:
                total += entry[3]
        shares[step] = total / wall
    shares["rest"] = 1.0 - sum(shares.values())
    return shares


def _shares(run) -> tuple[float, float]:
    """(GEMM, elementwise) fractions of one profiled fwd+bwd's wall time (see the docstring)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    tile = sum(e.self_cpu_time_total for e in events
               if e.key not in GEMM_OPS and e.key.startswith("aten::") and e.self_cpu_time_total >= TILE_OP_US * e.count)
    return gemm / wall_us, tile / wall_us


def worker(n: int, allocator: str, reps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    if allocator == "keep_freed_memory":
        keep_freed_memory()
    sdpa, fast = _layer("sdpa", n), _layer("fast", n)
    sdpa(), fast()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fast()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    load_start = os.getloadavg()[0]
    t_sdpa, t_fast = [], []
    for i in range(reps):  # SDPA first in even rounds, the fast path first in odd ones
        if i % 2:
            t_fast.append(_timed(fast))
        t_sdpa.append(_timed(sdpa))
        if not i % 2:
            t_fast.append(_timed(fast))
    same_round = ratio_stats(t_fast, t_sdpa)
    ratio = same_round["median"]
    rounds = dict(sdpa_s=t_sdpa, fast_s=t_fast)
    t_sdpa, t_fast = _median(t_sdpa), _median(t_fast)
    share, tile = _shares(fast)
    steps = {step: f * ratio for step, f in _step_shares(fast).items()}
    return dict(n=n, allocator=allocator, sdpa_s=t_sdpa, fast_s=t_fast, ratio=ratio, ratio_min=same_round["min"],
                ratios=same_round["ratios"], rounds=rounds, page_faults=faults,
                gemm_s=share * t_fast, gemm_x_sdpa=share * ratio, elementwise_x_sdpa=tile * ratio,
                overhead_x_sdpa=(1 - share - tile) * ratio, steps_x_sdpa=steps, load_start=load_start,
                load_1m=os.getloadavg()[0], reps=reps)


def run_point(n: int, allocator: str, reps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(n), allocator, str(reps)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)
    if proc.returncode:
        raise SystemExit(f"worker n={n} {allocator}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_results(points: list[dict], state: dict, machine_text: str | None = None, stem: str = STEM) -> None:
    """state: git_state() of the run that measured (for --rewrite, the one recorded in the json);
    machine_text: the machine it ran on (for --rewrite, the recorded one, not this process's)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine_text = machine_text or machine()
    state = {k: state.get(k) for k in ("git_commit", "git_dirty")}
    (RESULTS / f"{stem}.json").write_text(json.dumps({"machine": machine_text, **state, "points": points},
                                                                 indent=1))
    lines = [
        "# ASCender fast path on CPU: time breakdown and allocator setting", "",
        f"Machine: {machine_text}. {commit_text(state)}. Generated by `benchmarks/attention_breakdown.py`.", "",
        f"One causal layer, batch 1, {HEADS} heads x {HEAD_DIM}, fp32, fwd+bwd, a fresh "
        "process per row (`fast (s)`, `SDPA (s)`: medians of --reps interleaved rounds; `fast x SDPA`: median and minimum of the same-round ratios; elementwise and overhead split as in the script's docstring). `faults`: minor page faults during one fast fwd+bwd. `GEMM (s)`: the fast path's time "
        "inside GEMM kernels (profiled self-time share x wall time); `GEMM x SDPA`: that against SDPA's whole "
        "fwd+bwd, a floor for `fast x SDPA` that only less GEMM work could lower. `load`: 1-minute load average "
        "of the shared cores at the start / end of the row.", "",
        "| n | allocator | SDPA (s) | fast (s) | fast x SDPA median | min | rounds | faults | GEMM (s) | GEMM x SDPA "
        "| elementwise x SDPA | overhead x SDPA | load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(f"| {p['n']} | {p['allocator']} | {p['sdpa_s']:.3f} | {p['fast_s']:.3f} | {p['ratio']:.2f} | "
                     f"{p.get('ratio_min', float('nan')):.2f} | {p.get('reps', '')} | {p['page_faults']} | {p['gemm_s']:.3f} | {p['gemm_x_sdpa']:.2f} | "
                     f"{p.get('elementwise_x_sdpa', float('nan')):.2f} | {p.get('overhead_x_sdpa', float('nan')):.2f} | "
                     f"{p.get('load_start', float('nan')):.1f} / {p['load_1m']:.1f} |")
    lines += ["", "Reading (computed from the rows above):", ""]
    for n in sorted({p["n"] for p in points}):
        rows = {p["allocator"]: p for p in points if p["n"] == n}
        base, kept = rows.get(ALLOCATORS[0]), rows.get(ALLOCATORS[1])
        if base is not None:
            lines.append(f"* n = {n}: fast x SDPA {base['ratio']:.2f} = GEMMs {base['gemm_x_sdpa']:.2f} + elementwise "
                         f"{base['elementwise_x_sdpa']:.2f} + overhead {base['overhead_x_sdpa']:.2f}.")
        if base is None or kept is None:
            continue
        lines.append(f"* n = {n}: the GEMMs alone take {base['gemm_x_sdpa']:.1f}x SDPA's whole fwd+bwd "
                     f"({base['gemm_s']:.2f} of {base['fast_s']:.2f} s); keeping freed memory cuts the page "
                     f"faults from {base['page_faults']} to {kept['page_faults']} and changes the time by "
                     f"{100 * (kept['fast_s'] / base['fast_s'] - 1):+.0f}%.")
    lines += step_lines(points)
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def step_lines(points: list[dict]) -> list[str]:
    """The by-step table (glibc-default rows that have it): x SDPA per step, one column per n."""
    rows = [p for p in points if p["allocator"] == ALLOCATORS[0] and "steps_x_sdpa" in p]
    if not rows:
        return []
    lines = ["", "By step of the algorithm (cProfile, see the docstring), as multiples of SDPA's fwd+bwd:", "",
             "| step | " + " | ".join(f"n = {p['n']}" for p in rows) + " |", "|---|" + "---:|" * len(rows)]
    for step in [*STEPS, "rest"]:
        lines.append(f"| {step} | " + " | ".join(f"{p['steps_x_sdpa'][step]:.2f}" for p in rows) + " |")
    lines.append("| **total (fast x SDPA)** | " + " | ".join(f"{p['ratio']:.2f}" for p in rows) + " |")
    return lines


def plot(points: list[dict], stem: str = STEM) -> None:
    from ascender_dist.plotting import pyplot

    plt = pyplot()  # one line naming the research extra when matplotlib is missing

    lengths = sorted({p["n"] for p in points})
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    for a, allocator in enumerate(ALLOCATORS):
        rows = {p["n"]: p for p in points if p["allocator"] == allocator}
        if set(rows) != set(lengths):
            continue
        xs = [i + (a - 0.5) * width for i in range(len(lengths))]
        gemm = [rows[n]["gemm_x_sdpa"] for n in lengths]
        rest = [rows[n]["ratio"] - rows[n]["gemm_x_sdpa"] for n in lengths]
        ax.bar(xs, gemm, width, color=f"C{a}", label=f"{allocator}: GEMMs")
        ax.bar(xs, rest, width, bottom=gemm, color=f"C{a}", alpha=0.45, label=f"{allocator}: everything else")
    ax.axhline(4.0, color="k", ls="--", lw=1, label="target: 4x SDPA at n = 2048")
    ax.set_ylim(0, 1.5 * max(p["ratio"] for p in points))  # room for the legend above the bars
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("fwd+bwd time / SDPA fwd+bwd time")
    ax.set_title("ASCender fast path on CPU: GEMM time and the rest, as multiples of SDPA")
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=5, help="interleaved SDPA / fast rounds per row (>= 5)")
    ap.add_argument("--allocators", nargs="+", default=[ALLOCATORS[0]], choices=ALLOCATORS)
    ap.add_argument("--rewrite", action="store_true", help="only re-render md/png from the json")
    ap.add_argument("--name", default=STEM, help="results file stem under benchmarks/results (one per CPU model)")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error("--reps must be >= 5 (median and minimum of at least five same-round ratios)")
    if args.rewrite:
        saved = json.loads((RESULTS / f"{args.name}.json").read_text())
        points = saved["points"]
        write_results(points, saved, saved.get("machine"), args.name)
        plot(points, args.name)
        return
    from tqdm import tqdm

    state = git_state()
    points = []
    jobs = [(n, a) for n in args.lengths for a in args.allocators]
    for n, allocator in tqdm(jobs, desc="breakdown points"):
        points.append(run_point(n, allocator, args.reps))
    write_results(points, state, stem=args.name)
    plot(points, args.name)


if __name__ == "__main__":
    main()
