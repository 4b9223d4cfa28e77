"""Forward + backward cost of one ASCender attention layer vs plain SDPA, on CPU, fp32.

Batch 1, 8 heads, head dim 64, causal, d_z = d_a = 32, k = 16, window 128 + 4 globals (the
defaults of AscenderHParams). Implementations:

    sdpa       torch scaled_dot_product_attention(is_causal=True) on q, k, v
    seed       the seed's reference code as written (benchmarks/seed_reference.py; its Alignment gathers
               k_hat_i, the query's own key, so its top-k is unused), causal mask applied last
    reference  our dense reference (reference.py), causal statistics
    fast       our chunked fast path (fast.py), causal statistics, the default path on CPU

Each (impl, n) point runs in two fresh subprocesses with one torch thread. Memory: after one
warm-up fwd+bwd it resets the kernel's peak-RSS counter (/proc/self/clear_refs), runs one
fwd+bwd and reads VmHWM - VmRSS(before); glibc is told to mmap every block above 1 MiB, so that
freed memory really leaves the process and the high-water mark is the true peak. Time: a second
process with glibc's default allocator (the mmap setting makes every large temporary a fresh
mapping whose pages fault on first touch: it slowed the tiled fast path 1.7x and SDPA not at
all), the best of a few fwd+bwd runs, with SDPA timed in the same process for the ratio. Points
whose estimated memory exceeds --mem-cap-gb or whose run exceeds --timeout are reported as such.

    .venv/bin/python benchmarks/attention.py           # ~10 min on a 2-core CPU
    .venv/bin/python benchmarks/attention.py --quick   # smoke run

Writes benchmarks/results/attention.{json,md,png}.
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


def _layer(impl: str, n: int, device: str = "cpu", dtype: str = "float32"):
    """A closure running one fwd+bwd of impl on fresh leaf inputs of length n (inputs and the
    per-head parameters on ``device`` in ``dtype``, a torch dtype name; benchmarks/gpu_check uses bf16 on CUDA)."""
    import torch
    import torch.nn.functional as F

    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, ascender_attention
    from seed_reference import seed_attention, seed_params  # benchmarks/, this script's directory

    g = torch.Generator().manual_seed(0)
    to = dict(device=device, dtype=getattr(torch, dtype))

    def mk(d):  # [b, np, s, d], drawn on the CPU generator so every device sees the same numbers
        return torch.randn(1, HEADS, n, d, generator=g).to(**to).requires_grad_()

    q, k, v, z, h = mk(HEAD_DIM), mk(HEAD_DIM), mk(HEAD_DIM), mk(D_Z), mk(D_A)
    hp = AscenderHParams(d_z=D_Z, d_a=D_A, k=K_TOP, window=WINDOW, num_global=GLOBALS, causal=True)
    params = AscenderHeadParams(hp, HEADS).to(**to)
    sp = seed_params()
    causal_mask = torch.ones(n, n).tril() if impl == "seed" else None

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


def worker(impl: str, n: int, reps: int, measure: str) -> dict:
    """One warm-up fwd+bwd (first calls allocate one-time workspaces, ~75 MiB here), then either
    the peak-memory run (measure == "memory") or reps timed runs with SDPA timed alongside."""
    import torch

    torch.set_num_threads(1)
    if measure == "memory":
        try:  # M_MMAP_THRESHOLD: big blocks via mmap, so free() returns them to the OS
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
        except OSError:
            pass
    if n > 2048:  # warm up on a small problem: one-time workspaces without a second long run
        for name in ("sdpa", impl):
            _layer(name, 512)()
    sdpa = _layer("sdpa", n)
    run = sdpa if impl == "sdpa" else _layer(impl, n)
    sdpa()
    if n <= 2048:
        run()
    if measure == "memory":
        return dict(peak_mib=_peak_delta_mib(run))
    t = _best_time(run, reps)
    t_sdpa = t if impl == "sdpa" else _best_time(sdpa, max(reps, 3))
    return dict(time_s=t, sdpa_time_s=t_sdpa, time_ratio=t / t_sdpa, load_1m=os.getloadavg()[0])


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


def run_point(impl: str, n: int, args) -> dict:
    est = estimated_gib(impl, n)
    if est > args.mem_cap_gb:
        return dict(impl=impl, n=n, status=f"skipped: est. {est:.0f} GiB > {args.mem_cap_gb:g} GiB cap")
    reps = 3 if n <= 1024 else (2 if n <= 4096 else 1)
    point = dict(impl=impl, n=n, status="ok")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for measure in ("memory", "time"):
        cmd = [sys.executable, __file__, "--worker", impl, str(n), str(reps), measure]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return dict(impl=impl, n=n, status=f"timeout > {args.timeout:g} s ({measure})")
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return dict(impl=impl, n=n, status=f"failed (rc {proc.returncode}, {measure}): {tail[:80]}")
        point.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return point


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()}-core CPU ({cpu}), 1 torch thread, torch {torch.__version__}, Python {platform.python_version()}"


def write_results(points: list[dict], lengths: list[int], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    by = {(p["impl"], p["n"]): p for p in points}
    sdpa_mem = {n: by[("sdpa", n)].get("peak_mib") for n in lengths if ("sdpa", n) in by}
    lines = [
        "# ASCender attention layer: forward + backward on CPU",
        "",
        f"Machine: {machine()}. Generated by `benchmarks/attention.py`.",
        f"The machine is shared: the 1-minute load average on its {os.cpu_count()} cores at the end of each point is in",
        "the `load` column (above 2 means other work competed for the cores, so absolute times are",
        "inflated and ratios noisy; SDPA is re-timed in each point's process to keep the ratio honest).",
        "Memory is not affected by the load.",
        "",
        f"One layer, batch 1, {HEADS} heads, head dim {HEAD_DIM}, fp32, causal; d_z = d_a = {D_Z}, k = {K_TOP},",
        f"window {WINDOW} + {GLOBALS} globals. Time: best fwd+bwd wall time; x SDPA: ratio to SDPA timed in",
        "the same process. Peak: resident-memory high-water mark above the level before the fwd+bwd (MiB),",
        "x SDPA: ratio to the SDPA point's peak.",
        "",
        "| n | impl | time (s) | time x SDPA | peak (MiB) | peak x SDPA | load |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        for impl in IMPLS:
            p = by.get((impl, n))
            if p is None:
                continue
            if p["status"] != "ok":
                lines.append(f"| {n} | {impl} | {p['status']} | | | | |")
                continue
            mem_ratio = p["peak_mib"] / sdpa_mem[n] if sdpa_mem.get(n) else float("nan")
            load = f"{p['load_1m']:.1f}" if "load_1m" in p else "earlier run"
            lines.append(
                f"| {n} | {impl} | {p['time_s']:.3f} | {p['time_ratio']:.1f} | {p['peak_mib']:.0f} | {mem_ratio:.1f} "
                f"| {load} |"
            )
    for note in args.note or []:
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
    (RESULTS / "attention.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "attention.json").write_text(json.dumps(dict(machine=machine(), points=points), indent=1))
    plot(points, lengths)


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
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per (impl, n) point")
    ap.add_argument("--mem-cap-gb", type=float, default=6.0, help="skip dense points estimated above this")
    ap.add_argument("--quick", action="store_true", help="n = 256, 512 only")
    ap.add_argument("--merge", action="store_true", help="keep other points of the existing attention.json")
    ap.add_argument("--note", action="append", help="a paragraph to print under the table (repeatable)")
    ap.add_argument("--rewrite", action="store_true", help="only re-render md/png from attention.json")
    args = ap.parse_args()
    lengths = [256, 512] if args.quick else args.lengths
    if args.rewrite:
        points = json.loads((RESULTS / "attention.json").read_text())["points"]
        write_results(points, sorted({p["n"] for p in points}), args)
        return
    points = []
    for n in lengths:
        for impl in ["sdpa"] + [i for i in args.impls if i != "sdpa"]:
            p = run_point(impl, n, args)
            print(json.dumps(p), flush=True)
            points.append(p)
    if args.merge and (RESULTS / "attention.json").exists():
        new = {(p["impl"], p["n"]) for p in points}
        old = json.loads((RESULTS / "attention.json").read_text())["points"]
        points = [p for p in old if (p["impl"], p["n"]) not in new] + points
        lengths = sorted({p["n"] for p in points})
    write_results(points, lengths, args)


if __name__ == "__main__":
    main()
