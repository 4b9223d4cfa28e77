"""Section ``attention``: one causal attention layer, forward + backward, ASCender vs SDPA.

The layer and its inputs are ``benchmarks/attention.py``'s (batch 1, 8 heads x 64, d_z = d_a = 32,
k = 16, window 128 + 4 globals), built on the plan's device in its dtype (bf16 on CUDA). ASCender runs
``ascender_attention(impl="auto")`` (the Triton kernels on CUDA; the resolved path is recorded); SDPA runs
``F.scaled_dot_product_attention(is_causal=True)`` under the first of FlashAttention, cuDNN, memory-efficient,
math that accepts the inputs (the one that ran is named).

Time: per length both layers are built in one process, each gets one first call (Triton compiles here;
recorded apart) and its warm-up calls, then ``repeats`` rounds each time one call of SDPA and one of ASCender
back to back (the order alternating round by round), with CUDA events (perf_counter on CPU). Per layer: the
median and minimum time; per row: the ratio ASCender / SDPA of each round, median and minimum over the
rounds (a slow spell of the host or the GPU hits both calls of a round alike). The host's 1-minute load
average (``os.getloadavg``) at the start and end of each length is recorded. Peak memory:
``torch.cuda.max_memory_allocated`` during one more call, above what was allocated before it (inputs and
parameters excluded); none on CPU. Before each length the section checks that 4x the previous length's
time (attention is quadratic) fits in what is left of its budget; lengths that do not fit are recorded as
not measured.

CUDA graph (CUDA only): the same ASCender fwd+bwd captured once per length in a ``torch.cuda.CUDAGraph``
(after warm-up calls on a side stream, as torch's docs prescribe) and replayed, in rounds alternating with
SDPA calls like the eager ones: what the layer costs without the host launching its ~1,200 kernels one by
one. The capture fails if the path synchronises with the host (a copy from pageable memory, ``.item()``);
the failure is recorded.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

from benchmarks.attention import D_A, D_Z, GLOBALS, HEAD_DIM, HEADS, K_TOP, WINDOW, _layer, attention_gflops
from benchmarks.gpu_check.plan import Budget, Plan

log = logging.getLogger("gpu_check")
TRITON_KERNELS = ("stats_kernel", "forward_kernel", "row_grad_kernel", "col_grad_kernel")  # kernels/*.py
IMPLS = ("sdpa", "ascender")  # SDPA first in the first round; the order alternates after that


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def resolved_impl(plan: Plan) -> tuple[str, str]:
    """(the path ``impl="auto"`` takes for this device and dtype, attention.py's own choice; why that is
    not the Triton kernels, or "" when it is)."""
    import torch

    q = torch.zeros(1, HEADS, 8, HEAD_DIM, device=plan.device, dtype=getattr(torch, plan.dtype))
    try:
        from ascender_dist.models.ascender.attention import _pick_impl

        kind = str(_pick_impl("auto", q))
    except Exception as exc:  # a changed signature must not stop the measurement
        return "unknown", f"{type(exc).__name__}: {exc}"
    if kind == "triton":
        return kind, ""
    if plan.device != "cuda":
        return kind, "impl auto takes the fast path on CPU tensors"
    try:
        from ascender_dist.models.ascender.kernels import triton_supported
    except ImportError:
        return kind, "no Triton kernels in this checkout"
    return kind, triton_supported(q)[1]


def sdpa_runner(n: int, plan: Plan):
    """(fwd+bwd closure, backend name): SDPA under the first backend that runs these inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    base = _layer("sdpa", n, plan.device, plan.dtype)
    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        def run(backend=backend):
            with sdpa_kernel(backend):
                base()

        try:
            run()
        except RuntimeError as exc:
            errors.append(f"{backend.name}: {str(exc).splitlines()[0][:120]}")
            continue
        return run, backend.name
    raise RuntimeError("no SDPA backend ran: " + "; ".join(errors))


