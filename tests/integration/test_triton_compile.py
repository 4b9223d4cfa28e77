"""The ASCender Triton kernels compile for an H100 (sm_90) and the shared memory they need is the
table that decides which devices and widths they cover (support.SHARED_BYTES_NEEDED), checked
without a GPU: triton compiles ahead of time down to a cubin with its bundled ptxas and reports
the shared bytes each kernel needs. Runs in fresh interpreters with TRITON_INTERPRET unset (the
test session interprets kernels instead of compiling them), two at a time. The launcher's own
block sizes and options are used, every feature on (L_sep's gradient included), at each table
entry's padded operand widths (HDP, ZP, HP, VP): for fp32 and bf16 inputs (IEEE and TF32
products), or fp64 inputs. Each entry must be the largest need of the five kernels on sm_90, and
cover its largest kernel compiled for sm_80 (A100); the presets' widths nearest their bounds
must need no more than the entry that bounds them (the table covers the widths it bounds).
The second test compiles what the presets' calls really launch (the JIT's own specializations:
production flags, ints and pointers as bound) and holds each to its entry (LAUNCH_SCRIPT)."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

H100_SHARED = 232448  # bytes per block (227 KiB, opt-in maximum)

SCRIPT = textwrap.dedent(
    """
    import inspect, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from ascender_dist.models.ascender.kernels import backward, forward, launch

    KERNELS = {"stats": (forward.stats_kernel, "forward", {}), "forward": (forward.forward_kernel, "forward", {}),
               "row": (backward.row_grad_kernel, "row", {"GEOM": False}),
               "row_geom": (backward.row_grad_kernel, "row", {"GEOM": True}),
               "col": (backward.col_grad_kernel, "col", {})}

    def shared(arch, widths, f64, name, ieee):
        kern, kind, extra = KERNELS[name]
        bm = launch.block_size(max(widths), False, kind, f64)
        const = dict(zip(("HDP", "ZP", "HP", "VP"), widths), BM=bm, BN=bm, CAUSAL=True, ALIGN=True, COH=True,
                     SEP=True, ALIBI=True, LSEP=True, RATIO_ONE=False, F64=f64, IEEE=ieee, **extra)
        params = list(inspect.signature(kern.fn).parameters)
        const = {k: v for k, v in const.items() if k in params}
        ptr = "*fp64" if f64 else "*fp32"
        sig = {p: "constexpr" if p in const else (ptr if p.endswith("_ptr") else "i32") for p in params}
        src = triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.launch_options(False))
        return k.metadata.shared

    # argv: arch hdp zp hp vp f64 [kernel ieee]: every kernel (and product precision) unless named
    arch, *widths, f64 = (int(x) for x in sys.argv[1:7])
    jobs = [(sys.argv[7], sys.argv[8] == "True")] if len(sys.argv) > 7 else \\
        [(name, ieee) for name in KERNELS for ieee in ((True,) if f64 else (True, False))]
    for name, ieee in jobs:
        print(arch, *widths, bool(f64), name, ieee, shared(arch, tuple(widths), bool(f64), name, ieee), flush=True)
    """
)

# (HDP, ZP, HP, VP) the presets launch (support.launch_widths) nearest their bounds (measured 142 of
# 160 KiB, 154 of 160): small / medium before Separation joins; large before it, with L_coh's columns
NEAR_BOUNDS = [(64, 64, 16, 64), (128, 64, 16, 256)]


def compile_all(jobs: list[tuple]) -> list[tuple]:
    """Compile each job ((arch, HDP, ZP, HP, VP, f64[, kernel, ieee])) in a fresh interpreter, two at
    a time; the lines (arch, HDP, ZP, HP, VP, f64, kernel, ieee, shared bytes) of all of them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run(job):
        args = [str(int(x)) if isinstance(x, bool) and i == 5 else str(x) for i, x in enumerate(job)]
        proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True,
                              timeout=1500)  # fmt: skip
        assert proc.returncode == 0, (job, proc.stderr[-3000:])
        return [line.split() for line in proc.stdout.splitlines() if line.strip()]

    with ThreadPoolExecutor(max_workers=2) as pool:
        outputs = list(pool.map(run, jobs))
    lines = []
    for job, out in zip(jobs, outputs):
        assert len(out) == (1 if len(job) > 6 else 5 if job[5] else 10), (job, out)
        lines += [(int(a), int(h), int(z), int(hp), int(v), f == "True", name, i == "True", int(sh))
                  for a, h, z, hp, v, f, name, i, sh in out]  # fmt: skip
    return lines


