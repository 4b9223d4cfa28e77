"""The ASCender Triton kernels compile for an H100 (sm_90) and the shared memory they need is the
table that decides which devices and widths they cover (support.SHARED_BYTES_NEEDED), checked
without a GPU: triton compiles ahead of time down to a cubin with its bundled ptxas and reports
the shared bytes each kernel needs. Runs in fresh interpreters with TRITON_INTERPRET unset (the
test session interprets kernels instead of compiling them), two at a time. The launcher's own
block sizes and options are used, every feature on (L_sep's gradient included), at each table
entry's padded operand widths (HDP, ZP, HP, VP): for fp32 and bf16 inputs (IEEE and TF32
products), or fp64 inputs. Each entry must be the largest need of the five kernels on sm_90, and
cover its largest kernel compiled for sm_80 (A100); the presets' widths nearest their bounds
must need no more than the entry that bounds them (the table covers the widths it bounds)."""

import os
import subprocess
import sys
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
