"""The ASCender Triton kernels compile for an H100 (sm_90) and fit its shared memory, checked
without a GPU: triton compiles ahead of time down to a cubin with its bundled ptxas and reports
the shared bytes each kernel needs. Runs in a fresh interpreter with TRITON_INTERPRET unset (the
test session interprets kernels instead of compiling them). The launcher's own block sizes and
options are used, for fp32 and for bf16 inputs (TF32 products), in each head-dim class of
support.SHARED_BYTES_NEEDED with every feature on (L_sep's gradient included) at its widest
operands (head dim 64 without the L_coh value columns, whose key-block backward then runs 32-row
blocks; head dim 128 with them; d_z = d_a = 32); that table,
which decides which devices the kernels cover, must be the largest need of its class."""

import os
import subprocess
import sys
import textwrap

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

    zd, hd2 = 34, 34
    pad = launch._pad

    def build(kern, kind, extra, ieee, hd, vd, arch=90):
        widest = max(pad(hd), pad(zd), pad(hd2), pad(vd))
        bm = launch.block_size(widest, False, kind)
        const = dict(HDP=pad(hd), ZP=pad(zd), HP=pad(hd2), VP=pad(vd), BM=bm, BN=bm, CAUSAL=True, ALIGN=True,
                     COH=True, SEP=True, ALIBI=True, LSEP=True, RATIO_ONE=False, F64=False, IEEE=ieee, **extra)
        params = list(inspect.signature(kern.fn).parameters)
        const = {k: v for k, v in const.items() if k in params}
        sig = {p: "constexpr" if p in const else ("*fp32" if p.endswith("_ptr") else "i32") for p in params}
        src = triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.launch_options(False))
        return k.metadata.shared

    kernels = [("stats", forward.stats_kernel, "forward", {}), ("forward", forward.forward_kernel, "forward", {}),
               ("row", backward.row_grad_kernel, "row", {"GEOM": False}),
               ("row_geom", backward.row_grad_kernel, "row", {"GEOM": True}),
               ("col", backward.col_grad_kernel, "col", {})]
    for hd, vd in ((64, 64), (128, 128 + 32 + 1)):
        needs = {(i, ieee): build(*kernels[i][1:], hd=hd, vd=vd, ieee=ieee) for i in range(5) for ieee in (True, False)}
        for (i, ieee), shared in needs.items():
            print(90, hd, kernels[i][0], ieee, shared, flush=True)
        i, ieee = max(needs, key=needs.get)  # the largest block again for an A100 (sm_80)
        print(80, hd, kernels[i][0], ieee, build(*kernels[i][1:], hd=hd, vd=vd, ieee=ieee, arch=80), flush=True)
    """
)


def test_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from ascender_dist.models.ascender.kernels.support import SHARED_BYTES_NEEDED

    lines = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 22, proc.stdout
    for arch, hd, name, ieee, shared in lines:
        assert int(shared) <= H100_SHARED, f"{name} (head dim {hd}, ieee={ieee}) needs {shared} bytes of shared memory"
    for hd in (64, 128):
        largest = max(int(shared) for arch, h, _, _, shared in lines if arch == "90" and int(h) == hd)
        assert SHARED_BYTES_NEEDED[hd] == largest, (hd, largest, proc.stdout)  # the table is the largest need
        on_a100 = [int(shared) for arch, h, _, _, shared in lines if arch == "80" and int(h) == hd]
        assert on_a100 and max(on_a100) <= SHARED_BYTES_NEEDED[hd], proc.stdout  # and it covers sm_80's