def test_shared_memory_table_is_the_kernels_largest_need_and_bounds_the_presets():
    from ascender_dist.config.ascender_hparams import AscenderHParams
    from ascender_dist.config.presets import ARCHITECTURE_PRESETS, MODEL_PRESETS
    from ascender_dist.models.ascender.kernels.support import SHARED_BYTES_NEEDED, launch_widths, shared_bytes_needed

    presets = set()
    for name, model in MODEL_PRESETS.items():
        widths = ARCHITECTURE_PRESETS["ascender"][name]["ascender"]
        for aux in (0.0, 0.5):
            hp = AscenderHParams(d_z=widths["d_z"], d_a=widths["d_a"], aux_compactness_weight=aux)
            presets.update(launch_widths(model["hidden_size"] // model["num_attention_heads"], hp))
    assert all(shared_bytes_needed(w) for w in presets), presets  # every preset is covered
    assert set(NEAR_BOUNDS) <= presets - {key[:4] for key in SHARED_BYTES_NEEDED}, presets

    entries = list(SHARED_BYTES_NEEDED)
    lines = compile_all([(90, *key) for key in entries] + [(90, *w, False) for w in NEAR_BOUNDS])
    report = "\n".join(" ".join(map(str, line)) for line in lines)

    def needs(key):
        return {(name, ieee): sh for a, *k, name, ieee, sh in lines if a == 90 and tuple(k) == key}

    largest = {}
    for key in entries:
        on_sm90 = needs(key)
        largest[key] = max(on_sm90, key=on_sm90.get)
        assert SHARED_BYTES_NEEDED[key] == on_sm90[largest[key]], (key, report)  # the table is the largest need
        if not key[-1]:  # fp32 / bf16 inputs fit an H100 (fp64, tests only, need not)
            assert SHARED_BYTES_NEEDED[key] <= H100_SHARED, (key, report)
    for w in NEAR_BOUNDS:
        assert max(needs((*w, False)).values()) <= shared_bytes_needed(w), (w, report)
    on_sm80 = compile_all([(80, *key, *largest[key]) for key in entries])
    for a, *key, name, ieee, sh in on_sm80:
        assert sh <= SHARED_BYTES_NEEDED[tuple(key)], (key, name, ieee, sh, report)  # and it covers sm_80's


# The launches themselves: a forward and backward of the Triton path on CPU tensors with a fake sm_90
# driver, the JIT binding and specializing every kernel[grid](...) call as on a GPU (GPU block sizes;
# ints and pointers divisible by 16 as such, CPU tensors being 64-byte aligned and CUDA's 512; ints
# equal to 1 as constants; the flags the call sets) and handing triton's own record of the
# specialization (specialization_data) to jit_cache_hook, which skips compiling and launching it
# (the kernels' outputs stay as allocated: only the launches count).
# Each distinct specialization is then compiled again from that record (JITFunction.preload) up to
# the LLVM IR: make_llir allocates the shared memory and sets metadata["shared"], which neither ptx
# nor ptxas changes (checked against full compiles: equal for all of these, triton 3.7; compile_all
# above goes through ptxas), at half the time: ~110 specializations, ~1.5 min on 2 cores. Shapes:
# each preset's head dim, d_z, d_a, causal, at step 0 and at separation_start_step (Separation off,
# then on), with the defaults (no aux loss, no ALiBi, tau_sep = tau_coh) and with every feature a
# config can add (the three aux losses: L_coh's value columns and L_sep's gradient; ALiBi; tau_sep !=
# tau_coh), for bf16, fp16 and fp32 inputs; on sm_90 (the same launches compiled for sm_80 needed
# at most 160 KiB too, not repeated here for the time).
LAUNCH_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class FakeCuda:
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", int(sys.argv[2]), 32)
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(FakeCuda())

    def capture(calls):  # stdout: one line per launch {call, step, kernel, spec}
        from ascender_dist.config.ascender_hparams import AscenderHParams
        from ascender_dist.models.ascender.kernels import function, triton_attention
        from ascender_dist.models.ascender.params import AscenderHeadParams
        assert not function.interpreting()  # the GPU block sizes and options
        where = {}
        def record(*, fn, compile, **_):
            print(json.dumps(dict(where, kernel=fn.name, spec=compile["specialization_data"])), flush=True)
            return True  # neither compiled nor launched
        knobs.runtime.jit_cache_hook = record
        for i, call in enumerate(calls):
            hp = AscenderHParams(**call["hparams"])
            for step in (0, hp.separation_start_step):
                g = torch.Generator().manual_seed(0)
                dtype = getattr(torch, call["dtype"])
                q, k, v, z, h = (torch.randn(1, 2, 48, d, generator=g).to(dtype).requires_grad_()
                                 for d in (call["hd"],) * 3 + (hp.d_z, hp.d_a))
                where.update(call=i, step=step)
                res = triton_attention(q, k, v, z, h, AscenderHeadParams(hp, 2), hp, use_sep=hp.separation_active(step),
                                       with_aux=hp.aux_active(step))
                (res.out.float().sum() + (res.aux["total"] if res.aux else 0)).backward()

    class Allocated(Exception):
        pass

    def stop_after_llir(*args):  # knobs' stage hook: called bare (its cache key), then with the stages
        if not args:
            return "-shared-memory-only", "0"
        def ptx(src, metadata):  # make_llir has allocated the shared memory
            raise Allocated(metadata["shared"])
        args[1]["ptx"] = ptx
        args[1].pop("cubin", None)

    def shared_memory(lines):  # stdin: one specialization_data a line; stdout: its shared bytes
        knobs.runtime.add_stages_inspection_hook = stop_after_llir
        for line in lines:
            spec = json.loads(line)
            module, _, name = json.loads(spec)["name"].rpartition(".")
            try:
                getattr(importlib.import_module(module), name).preload(spec)
                raise AssertionError("compiled past the LLVM IR")
            except Allocated as done:
                print(done.args[0], flush=True)

    capture(json.loads(sys.argv[3])) if sys.argv[1] == "capture" else shared_memory(sys.stdin)
    """
)

EVERY_FEATURE = dict(aux_compactness_weight=0.5, aux_crowding_weight=0.5, aux_alignment_weight=0.2,
                     other_bias="alibi", tau_sep=0.5)  # fmt: skip


# the bias ablations' launches (a bias switched off changes the kernels' constexpr flags and operand
# widths): one preset, bf16 (the widths, not the dtype or the preset's sizes, decide the need)
ABLATED = (("no Alignment", {"use_align": False}), ("no Cohesion", {"use_coh": False}))


def preset_calls() -> list[dict]:
    """The calls whose launches are compiled: each preset with the defaults and with EVERY_FEATURE
    (Separation from step 1), for bf16, fp16 and fp32 inputs; and the small preset in bf16 with
    each ABLATED setting."""
    from ascender_dist.config.presets import ARCHITECTURE_PRESETS, MODEL_PRESETS

    calls = []
    for name, model in MODEL_PRESETS.items():
        hd = model["hidden_size"] // model["num_attention_heads"]
        for features, extra in (("defaults", {}), ("every feature", EVERY_FEATURE)):
            hparams = dict(ARCHITECTURE_PRESETS["ascender"][name]["ascender"], separation_start_step=1, **extra)
            for dtype in ("bfloat16", "float16", "float32"):
                calls.append(dict(preset=name, hd=hd, hparams=hparams, features=features, dtype=dtype))
        if name == "small":
            for features, extra in ABLATED:
                hparams = dict(ARCHITECTURE_PRESETS["ascender"][name]["ascender"], separation_start_step=1, **extra)
                calls.append(dict(preset=name, hd=hd, hparams=hparams, features=features, dtype="bfloat16"))
    return calls


def launch_env(cache: str) -> dict:
    """The test session's environment without TRITON_INTERPRET, compiling into ``cache`` (the early
    stop leaves partial compiles there: kept out of the user's triton cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, TRITON_CACHE_DIR=cache)


def constants(spec: str) -> dict:
    """A specialization_data's constexpr arguments by name."""
    data = json.loads(spec)
    names = list(data["signature"])
    return {names[path[0]]: val for path, val in zip(data["constant_keys"], data["constant_vals"]) if len(path) == 1}


def captured_launches(calls: list[dict], arch: int, env: dict) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", LAUNCH_SCRIPT, "capture", str(arch), json.dumps(calls)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def launch_shared_memory(specs: list[str], arch: int, env: dict) -> dict[str, int]:
    """The shared bytes of each specialization, compiled in two fresh interpreters (the costliest
    first, dealt alternately: fp32 products unrolled into FMAs compile slowest, then the widest)."""

    def cost(spec):
        c = constants(spec)
        return c["IEEE"], sum(c.get(k, 0) for k in ("HDP", "ZP", "HP", "VP")) * c["BM"]

    order = sorted(specs, key=cost, reverse=True)

    def run(part):
        lines = "".join(json.dumps(spec) + "\n" for spec in part)
        proc = subprocess.run([sys.executable, "-c", LAUNCH_SCRIPT, "compile", str(arch)], env=env, input=lines,
                              capture_output=True, text=True, timeout=1500)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout.split()
        assert len(out) == len(part), (out, proc.stderr[-3000:])
        return dict(zip(part, map(int, out)))

    with ThreadPoolExecutor(max_workers=2) as pool:
        parts = list(pool.map(run, (order[0::2], order[1::2])))
    return {**parts[0], **parts[1]}


def test_real_launches_need_no_more_shared_memory_than_their_table_entry():
    """Every specialization a forward and backward of the presets launches (above) needs at most the
    SHARED_BYTES_NEEDED entry of its operand widths, the one shared_memory_shortfall reads for the
    layer, and fits an H100; the widths it launches are kernel_widths' for the call, among the
    layer's launch_widths."""
    from ascender_dist.config.ascender_hparams import AscenderHParams
    from ascender_dist.models.ascender.kernels.support import (kernel_widths, launch_widths, shared_bytes_needed,
                                                               shared_memory_shortfall)  # fmt: skip

    calls = preset_calls()
    with tempfile.TemporaryDirectory() as cache:  # ~100 MB of partial compiles
        env = launch_env(cache)
        launches = captured_launches(calls, 90, env)
        shared = launch_shared_memory(sorted({launch["spec"] for launch in launches}), 90, env)

    rows, failures = [], []
    for launch in launches:
        call = calls[launch["call"]]
        hp = AscenderHParams(**call["hparams"])
        sep = hp.separation_active(launch["step"])
        lcoh = hp.aux_active(launch["step"]) and hp.use_coh and hp.aux_compactness_weight > 0
        widths = kernel_widths(call["hd"], hp.d_z, hp.d_a, sep=sep, coh=hp.use_coh, lcoh=lcoh)
        const = constants(launch["spec"])
        flags = "+".join(f for f in ("CAUSAL", "ALIGN", "COH", "SEP", "ALIBI", "LSEP", "RATIO_ONE", "IEEE", "GEOM")
                         if const.get(f))  # fmt: skip
        need = shared_bytes_needed(widths)
        sh = shared[launch["spec"]]
        row = (call["preset"], call["dtype"], call["features"], f"step {launch['step']}", launch["kernel"], widths,
               f"BM {const['BM']}", flags, f"{sh / 1024:g} of {need and need // 1024} KiB")  # fmt: skip
        rows.append(" ".join(map(str, row)))
        launched = tuple(const.get(k, w) for k, w in zip(("HDP", "ZP", "HP", "VP"), widths))
        if launched != widths or widths not in launch_widths(call["hd"], hp):
            failures.append(f"launched widths {launched} are not kernel_widths' / launch_widths': {rows[-1]}")
        if need is None or sh > need or sh > H100_SHARED:
            failures.append(rows[-1])
    report = "\n".join(rows)
    for i, call in enumerate(calls):
        hp = AscenderHParams(**call["hparams"])
        for step in (0, hp.separation_start_step):  # forward and backward ran: every kernel launched
            kernels = {launch["kernel"] for launch in launches if (launch["call"], launch["step"]) == (i, step)}
            # the row statistics (K1) are Separation's and Cohesion's: without both, no stats launch
            stats = {"stats_kernel"} if hp.use_coh or hp.separation_active(step) else set()
            assert kernels == stats | {"forward_kernel", "row_grad_kernel", "col_grad_kernel"}, (call, report)
        assert shared_memory_shortfall("H100", H100_SHARED, call["hd"], hp) == "", (call, report)
    assert not failures, "\n".join(failures) + "\n\nevery launch:\n" + report