def _failed(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def call_seconds(run, device: str) -> float:
    """Seconds of one call: CUDA events around it on CUDA, perf_counter on CPU."""
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in ms
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def time_interleaved(runs: dict, plan: Plan, first_calls: bool = True) -> dict:
    """``runs``: name -> fwd+bwd closure. Each gets its first call (timed apart, with ``first_calls``) and
    ``plan.warmup`` calls in all, then ``plan.repeats`` rounds time one call of each, the order rotated by
    one each round. Per name: ``{first_call_s, median_s, min_s, times_s}`` (times in round order), or
    ``{"status": "failed: ..."}`` for a closure that raised (the others go on without it)."""
    out: dict = {}
    live = {}
    for name, run in runs.items():
        try:
            t0 = time.perf_counter()
            run()
            _sync(plan.device)
            first = time.perf_counter() - t0
            for _ in range(plan.warmup - 1):
                run()
            _sync(plan.device)
        except Exception as exc:  # e.g. out of memory at a long length: recorded, the other layer still runs
            out[name] = {"status": _failed(exc)}
            continue
        out[name] = {"first_call_s": first} if first_calls else {}
        out[name]["times_s"] = []
        live[name] = run
    names = list(live)
    for r in range(plan.repeats if names else 0):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if "status" in out[name]:
                continue
            try:
                out[name]["times_s"].append(call_seconds(live[name], plan.device))
            except Exception as exc:
                out[name] = {"status": _failed(exc)}
    for res in out.values():
        if "status" not in res:
            res.update(median_s=statistics.median(res["times_s"]), min_s=min(res["times_s"]))
    return out


def peak_mib(run, device: str):
    """Peak CUDA memory of one call above the memory allocated before it (MiB); None on CPU."""
    from ascender_dist.training.metrics import cuda_peak_mib

    return cuda_peak_mib(run) if device == "cuda" else None


def graph_time(run, plan: Plan, sdpa=None) -> dict:
    """run() captured in a CUDA graph and replayed, in rounds alternating with ``sdpa`` calls when given:
    {graph_median_s, graph_min_s, graph_times_s, graph_sdpa_times_s} or {graph_status}."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream before capture (torch.cuda.graphs docs)
            for _ in range(plan.warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        timed = time_interleaved({"graph": graph.replay, **({"sdpa": sdpa} if sdpa else {})}, plan, first_calls=False)
        if "status" in timed["graph"]:
            return {"graph_status": timed["graph"]["status"]}
    except Exception as exc:  # a capture failure is a finding, recorded; the eager numbers stand
        return {"graph_status": _failed(exc)}
    out = {"graph_status": "ok", "graph_median_s": timed["graph"]["median_s"], "graph_min_s": timed["graph"]["min_s"],
           "graph_times_s": timed["graph"]["times_s"]}
    if "times_s" in timed.get("sdpa", {}):
        out["graph_sdpa_times_s"] = timed["sdpa"]["times_s"]
    return out


def build_runner(impl: str, n: int, plan: Plan, ascender_impl: str):
    """(fwd+bwd closure, backend name) of one layer."""
    if impl == "sdpa":
        return sdpa_runner(n, plan)
    return _layer("auto", n, plan.device, plan.dtype), ascender_impl


def measure_pair(n: int, plan: Plan, ascender_impl: str) -> list[dict]:
    """The SDPA and ASCender points of one length, timed in interleaved rounds (``time_interleaved``); then
    each layer's peak memory and, on CUDA, ASCender's CUDA-graph replay in rounds with SDPA. A failed layer
    (e.g. out of memory) is recorded in its point; the other is still measured."""
    import torch

    points = {impl: {"impl": impl, "n": n} for impl in IMPLS}
    runs = {}
    load_start = os.getloadavg()[0]
    try:
        for impl in IMPLS:
            try:
                runs[impl], points[impl]["backend"] = build_runner(impl, n, plan, ascender_impl)
            except Exception as exc:
                points[impl]["status"] = _failed(exc)
        for impl, timed in time_interleaved(runs, plan).items():
            points[impl].update(timed)
        for impl, run in runs.items():
            point = points[impl]
            if "status" in point:
                continue
            try:
                point.update(peak_mib=peak_mib(run, plan.device), status="ok")
                if impl != "sdpa" and plan.device == "cuda":
                    point.update(graph_time(run, plan, runs.get("sdpa") if points["sdpa"].get("status") == "ok"
                                            else None))
            except Exception as exc:
                point["status"] = _failed(exc)
    finally:
        runs = None
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    load = [load_start, os.getloadavg()[0]]
    for point in points.values():
        point["host_load_1m"] = load  # the host's 1-minute load average at the start / end of this length
        point.setdefault("peak_mib", None)
        graph = point.get("graph_status")
        log.info("[attention] n=%d %s (%s): %s", n, point["impl"], point.get("backend", "?"),
                 f"median {point['median_s'] * 1e3:.2f} ms, min {point['min_s'] * 1e3:.2f} ms" +
                 (f", peak {point['peak_mib']:.0f} MiB" if point["peak_mib"] is not None else "") +
                 (f"; CUDA graph replay median {point['graph_median_s'] * 1e3:.2f} ms" if graph == "ok" else
                  f"; CUDA graph {graph}" if graph else "")
                 if point["status"] == "ok" else point["status"])
    return [points[impl] for impl in IMPLS]


def profile_split(run, device: str, top: int = 10) -> dict:
    """Where one ASCender fwd+bwd spends its time (torch.profiler, CUDA only): wall time, the sum of
    GPU kernel times, the number of kernel launches, the Triton kernels' share and the top kernels by
    total time. A wall time far above the kernel sum means launch / host overhead, not kernel speed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return {"status": "skipped: CPU (the CPU profile is benchmarks/attention_breakdown.py)"}
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total, count = kernels.get(ev.name, (0.0, 0))
            kernels[ev.name] = (total + ev.device_time_total / 1e6, count + 1)
    kernel_s = sum(t for t, _ in kernels.values())
    triton_s = sum(t for name, (t, _) in kernels.items() if name in TRITON_KERNELS)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"status": "ok", "wall_s_profiled": wall, "kernel_s": kernel_s,
            "launches": sum(c for _, c in kernels.values()), "triton_kernel_s": triton_s,
            "top": [{"name": name[:90], "s": t, "count": c} for name, (t, c) in ranked]}


