"""Forward + backward cost of one ASCender attention layer vs plain SDPA, on CPU, fp32.

Batch 1, 8 heads, head dim 64, causal, d_z = d_a = 32, k = 16, window 128 + 4 globals (the
defaults of AscenderHParams). Implementations:

    sdpa       torch scaled_dot_product_attention(is_causal=True) on q, k, v
    seed       the seed's reference code as written (benchmarks/seed_reference.py; its Alignment gathers
               k_hat_i, the query's own key, so its top-k is unused), causal mask applied last
    reference  our dense reference (reference.py), causal statistics
    fast       our chunked fast path (fast.py), causal statistics, the default path on CPU

Time: one process per n, with one torch thread, builds every implementation, warms each up
once, then runs R rounds (R >= 5, --reps); each round times one fwd+bwd of every implementation
back to back, in an order rotated from round to round (no implementation always runs first). The ratio of a round is impl time / SDPA time of that same round, so
load from other processes that lasts longer than a round cancels; the table gives the median
and the minimum over the rounds, the median time, the CPU model, the thread count and the
1-minute load average at the start and end of each n, and the git commit. Memory: a fresh process per (impl, n):
after one warm-up fwd+bwd it resets the kernel's peak-RSS counter (/proc/self/clear_refs), runs
one fwd+bwd and reads VmHWM - VmRSS(before); glibc is told to mmap every block above 1 MiB, so
that freed memory really leaves the process and the high-water mark is the true peak (timing
uses glibc's default allocator: the mmap setting makes every large temporary a fresh mapping
whose pages fault on first touch, which slows the tiled fast path and not SDPA). Points whose
estimated memory exceeds --mem-cap-gb are skipped; a worker that exceeds --timeout (per call
of the memory worker, per round of the timing worker) is reported as such.

    .venv/bin/python benchmarks/attention.py           # ~15 min on a 2-core CPU
    .venv/bin/python benchmarks/attention.py --quick   # smoke run: prints the table, writes nothing
    .venv/bin/python benchmarks/attention.py --rewrite # re-render md/png from attention.json, no runs

Writes benchmarks/results/attention.{json,md,png} (``--note`` paragraphs are kept in attention.json, so
``--rewrite`` and ``--merge`` keep them unless new ``--note`` paragraphs are given).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/attention.py` from anywhere
    sys.path.insert(0, str(ROOT))
from ascender_dist.machine import cpu_model, machine_line, machine_record  # noqa: E402  (cpu_model: re-exported)

RESULTS = ROOT / "benchmarks" / "results"
IMPLS = ("sdpa", "seed", "reference", "fast")
HEADS, HEAD_DIM, D_Z, D_A, K_TOP, WINDOW, GLOBALS = 8, 64, 32, 32, 16, 128, 4


# ----------------------------------------------------------------------------- worker side
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _peak_delta_mib(fn) -> float:
    """Peak resident memory above the current level while fn() runs, MiB."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def _layer(impl: str, n: int, device: str = "cpu", dtype: str = "float32", heads: int = HEADS, **hp_overrides):
    """A closure running one fwd+bwd of impl on fresh leaf inputs of length n (inputs and the
    per-head parameters on ``device`` in ``dtype``, a torch dtype name; benchmarks/gpu_check uses bf16 on CUDA).
    heads, hp_overrides: another head count / AscenderHParams fields (attention_fixed_cost.py)."""
    import torch
    import torch.nn.functional as F

    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, ascender_attention

    g = torch.Generator().manual_seed(0)
    to = dict(device=device, dtype=getattr(torch, dtype))

    def mk(d):  # [b, np, s, d], drawn on the CPU generator so every device sees the same numbers
        return torch.randn(1, heads, n, d, generator=g).to(**to).requires_grad_()

    q, k, v, z, h = mk(HEAD_DIM), mk(HEAD_DIM), mk(HEAD_DIM), mk(D_Z), mk(D_A)
    hp = AscenderHParams(d_z=D_Z, d_a=D_A, k=K_TOP, window=WINDOW, num_global=GLOBALS, causal=True, **hp_overrides)
    params = AscenderHeadParams(hp, heads).to(**to)
    if impl == "seed":  # benchmarks/seed_reference.py: importable here when this file runs as a script
        from seed_reference import seed_attention, seed_params

        sp, causal_mask = seed_params(), torch.ones(n, n).tril()

    def run():
        if impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif impl == "seed":
            out = seed_attention(q, k, v, z, h, sp, k_top=K_TOP, attn_mask=causal_mask)[0]
        else:
            out = ascender_attention(q, k, v, z, h, params, hp, step=0, impl=impl)
        out.backward(torch.ones_like(out))
        for t in (q, k, v, z, h):
            t.grad = None

    return run


def _best_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_time(fn) -> float:
    """This thread's CPU time for fn() (leaves out the time other processes held the core)."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _timed_both(fn) -> tuple[float, float]:
    """(wall time, this thread's CPU time) of fn(): with one torch thread the CPU time leaves out
    the time other processes held the core (not their cache and memory-bandwidth contention)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def memory_worker(impl: str, n: int) -> dict:
    """Peak memory of one fwd+bwd of impl after one warm-up (first calls allocate one-time
    workspaces, ~75 MiB here; at n > 2048 the warm-up is a short problem)."""
    import torch

    torch.set_num_threads(1)
    try:  # M_MMAP_THRESHOLD: big blocks via mmap, so free() returns them to the OS
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    except OSError:
        pass
    if n > 2048:  # warm up on a small problem: one-time workspaces without a second long run
        for name in ("sdpa", impl):
            _layer(name, 512)()
    run = _layer(impl, n)
    _layer("sdpa", n)()
    if n <= 2048:
        run()
    return dict(peak_mib=_peak_delta_mib(run))


def time_worker(n: int, impls: list[str], rounds: int) -> dict:
    """rounds x (one fwd+bwd of each impl, the order rotated per round), after one warm-up call each: per impl
    the list of times (s), in round order; the first call's time is reported separately."""
    import torch

    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    runs = {impl: _layer(impl, n) for impl in impls}
    first = {impl: _timed(run) for impl, run in runs.items()}
    times = {impl: [] for impl in impls}
    cpu = {impl: [] for impl in impls}
    for i in range(rounds):
        for impl in impls[i % len(impls):] + impls[: i % len(impls)]:  # rotated: no impl always runs first
            wall, used = _timed_both(runs[impl])
            times[impl].append(wall)
            cpu[impl].append(used)
    return dict(times=times, cpu_times=cpu, first_call_s=first, load_start=load_start, load_end=os.getloadavg()[0],
                threads=torch.get_num_threads())


# ----------------------------------------------------------------------------- driver side
def estimated_gib(impl: str, n: int) -> float:
    """Rough peak memory of the dense implementations (n x n tensors kept for backward)."""
    per_nn = 4 * HEADS * n * n / 2**30  # one fp32 [1, 8, n, n] tensor
    if impl == "seed":
        return per_nn * (HEAD_DIM + D_Z + 40)  # [B, H, N, N, d] gather grad and [.., N, N, d_z] r_coh
    if impl == "reference":
        return per_nn * 45
    return 0.0


def attention_gflops(n: int, windowed: bool) -> dict:
    """Forward FLOPs of the 8-head causal layer (multiply-add = 2), analytic.

    sdpa: QK^T and AV on the causal half. ascender (fast path): the folded QK^T over
    hd + hd + d_z + 2 dims, AV, the Separation/Cohesion tile (z.z, h.h, centroid w@z,
    ~25 elementwise ops per entry) and the neighbourhood search: all j < i (full) or the
    +-window band plus globals (windowed).
    """
    half = n * n / 2
    sdpa = 2 * half * 2 * HEAD_DIM
    fold = 2 * half * (2 * HEAD_DIM + D_Z + 2) + 2 * half * HEAD_DIM
    tile = 2 * half * (D_Z + 2 + D_A + 2 + D_Z + 2) + 25 * half
    search = 2 * n * (WINDOW + GLOBALS) * D_A if windowed else 2 * half * D_A
    return {"sdpa": HEADS * sdpa / 1e9, "ascender": HEADS * (fold + tile + search) / 1e9,
            "neighbour_search": HEADS * search / 1e9}  # fmt: skip


def _subprocess(args_: list[str], timeout: float) -> dict | str:
    """Run this file as a worker; its last stdout line (JSON) or a one-line failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", *args_], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"timeout > {timeout:g} s"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"failed (rc {proc.returncode}): {tail[:80]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else 0.5 * (ys[m - 1] + ys[m])


def run_length(n: int, impls: list[str], args) -> list[dict]:
    """All points of one n: memory per (impl, n) process, time interleaved in one process."""
    points, timed = [], []
    for impl in impls:
        est = estimated_gib(impl, n)
        if est > args.mem_cap_gb:
            points.append(dict(impl=impl, n=n, status=f"skipped: est. {est:.0f} GiB > {args.mem_cap_gb:g} GiB cap"))
            continue
        mem = _subprocess(["memory", impl, str(n)], args.timeout)
        if isinstance(mem, str):
            points.append(dict(impl=impl, n=n, status=f"{mem} (memory)"))
            continue
        points.append(dict(impl=impl, n=n, status="ok", **mem))
        timed.append(impl)
    if "sdpa" not in timed:
        return points
    res = _subprocess(["time", str(n), str(args.reps), ",".join(timed)], args.timeout * (args.reps + 2))
    for p in points:
        if p["impl"] not in timed:
            continue
        if isinstance(res, str):
            p["status"] = f"{res} (time)"
            continue
        t, t_sdpa = res["times"][p["impl"]], res["times"]["sdpa"]
        ratios = [a / b for a, b in zip(t, t_sdpa)]
        c, c_sdpa = res["cpu_times"][p["impl"]], res["cpu_times"]["sdpa"]
        p["cpu_ratio"] = _median([a / b for a, b in zip(c, c_sdpa)])
        p.update(time_s=_median(t), times_s=t, time_ratio=_median(ratios), time_ratio_min=min(ratios),
                 ratios=ratios, first_call_s=res["first_call_s"][p["impl"]], rounds=len(t),
                 load_start=res["load_start"], load_1m=res["load_end"], threads=res["threads"])  # fmt: skip
    return points


def merged_points(old: list[dict], new: list[dict]) -> list[dict]:
    """The points of an earlier run at the lengths this run did not measure, then this run's: a
    length is never mixed from two runs (its ratios are against its own run's SDPA row)."""
    measured = {p["n"] for p in new}
    return [p for p in old if p["n"] not in measured] + new


def machine() -> str:
    import torch

    return (f"{machine_line(machine_record())}, 1 torch thread, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def commit_lines(state: dict, points: list[dict]) -> str:
    """This run's commit, and the commits of rows kept from other runs (--merge) if any differ."""
    from benchmarks.report import commit_text

    text = commit_text(state)
    own = (state.get("git_commit"), state.get("git_dirty"))
    other = sorted({commit_text(p) for p in points if (p.get("git_commit"), p.get("git_dirty")) != own})
    if other:
        text += f"; rows kept from other runs: {', '.join(other)}"
    return text


def write_results(points: list[dict], lengths: list[int], notes: list[str], state: dict,
                  machine_text: str | None = None, write: bool = True, cpus: int | None = None) -> str:
    """The report's markdown; with ``write``, attention.{md,json,png} too (--quick prints, writes nothing).
    notes: the --note paragraphs under the table, saved in attention.json (``--rewrite`` renders them from
    there); state: git_state() of the run that measured (for --rewrite, the one recorded in attention.json);
    machine_text, cpus: the machine it ran on and its logical CPUs (for --rewrite, the recorded ones)."""
    machine_text = machine_text or machine()
    cpus = cpus or os.cpu_count()
    by = {(p["impl"], p["n"]): p for p in points}
    sdpa_mem = {n: by[("sdpa", n)].get("peak_mib") for n in lengths if ("sdpa", n) in by}
    lines = [
        "# ASCender attention layer: forward + backward on CPU",
        "",
        f"Machine: {machine_text}. {commit_lines(state, points)}. Generated by `benchmarks/attention.py`.",
        "",
        f"One layer, batch 1, {HEADS} heads, head dim {HEAD_DIM}, fp32, causal; d_z = d_a = {D_Z}, k = {K_TOP},",
        f"window {WINDOW} + {GLOBALS} globals. Time: all implementations of one n run in one process, one torch",
        "thread, interleaved: each round times one fwd+bwd of each, in an order rotated from round to round; `rounds`",
        "rounds after one warm-up",
        "call each. `x SDPA`: the ratio impl / SDPA of the same round, median and minimum over the rounds; `time`:",
        "the median time. `load`: the 1-minute load average of the machine at the start / end of the n's timing",
        f"process (the machine has {cpus} logical CPUs and is shared; above ~1 other work competed for the cores: absolute",
        "times are inflated, the same-round ratios less so). Peak: resident-memory high-water mark above the level",
        "before one fwd+bwd (MiB, a fresh process per point, not affected by load); x SDPA: ratio to SDPA's peak.",
        "",
        "`CPU-time x SDPA`: the same-round ratio of the thread's CPU time (time.thread_time), median; it leaves out",
        "the time other processes held the core, not their cache contention.",
        "",
        "Every row of one n comes from one run (`--merge` replaces whole lengths); `commit`: that run's commit.",
        "",
        "| n | impl | time (s) | x SDPA median | x SDPA min | rounds | CPU-time x SDPA | peak (MiB) | peak x SDPA "
        "| CPU, threads | load | commit |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for n in lengths:
        for impl in IMPLS:
            p = by.get((impl, n))
            if p is None:
                continue
            commit = (p.get("git_commit") or "?")[:7] + ("+" if p.get("git_dirty") else "")
            if p["status"] != "ok":
                lines.append(f"| {n} | {impl} | {p['status']} | | | | | | | | | {commit} |")
                continue
            mem_ratio = p["peak_mib"] / sdpa_mem[n] if sdpa_mem.get(n) else float("nan")
            if "rounds" in p:
                cpu_r = f"{p['cpu_ratio']:.2f}" if "cpu_ratio" in p else "-"
                timing = (f"{p['time_s']:.3f} | {p['time_ratio']:.2f} | {p['time_ratio_min']:.2f} | {p['rounds']} | {cpu_r} | "
                          f"{p['peak_mib']:.0f} | {mem_ratio:.1f} | {p['cpu']}, {p['threads']} | "
                          f"{p['load_start']:.1f} / {p['load_1m']:.1f}")  # fmt: skip
            else:  # rows of an older run (--merge) with its best-of-a-few timing
                timing = f"{p['time_s']:.3f} | {p['time_ratio']:.1f} (earlier run, best of a few) | | | | " \
                         f"{p['peak_mib']:.0f} | {mem_ratio:.1f} | | "
            lines.append(f"| {n} | {impl} | {timing} | {commit} |")
    for note in notes:
        lines += ["", note]
    lines += ["", "Forward attention GFLOPs (analytic, see `attention_gflops`): full = top-k over all j < i,",
              "windowed = top-k over the +-window band plus globals.", "",
              "| n | SDPA | ASCender, full neighbourhoods | ASCender, windowed | neighbour search full / windowed |",
              "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in lengths:
        full, win = attention_gflops(n, False), attention_gflops(n, True)
        lines.append(
            f"| {n} | {full['sdpa']:.2f} | {full['ascender']:.2f} | {win['ascender']:.2f} | "
            f"{full['neighbour_search']:.3f} / {win['neighbour_search']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    if not write:
        return text
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attention.md").write_text(text)
    state = {k: state.get(k) for k in ("git_commit", "git_dirty")}
    (RESULTS / "attention.json").write_text(json.dumps(dict(machine=machine_text, logical_cpus=cpus, **state,
                                                            notes=list(notes), points=points), indent=1))
    plot(points, lengths)
    return text


def plot(points: list[dict], lengths: list[int]) -> None:
    from ascender_dist.plotting import pyplot

    plt = pyplot()  # one line naming the research extra when matplotlib is missing

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in IMPLS:
        ok = [p for p in points if p["impl"] == impl and p["status"] == "ok"]
        if not ok:
            continue
        ns = [p["n"] for p in ok]
        axes[0].plot(ns, [p["time_s"] for p in ok], "o-", label=impl)
        axes[1].plot(ns, [max(p["peak_mib"], 1e-1) for p in ok], "o-", label=impl)
    for ax, title in zip(axes, ("fwd+bwd time (s)", "peak memory above baseline (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"one causal attention layer, {HEADS} heads x {HEAD_DIM}, fp32, 1 CPU thread")
    fig.tight_layout()
    fig.savefig(RESULTS / "attention.png", dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        if sys.argv[2] == "memory":
            print(json.dumps(memory_worker(sys.argv[3], int(sys.argv[4]))))
        else:
            print(json.dumps(time_worker(int(sys.argv[3]), sys.argv[5].split(","), int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per memory run / per timing round")
    ap.add_argument("--reps", type=int, default=5, help="interleaved timing rounds per n (>= 5)")
    ap.add_argument("--mem-cap-gb", type=float, default=6.0, help="skip dense points estimated above this")
    ap.add_argument("--quick", action="store_true", help="smoke run: n = 256, 512 only; prints the table, writes nothing")
    ap.add_argument("--merge", action="store_true", help="keep the lengths of the existing attention.json that this run does not measure")
    ap.add_argument("--note", action="append",
                    help="a paragraph to print under the table (repeatable; saved in attention.json; with --rewrite "
                         "or --merge it replaces the recorded notes, which are kept otherwise)")
    ap.add_argument("--rewrite", action="store_true", help="only re-render md/png from attention.json")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error("--reps must be >= 5 (median and minimum of at least five same-round ratios)")
    if args.quick and (args.rewrite or args.merge):
        ap.error("--quick writes nothing: it does not combine with --rewrite or --merge")
    lengths = [256, 512] if args.quick else args.lengths
    if args.rewrite:
        saved = json.loads((RESULTS / "attention.json").read_text())
        notes = args.note or saved.get("notes", [])
        write_results(saved["points"], sorted({p["n"] for p in saved["points"]}), notes, saved, saved.get("machine"),
                      cpus=saved.get("logical_cpus"))
        return
    from ascender_dist.research.ablate.provenance import git_state  # research extra; gpu_check imports this file

    state = git_state()
    points = []
    for n in lengths:
        for p in run_length(n, ["sdpa"] + [i for i in args.impls if i != "sdpa"], args):
            p.update(cpu=cpu_model(), **state)
            print(json.dumps(p), flush=True)
            points.append(p)
    notes = list(args.note or [])
    if args.merge and (RESULTS / "attention.json").exists():
        saved = json.loads((RESULTS / "attention.json").read_text())
        points = merged_points(saved["points"], points)
        lengths = sorted({p["n"] for p in points})
        notes = notes or saved.get("notes", [])
    text = write_results(points, lengths, notes, state, write=not args.quick)
    if args.quick:
        print(text + "\n(--quick: smoke run, nothing written)")


if __name__ == "__main__":
    main()