def next_length_seconds(pair: list[dict], plan: Plan, wall_s: float) -> float:
    """Seconds this length's calls take once compiled (the first call's Triton compilation is paid once,
    not per length); the wall time when a point failed. The next (doubled) length costs ~4x this."""
    if any(p["status"] != "ok" for p in pair):
        return wall_s
    calls = plan.warmup + plan.repeats + 1
    graphed = [p for p in pair if "graph_status" in p]
    # the graph replays run in rounds with SDPA again: its calls count once more per graphed point
    sdpa = sum(p["median_s"] for p in pair if p["impl"] == "sdpa") * (calls + 1) * len(graphed)
    graphs = sum(p.get("graph_median_s", p["median_s"]) * (calls + 1) for p in graphed)
    return sum(p["median_s"] * calls for p in pair) + graphs + sdpa


def run(plan: Plan, work: Path, budget: Budget) -> dict:
    ascender_impl, why_not_triton = resolved_impl(plan)
    log.info("[attention] ASCender impl='auto' resolves to %r on %s %s%s", ascender_impl, plan.device, plan.dtype,
             f" ({why_not_triton})" if why_not_triton else "")
    points, estimate = [], 0.0
    for n in plan.lengths:
        if estimate > budget.left():
            for impl in ("sdpa", "ascender"):
                points.append({"impl": impl, "n": n, "status": f"not measured: ~{estimate:.0f} s estimated, "
                                                                  f"{budget.left():.0f} s of the budget left"})
            log.warning("[attention] n=%d not measured: %s", n, points[-1]["status"])
            continue
        t0 = time.monotonic()
        pair = measure_pair(n, plan, ascender_impl)
        points += pair
        estimate = 4 * next_length_seconds(pair, plan, time.monotonic() - t0)
    profile = {"status": "skipped: no length of 2048 or less measured"}
    short = [n for n in plan.lengths if n <= 2048 and any(p["n"] == n and p["status"] == "ok" for p in points)]
    if short:
        try:
            profile = {"n": short[-1], **profile_split(_layer("auto", short[-1], plan.device, plan.dtype), plan.device)}
        except Exception as exc:  # the profile explains the table; it never fails the section
            profile = {"status": f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
        log.info("[attention] profile: %s", {k: v for k, v in profile.items() if k != "top"})
    bad = [p for p in points if p["status"] != "ok"]
    status = "ok" if not bad else f"failed: {len(bad)} of {len(points)} points: n={bad[0]['n']} {bad[0]['impl']} " \
                                  f"{bad[0]['status']}"
    return {"status": status, "ascender_impl": ascender_impl, "ascender_not_triton_because": why_not_triton,
            "dtype": plan.dtype, "device": plan.device,
            "shape": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "d_z": D_Z, "d_a": D_A, "k": K_TOP,
                      "window": WINDOW, "num_global": GLOBALS, "causal": True},
            "warmup": plan.warmup, "repeats": plan.repeats, "points": points, "rows": table_rows(points),
            "profile": profile}


def table_rows(points: list[dict]) -> list[dict]:
    """One row per length: both impls side by side, ASCender / SDPA ratios, analytic forward FLOP ratio.
    ``round_ratio`` / ``graph_round_ratio``: median, minimum and list of the same-round ratios (what the table
    shows); ``time_ratio`` / ``graph_ratio``: the ratio of the two medians (kept for readers of older records)."""
    from benchmarks.report import ratio_stats

    rows = []
    for n in sorted({p["n"] for p in points}):
        a = next(p for p in points if p["n"] == n and p["impl"] == "ascender")
        s = next(p for p in points if p["n"] == n and p["impl"] == "sdpa")
        flops = attention_gflops(n, windowed=True)
        row = {"n": n, "ascender": a, "sdpa": s, "flop_ratio": flops["ascender"] / flops["sdpa"]}
        if "host_load_1m" in a:
            row["host_load_1m"] = a["host_load_1m"]
        if a["status"] == s["status"] == "ok":
            row["time_ratio"] = a["median_s"] / s["median_s"]
            if len(a.get("times_s", [])) == len(s.get("times_s", [])) > 0:
                row["round_ratio"] = ratio_stats(a["times_s"], s["times_s"])
            if a.get("graph_status") == "ok":
                row["graph_ratio"] = a["graph_median_s"] / s["median_s"]
                if len(a.get("graph_times_s", [])) == len(a.get("graph_sdpa_times_s", [])) > 0:
                    row["graph_round_ratio"] = ratio_stats(a["graph_times_s"], a["graph_sdpa_times_s"])
            if a["peak_mib"] is not None and s["peak_mib"]:
                row["memory_ratio"] = a["peak_mib"] / s["peak_mib"]
        rows.append(row)
    return rows


def _ms(p: dict) -> str:
    return f"{p['median_s'] * 1e3:.3f} / {p['min_s'] * 1e3:.3f}" if p["status"] == "ok" else p["status"]


def _graph_ms(p: dict) -> str:
    status = p.get("graph_status")
    if status is None:
        return "n/a (CPU)" if p.get("peak_mib", 0) is None else ""
    return f"{p['graph_median_s'] * 1e3:.3f} / {p['graph_min_s'] * 1e3:.3f}" if status == "ok" else status


def _ratio(row: dict, rounds_key: str, medians_key: str) -> str:
    """``median / min`` of the same-round ratios; a record made before they were kept: the ratio of the medians."""
    if rounds_key in row:
        return f"{row[rounds_key]['median']:.2f} / {row[rounds_key]['min']:.2f}"
    return f"{row[medians_key]:.2f} (ratio of medians)" if medians_key in row else ""


def _load(row: dict) -> str:
    load = row.get("host_load_1m")
    return f"{load[0]:.1f} / {load[1]:.1f}" if load else ""


def _mib(p: dict) -> str:
    return "n/a (CPU)" if p.get("peak_mib", 0) is None else (f"{p['peak_mib']:.0f}" if p["status"] == "ok" else "")


def markdown(result: dict) -> list[str]:
    if "rows" not in result:
        return []
    sh = result["shape"]
    backends = sorted({r["sdpa"].get("backend") for r in result["rows"] if r["sdpa"].get("backend")})
    why = result["ascender_not_triton_because"]
    impl = f"`{result['ascender_impl']}`" + (f" ({why})" if why else "")
    lines = [f"One causal attention layer, forward + backward, {result['dtype']} on {result['device']}: batch "
             f"{sh['batch']}, {sh['heads']} heads x {sh['head_dim']}, d_z = d_a = {sh['d_z']}, k = {sh['k']}, window "
             f"{sh['window']} + {sh['num_global']} globals. ASCender: `ascender_attention(impl=\"auto\")` -> {impl}; "
             f"SDPA backend: {', '.join(backends) or 'none ran'}. Time: {result['repeats']} rounds after "
             f"{result['warmup']} warm-up call(s), each round one SDPA and one ASCender call back to back (the order "
             "alternating); per layer the median / min time (ms); ASCender / SDPA: the ratio of each round's two "
             "calls, median / min over the rounds. Peak: allocated memory above the inputs during one call (MiB). "
             "CUDA graph: the same ASCender fwd+bwd captured once and replayed, in rounds with SDPA calls (ms; the "
             "same-round ratio to SDPA beside it). FLOP ratio: analytic forward FLOPs, ASCender (windowed "
             "neighbourhoods) / SDPA (`benchmarks/attention.py: attention_gflops`). Host load: the 1-minute load "
             "average at the start / end of the length.", "",
             "| n | ASCender ms (median / min) | SDPA ms (median / min) | ASCender / SDPA (median / min) "
             "| ASCender CUDA graph ms (median / min) | graph / SDPA (median / min) | ASCender peak MiB "
             "| SDPA peak MiB | memory ratio | FLOP ratio | host load |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        ratio = lambda key: f"{r[key]:.2f}" if key in r else ""  # noqa: E731
        lines.append(f"| {r['n']} | {_ms(r['ascender'])} | {_ms(r['sdpa'])} | {_ratio(r, 'round_ratio', 'time_ratio')} | "
                     f"{_graph_ms(r['ascender'])} | {_ratio(r, 'graph_round_ratio', 'graph_ratio')} | "
                     f"{_mib(r['ascender'])} | {_mib(r['sdpa'])} | {ratio('memory_ratio')} | {r['flop_ratio']:.2f} | "
                     f"{_load(r)} |")
    firsts = [f"n={r['n']}: {r['ascender']['first_call_s']:.1f} s" for r in result["rows"]
              if "first_call_s" in r["ascender"]]
    if firsts:
        lines += ["", "ASCender first call (includes Triton compilation where it happens): " + ", ".join(firsts) + "."]
    return lines + profile_lines(result.get("profile"))


def profile_lines(prof) -> list[str]:
    if not prof:
        return []
    if prof["status"] != "ok":
        return ["", f"Profile: {prof['status']}."]
    lines = ["", f"Profile of one ASCender fwd+bwd at n = {prof['n']} (torch.profiler): wall "
             f"{prof['wall_s_profiled'] * 1e3:.2f} ms profiled, GPU kernels {prof['kernel_s'] * 1e3:.2f} ms in "
             f"{prof['launches']} launches, of which the Triton kernels {prof['triton_kernel_s'] * 1e3:.2f} ms.", "",
             "| kernel | total ms | launches |", "|---|---:|---:|"]
    lines += [f"| `{k['name']}` | {k['s'] * 1e3:.3f} | {k['count']} |" for k in prof["top"]]
    return lines


def plot(result: dict, path: Path) -> bool:
    """attention.png (time and peak memory vs n); False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in ("ascender", "sdpa"):
        ok = [p for p in result["points"] if p["impl"] == impl and p["status"] == "ok"]
        if not ok:
            continue
        label = f"{impl} ({ok[0]['backend']})"
        axes[0].plot([p["n"] for p in ok], [p["median_s"] * 1e3 for p in ok], "o-", label=label)
        graphed = [p for p in ok if p.get("graph_status") == "ok"]
        if graphed:
            axes[0].plot([p["n"] for p in graphed], [p["graph_median_s"] * 1e3 for p in graphed], "o--",
                         label=f"{label}, CUDA graph replay")
        mem = [p for p in ok if p["peak_mib"] is not None]
        if mem:
            axes[1].plot([p["n"] for p in mem], [p["peak_mib"] for p in mem], "o-", label=label)
    for ax, title in zip(axes, ("fwd+bwd time, median (ms)", "peak allocated memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(f"one causal attention layer, {HEADS} heads x {HEAD_DIM}, {result['dtype']}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
