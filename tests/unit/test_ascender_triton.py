"""The Triton kernels (run by the interpreter on CPU, compiled on CUDA) against the dense
reference: output, every input and parameter gradient, row statistics and aux losses; float64
at 1e-9, float32 at 1e-5 relative to the float64 reference; lengths off the block size (16),
causal (row 0 has one key) and bidirectional, with and without Separation."""

import copy
import logging

import pytest
import torch

from ascender_dist.config.ascender_hparams import AscenderHParams
from ascender_dist.models.ascender import ascender_attention, reference_attention
from ascender_dist.models.ascender import attention as entry
from ascender_dist.models.ascender.kernels import triton_supported

from tests.helpers.causality import assert_gradients_causal

from .test_ascender_fast import base_hp, make_inputs, make_params, outputs_of

import triton  # noqa: E402  a [dev] requirement: a missing one fails collection instead of skipping 44 tests
import triton.language as tl  # noqa: E402

from ascender_dist.models.ascender.kernels import triton_attention  # noqa: E402

torch.set_num_threads(1)
F64, F32 = torch.float64, torch.float32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AUX = dict(aux_compactness_weight=0.3, aux_crowding_weight=0.5, aux_alignment_weight=0.2)


def test_interpreter_is_active_without_cuda():
    """conftest.py must set TRITON_INTERPRET before triton's first import, else every kernel
    test below would fail with '0 active drivers' (or on tl.sum) instead of this one line."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels are compiled")
    assert type(tl.sum).__name__ == "InterpretedFunction", "TRITON_INTERPRET was set after importing triton"


def _loss(result, w, with_aux):
    return (result.out.to(w.dtype) * w).sum() + (result.aux["total"] if with_aux else 0)


def compare(hp, n, *, dtype=F64, use_sep=True, with_aux=False, b=1, nh=2, hd=16, tol=1e-9, rel=False,
            z_offset=None):
    """Kernels in ``dtype`` vs the float64 reference: out, every gradient (q, k, v, z, h and every
    learned per-head tensor), row statistics and aux losses. rel: errors relative to each
    tensor's largest reference entry (float32), else absolute (float64). z_offset: z becomes
    0.05 z + z_offset (a common offset in z)."""
    inputs64 = make_inputs(b=b, nh=nh, n=n, hd=hd, dz=hp.d_z, da=hp.d_a, dtype=F64)
    if z_offset is not None:
        with torch.no_grad():
            inputs64[3].mul_(0.05).add_(z_offset)
    params64 = make_params(hp, nh, dtype=F64)
    inputs = [x.detach().to(DEVICE, dtype).requires_grad_() for x in inputs64]
    if inputs[0].is_cuda:  # a GPU whose shared memory the kernels outgrow here (fp64 at head dim 128 on an A100)
        ok, why = triton_supported(inputs[0], hp)
        if not ok:
            pytest.skip(f"not covered on this GPU: {why}")
    params = make_params(hp, nh, dtype=F64).to(DEVICE, dtype)  # the same values as params64
    ref = reference_attention(*inputs64, params64, hp, use_sep=use_sep, with_aux=with_aux)
    got = triton_attention(*inputs, params, hp, use_sep=use_sep, with_aux=with_aux)

    def check(name, a, b_):
        a = a.detach().to("cpu", F64)
        b_ = b_.detach().to("cpu", F64)
        err = (a - b_).abs().max().item() if a.numel() else 0.0
        scale = max(1.0, b_.abs().max().item()) if rel else 1.0
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:g} x {scale:.3g} (n={n})"

    check("out", got.out, ref.out)
    for key in ("u", "gate_align", "eta", "rho", "centroid", "gate_coh"):
        if key in ref.rows:
            check(f"rows.{key}", got.rows[key], ref.rows[key])
    for key, val in ref.aux.items():
        check(f"aux.{key}", got.aux[key], val)
    w = torch.randn(ref.out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    names = ["q", "k", "v", "z", "h"] + [name for name, _ in params.named_parameters()]
    g_ref = torch.autograd.grad(_loss(ref, w, with_aux), inputs64 + list(params64.parameters()),
                                allow_unused=True, materialize_grads=True)  # fmt: skip
    g_got = torch.autograd.grad(_loss(got, w.to(DEVICE, dtype), with_aux), inputs + list(params.parameters()),
                                allow_unused=True, materialize_grads=True)  # fmt: skip
    for name, a, b_ in zip(names, g_got, g_ref):
        check(f"grad {name}", a, b_)
    return ref, got, g_ref


@pytest.mark.parametrize("n", [1, 5, 17, 33, 70])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_kernels_match_reference_float64(causal, n):
    """Every bias, all three aux losses, Separation's tau differing from Cohesion's (two kernels)."""
    ref, _, g_ref = compare(base_hp(causal=causal, **AUX), n, with_aux=True)
    if n > 1:  # the comparison is not vacuous: every gradient the test checks is nonzero
        assert all(g.abs().max() > 0 for g in g_ref[:8])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_kernels_without_separation_float64(causal):
    """Before separation_start_step: no Separation tile, Cohesion's kernel alone."""
    compare(base_hp(causal=causal), 33, use_sep=False)


@pytest.mark.parametrize(
    "changes, n",
    [
        (dict(causal=True, window=4, num_global=2, other_bias="alibi"), 37),
        (dict(causal=False, window=3, num_global=1, other_bias="alibi", gate_placement="post_norm"), 20),
        (dict(causal=True, tau_sep=1.0, std_form="sample", kernel_tau_form="tau2"), 21),  # one kernel
        (dict(causal=True, neighbour_source="base_scores", chunk_size=16), 35),
        (dict(causal=True, tau_sep=1.0, tau_coh=0.01), 21),  # kernel widths 100x apart: a floor each
        (dict(causal=True, tau_sep=0.01, tau_coh=1.0), 21),
        (dict(causal=True, use_align=False, use_coh=False, **AUX), 19),  # Separation only
        (dict(causal=False, use_sep=False, use_coh=False), 19),  # Alignment only
        (dict(causal=True, use_sep=False, use_align=False, **AUX), 19),  # Cohesion only
    ],
    ids=["causal_window_alibi", "bidir_window_alibi_post", "one_kernel_sample_tau2", "base_scores",
         "kernel_ratio_100", "kernel_ratio_0.01", "only_sep", "only_align", "only_coh"],
)  # fmt: skip
def test_kernels_options_float64(changes, n):
    hp = base_hp(**changes)
    compare(hp, n, use_sep=hp.use_sep, with_aux=hp.aux_compactness_weight > 0, b=2)


def test_float32_kernels_are_not_thrown_off_by_a_common_offset_in_z():
    """Distances come from dot products: z is centred first (fast_tiles.centred_z), else an offset
    shared by every z cancels them away in float32 (error 1.9 before)."""
    compare(base_hp(causal=True, tau_coh=0.5, **AUX), 33, dtype=F32, with_aux=True, tol=1e-4, rel=True,
            z_offset=30.0)


def test_row_chunks_cpu_take_the_fast_paths_cuda_as_few_as_the_cap_allows():
    """The torch work around the kernels: CPU tensors chunk like the fast path (tests run several
    chunks); on a GPU one chunk while the widest tile fits CUDA_ROW_TILE_ELEMS, else halved until
    it does; either way the chunks tile [0, n) in order."""
    from ascender_dist.models.ascender.fast_neighbours import chunk_bounds
    from ascender_dist.models.ascender.fast_tiles import Call
    from ascender_dist.models.ascender.kernels import function

    def covers(chunks, n):
        return chunks[0][0] == 0 and chunks[-1][1] == n and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))

    hp = base_hp(causal=True, chunk_size=16)
    call = Call(hp, 2048, 64, True, False, False)
    assert function.row_chunks(2048, 8, call, on_cuda=False) == chunk_bounds(2048, 8, hp)
    assert function.row_chunks(2048, 8, call, on_cuda=True) == [(0, 2048)]
    for n, bh in [(4096, 8), (1024, 96), (16384, 16), (333, 4096)]:
        call_n = Call(hp, n, 64, True, False, False)
        chunks = function.row_chunks(n, bh, call_n, on_cuda=True)
        rows = chunks[0][1]
        assert covers(chunks, n)
        assert bh * rows * function._row_tile_width(rows, n, call_n) <= function.CUDA_ROW_TILE_ELEMS or rows <= 16
        assert len(chunks) == 1 or bh * (2 * rows) * function._row_tile_width(2 * rows, n, call_n) > \
            function.CUDA_ROW_TILE_ELEMS  # not smaller than needed
    stats = Call(hp, 4096, 64, True, False, True)  # diagnostics build [rows, n] tiles
    assert function._row_tile_width(128, 4096, stats) == 4096


def test_kernels_with_several_causal_moment_states_float64(monkeypatch):
    """Row scales of Alignment / Cohesion from causal moment states every MOMENT_STRIDE rows
    (shrunk from 256 to 8 so that a short sequence has several)."""
    from ascender_dist.models.ascender import fast_moments

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", 8)
    compare(base_hp(causal=True, chunk_size=4, **AUX), 37, with_aux=True)


# (CUDA_ROW_TILE_ELEMS, the chunks row_chunks(on_cuda=True) must then give for n = 37, b * heads = 2,
# window 4 + 2 globals, stride 8): the real cap keeps one chunk over all five moment states; a cap of
# 400 halves it to 10 rows, so chunks start mid-stride (10, 20: states 1 and 2) and cross boundaries
GPU_CHUNKINGS = [(None, [(0, 37)]), (400, [(0, 10), (10, 20), (20, 30), (30, 37)])]


@pytest.mark.parametrize("cap, want", GPU_CHUNKINGS, ids=["one_chunk", "10_row_chunks"])
def test_kernels_with_the_gpu_row_chunks_across_moment_states_float64(monkeypatch, cap, want):
    """CPU stand-in for the GPU's row chunking (row_chunks(on_cuda=True): chunks as long as
    CUDA_ROW_TILE_ELEMS allows, each spanning several causal moment states where CPU tensors get
    the fast path's chunks within one): forced here under the interpreter with the moment stride
    shrunk to 8, against the float64 reference at 1e-9 like the tests above (out, every gradient,
    row statistics, aux losses)."""
    from ascender_dist.models.ascender import fast_moments
    from ascender_dist.models.ascender.kernels import function

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", 8)
    monkeypatch.setattr(function, "MOMENT_STRIDE", 8)  # the chunk width estimate reads its own copy
    if cap is not None:
        monkeypatch.setattr(function, "CUDA_ROW_TILE_ELEMS", cap)
    gpu_chunks, seen = function.row_chunks, []

    def as_on_cuda(n, batch_heads, call, on_cuda):
        seen.append(gpu_chunks(n, batch_heads, call, on_cuda=True))
        return seen[-1]

    monkeypatch.setattr(function, "row_chunks", as_on_cuda)
    compare(base_hp(causal=True, window=4, num_global=2, **AUX), 37, with_aux=True)
    assert seen and all(chunks == want for chunks in seen), seen  # the GPU chunking did run
    assert any(c0 // 8 != (c1 - 1) // 8 for c0, c1 in want)  # a chunk spans a state boundary


def test_kernels_shared_omega_float64():
    """share_omega_across_heads: params.omega is an expanded view; every head's gradient sums
    into the one shared parameter."""
    from ascender_dist.models.ascender import AscenderHeadParams

    hp = base_hp(causal=True, share_omega_across_heads=True)
    params = AscenderHeadParams(hp, 2).double().to(DEVICE)
    with torch.no_grad():
        params.omega_shared.copy_(torch.tensor([[0.7, 0.4, 1.3]], dtype=F64))
    inputs = [x.detach().to(DEVICE).requires_grad_() for x in make_inputs(b=1, n=21, hd=16)]
    grads = []
    for path in (reference_attention, triton_attention):
        out = path(*inputs, params, hp, use_sep=True).out
        grads.append(torch.autograd.grad((out * out).sum(), [params.omega_shared, inputs[3]]))
    for a, b_ in zip(*grads):
        assert b_.abs().max() > 0
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("hd", [16, 32, 64, 96, 128])
def test_kernels_other_head_dims_float64(hd):
    """64: the presets' head dim (small, medium); 96 is not a power of two: the kernels pad it to 128
    and mask the extra columns."""
    compare(base_hp(causal=True, d_z=6, d_a=9, **AUX), 17, with_aux=True, hd=hd)


# (head dim, rows per block forward / row backward / key-block backward on a GPU): every padded
# width <= 64 (head dim 16 with L_coh's value columns: 21 -> 32), and above (head dim 64: 97 -> 128)
GPU_BLOCKS = [(16, (64, 32, 32)), (64, (32, 32, 16))]


def force_gpu_block_sizes(monkeypatch) -> set:
    """Make every launch use the rows a GPU uses for fp32 / bf16 inputs (launch.block_size compiled:
    64, 32 or 16 rows by kernel and width; not fp64's halves) instead of the interpreter's 16.
    Returns the set that collects (kernel, rows) of every launch."""
    from ascender_dist.models.ascender.kernels import launch

    gpu_rows, seen = launch.block_size, set()

    def as_on_gpu(width, interpreted, kernel="forward", f64=False):
        seen.add((kernel, gpu_rows(width, False, kernel, False)))
        return gpu_rows(width, False, kernel, False)

    monkeypatch.setattr(launch, "block_size", as_on_gpu)
    return seen


@pytest.mark.parametrize("hd, rows", GPU_BLOCKS, ids=["hd16_rows_64_32_32", "hd64_rows_32_32_16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_kernels_with_the_gpu_block_sizes_float64(monkeypatch, causal, hd, rows):
    """The interpreter runs 16-row blocks; the GPU's (launch.block_size for fp32 / bf16 inputs: 64,
    32 and 16 rows) are forced here, n = 70 off every block multiple (a partial last block; causal
    blocks ending mid-way through a key block), ALiBi and every aux loss, against the float64
    reference at 1e-9 like the tests above."""
    seen = force_gpu_block_sizes(monkeypatch)
    compare(base_hp(causal=causal, other_bias="alibi", **AUX), 70, with_aux=True, hd=hd)
    assert seen == set(zip(("forward", "row", "col"), rows)), seen


# (t, moment stride, neighbour source): t = 20 in the middle of a 16-row block; at stride 8 (states at
# 8, 16, 24, 32) t = 24 is on a state boundary, still mid-block, where a state holding a key after its
# boundary would be read by row t while that key is in t's future
LEAK_CASES = [(20, 256, "affinity"), (24, 8, "affinity"), (24, 8, "base_scores")]
LEAK_IDS = ["t20", "t24_stride8", "t24_stride8_base_scores"]


def _leak_setup(monkeypatch, stride, source, dtype):
    from ascender_dist.models.ascender import fast_moments

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", stride)
    hp = base_hp(causal=True, window=4, num_global=2, other_bias="alibi", neighbour_source=source, **AUX)
    inputs = [x.detach().to(DEVICE) for x in make_inputs(b=1, n=40, hd=16, dtype=dtype)]
    return hp, inputs, make_params(hp, 2, dtype=dtype).to(DEVICE)


# the blocks the kernels run in: the interpreter's 16 rows, or a GPU's (hd 16: forward 64 rows, both
# backward kernels 32), so that t (20 or 24 of n = 40) is inside the first block of every kernel and
# the key blocks of the key-block backward end at 32, after t
BLOCKS = ["interpreter_blocks", "gpu_blocks"]
GPU_LEAK_ROWS = {("forward", 64), ("row", 32), ("col", 32)}


def _blocks(monkeypatch, blocks: str) -> set | None:
    return force_gpu_block_sizes(monkeypatch) if blocks == "gpu_blocks" else None


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("t, stride, source", LEAK_CASES, ids=LEAK_IDS)
def test_kernels_do_not_leak_future_tokens(monkeypatch, t, stride, source, blocks):
    """Changing every input after position t leaves rows <= t unchanged to the last bit (t in
    the middle of a block, so masking inside a block is what is checked; at stride 8 also
    on a moment-state boundary; both neighbour sources; the interpreter's block sizes and a GPU's)."""
    seen = _blocks(monkeypatch, blocks)
    hp, inputs, params = _leak_setup(monkeypatch, stride, source, F32)
    changed = [x.clone() for x in inputs]
    g = torch.Generator().manual_seed(3)
    for x in changed:
        x[..., t + 1 :, :] = 5 * torch.randn(x[..., t + 1 :, :].shape, generator=g).to(x.device)
    a = triton_attention(*inputs, params, hp, use_sep=True, with_aux=True)
    b = triton_attention(*changed, params, hp, use_sep=True, with_aux=True)
    assert torch.equal(a.out[..., : t + 1, :], b.out[..., : t + 1, :])
    assert not torch.equal(a.out[..., t + 1 :, :], b.out[..., t + 1 :, :])
    for name, ra in a.rows.items():
        assert torch.equal(ra[:, :, : t + 1], b.rows[name][:, :, : t + 1]), name
    assert seen is None or seen == {("forward", 64)}, seen  # no backward ran


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("t, stride, source", LEAK_CASES, ids=LEAK_IDS)
def test_kernels_do_not_leak_future_tokens_in_gradients(monkeypatch, t, stride, source, blocks):
    """The kernels' backward (K3-K5, written by hand) is causal too: for a loss on the outputs and
    row statistics at <= t, q, k, v, z and h after t get exactly zero gradient, and the gradients
    at <= t and of every per-head parameter are bit-for-bit unchanged when everything after t is
    rewritten (float64; the interpreter's block sizes and a GPU's fp32 ones)."""
    seen = _blocks(monkeypatch, blocks)
    hp, inputs, params = _leak_setup(monkeypatch, stride, source, F64)
    named = list(params.named_parameters())
    assert_gradients_causal(outputs_of(triton_attention, params, hp), inputs, t, dim=2,
                            names=["q", "k", "v", "z", "h"], params=[p for _, p in named],
                            param_names=[name for name, _ in named])  # fmt: skip
    assert seen is None or seen == GPU_LEAK_ROWS, seen


@pytest.mark.parametrize("n, causal", [(33, True), (17, False)])
def test_kernels_float32_within_1e5_of_float64_reference(n, causal):
    """fp32 kernels (fp32 accumulation) against the fp64 reference, row 0's single key included."""
    compare(base_hp(causal=causal, **AUX), n, dtype=F32, with_aux=True, tol=1e-5, rel=True)


def test_kernels_bfloat16_inputs_run_in_fp32_and_return_bf16():
    hp = base_hp(causal=True)
    inputs = [x.detach().to(DEVICE, torch.bfloat16).requires_grad_() for x in make_inputs(b=1, n=21, hd=16)]
    params64 = make_params(hp, 2)
    got = triton_attention(*inputs, copy.deepcopy(params64).to(DEVICE, F32), hp, use_sep=True)
    ref = reference_attention(*[x.detach().double().cpu() for x in inputs], params64, hp, use_sep=True)
    assert got.out.dtype == torch.bfloat16
    err = (got.out.double().cpu() - ref.out).abs().max().item()
    assert err < 1e-2 * max(1.0, ref.out.abs().max().item()), err  # bf16 rounding of the output
    function_node = got.out.grad_fn.next_functions[0][0]  # out = outs[0].to(bf16): its input is the Function's
    assert [x.dtype for x in function_node.saved_tensors[:5]] == [torch.bfloat16] * 5  # q..h kept as given
    got.out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() for x in inputs)


def test_kernels_report_mass_moved_stats_like_the_reference():
    hp = base_hp(causal=True, other_bias="alibi")
    inputs = [x.detach().to(DEVICE) for x in make_inputs(b=1, n=23, hd=16)]
    params = make_params(hp, 2).to(DEVICE)
    got = triton_attention(*inputs, params, hp, use_sep=True, with_stats=True)
    ref = reference_attention(*[x.cpu() for x in inputs], make_params(hp, 2), hp, use_sep=True)
    assert set(got.stats) == set(ref.stats)
    for key, val in ref.stats.items():
        torch.testing.assert_close(got.stats[key].cpu(), val, rtol=1e-9, atol=1e-9, msg=key)


# ---------------------------------------------------------------- impl resolution (entry point)
def test_auto_resolves_to_fast_on_cpu_tensors():
    hp = base_hp()
    assert entry._pick_impl("auto", make_inputs(b=1, n=3, hd=16)[0].detach(), hp) == "fast"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check runs it)")
def test_auto_resolves_to_triton_on_cuda_and_matches_reference():
    hp = base_hp(causal=True)
    inputs = [x.detach().cuda().requires_grad_() for x in make_inputs(b=1, n=70, hd=64)]
    assert entry._pick_impl("auto", inputs[0], hp) == "triton"
    params = make_params(hp, 2).cuda()
    out = ascender_attention(*inputs, params, hp, step=0, impl="auto")
    ref = ascender_attention(*inputs, params, hp, step=0, impl="reference")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check runs it)")
def test_triton_fwd_bwd_never_syncs_with_the_host_and_replays_in_a_cuda_graph():
    """One fwd+bwd issues no host synchronisation (a copy from pageable host memory in the
    operand setup once made every call sync and uncapturable), so it captures in a CUDA graph,
    and the replay gives the eager gradients (float64; the kernels have no atomics, but the torch
    row algebra's backward scatters with index_add_, whose CUDA atomics may reorder sums at
    rounding level)."""
    hp = base_hp(causal=True)
    inputs = [x.detach().cuda().requires_grad_() for x in make_inputs(b=1, n=70, hd=64)]
    params = make_params(hp, 2).cuda()

    def step():
        ascender_attention(*inputs, params, hp, step=0, impl="triton").sum().backward()

    step()  # compiles the kernels and allocates every .grad
    leaves = [t for t in (*inputs, *params.parameters()) if t.grad is not None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in leaves:
        t.grad.zero_()
    step()
    eager = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for t, want in zip(leaves, eager):
        torch.testing.assert_close(t.grad, want, rtol=1e-9, atol=1e-12)


def test_impl_triton_runs_on_cpu_tensors_under_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    hp = base_hp(causal=True)
    inputs = make_inputs(b=1, n=19, hd=16)
    params = make_params(hp, 2)
    assert entry._pick_impl("triton", inputs[0], hp) == "triton"
    out = ascender_attention(*inputs, params, hp, step=0, impl="triton")
    ref = ascender_attention(*inputs, params, hp, step=0, impl="reference")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_unsupported_head_dim_falls_back_to_fast_with_one_log_line(caplog):
    hp = base_hp(causal=True)
    q = make_inputs(b=1, n=3, hd=8)[0].detach()  # head dim 8: not covered by the kernels
    ok, why = triton_supported(q, hp)
    assert not ok and "head dim 8" in why
    entry._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="ascender_dist"):
        assert entry._pick_impl("triton", q, hp) == "fast"
        assert entry._pick_impl("triton", q, hp) == "fast"
    lines = [r.getMessage() for r in caplog.records if "head dim 8" in r.getMessage()]
    assert len(lines) == 1, lines


def test_print_config_line_names_the_path_per_device():
    hp = AscenderHParams()
    assert entry.attention_paths(64, hp) == (
        "ascender attention (impl auto): CUDA -> triton on GPUs allowing >= 160 KiB of shared memory per block, "
        "else fast, CPU -> fast")
    assert entry.attention_paths(24, hp).startswith("ascender attention (impl auto): CUDA -> fast (head dim 24")
    # a covered head dim with operand widths that have no measured shared-memory need: auto runs fast there
    wide = AscenderHParams(d_z=64, d_a=64)
    line = entry.attention_paths(128, wide)
    assert "CUDA -> fast (head dim 128, d_z 64, d_a 64: no measured shared-memory need" in line, line
    assert entry.attention_paths(128, wide, impl="fast").endswith("CUDA -> fast, CPU -> fast")


def test_print_config_line_without_triton_says_fast_everywhere(monkeypatch):
    """_pick_impl falls back to fast when triton is not importable, even under TRITON_INTERPRET=1."""
    from ascender_dist.models.ascender.kernels import support

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hp = AscenderHParams()
    assert entry.attention_paths(64, hp, impl="triton").endswith("CPU -> triton (interpreter)")
    monkeypatch.setattr(support, "triton_importable", lambda: False)
    assert entry.attention_paths(64, hp, impl="triton") == (
        "ascender attention (impl triton): CUDA -> fast (triton is not installed), CPU -> fast")
    assert entry._pick_impl("triton", make_inputs(b=1, n=3, hd=64)[0].detach(), hp) == "fast"


def _check_bf16_cluster_densities(device):
    """Clusters far apart (|z|^2 ~ 300) with members 0.1 apart under a kernel as narrow, bf16 inputs:
    the kernels' densities and centroids within 1% of the float64 reference on the same bf16-rounded
    inputs (measured 0.08% / 0.04% in the interpreter), and z's gradient (of out . w) within 5e-3 of
    its largest reference entry (1.7e-3 in the TF32 emulation; 1.5e-3 with every product exact; 9.7e-3
    when the backward's distance-gradient products were TF32)."""
    hp = base_hp(causal=True, d_z=32, d_a=8, tau_sep=0.1, tau_coh=0.1)
    g = torch.Generator().manual_seed(3)
    q, k, v, _, h = make_inputs(b=1, n=40, hd=16, dz=32, da=8)
    centres = 3.0 * torch.randn(4, 32, generator=g, dtype=F64)
    z = centres[torch.arange(40) % 4] + 0.1 * torch.randn(40, 32, generator=g, dtype=F64)
    inputs = [x.detach().to(device, torch.bfloat16).requires_grad_() for x in (q, k, v, z.expand(1, 2, 40, 32), h)]
    inputs64 = [x.detach().double().cpu().requires_grad_() for x in inputs]
    params64 = make_params(hp, 2)
    got = triton_attention(*inputs, copy.deepcopy(params64).to(device, F32), hp, use_sep=True)
    ref = reference_attention(*inputs64, params64, hp, use_sep=True)
    for key in ("rho", "centroid"):
        err = (got.rows[key].double().cpu() - ref.rows[key]).abs() / (ref.rows[key].abs() + 1e-3)
        assert err.max().item() < 1e-2, (key, err.max().item())
    w = torch.randn(ref.out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    gz = torch.autograd.grad((got.out.double() * w.to(device)).sum(), inputs[3])[0].double().cpu()
    gz_ref = torch.autograd.grad((ref.out * w).sum(), inputs64[3])[0]
    err = ((gz - gz_ref).abs().max() / gz_ref.abs().max()).item()
    assert err < 5e-3, ("grad z", err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter has no TF32 products")
def test_kernels_bfloat16_inputs_keep_the_densities_of_near_pairs_in_tight_clusters():
    """The distance GEMM forms -|z_i - z_j|^2 from terms as large as |z|^2: with TF32 products (the
    default of tl.dot for the low-precision path on a GPU, 10-bit mantissas) near pairs' kernel
    weights were off by several %, so it runs in IEEE fp32 whatever the inputs' precision; TF32's
    would be ~10^4 x further off than the 1% allowed. Likewise the backward's products with Zr
    (z's gradient). The interpreter multiplies exactly, so this
    discriminates on a GPU only (benchmarks/gpu_check);
    test_kernels_distance_products_are_ieee_when_the_others_are_tf32 is its CPU stand-in."""
    _check_bf16_cluster_densities("cuda")


def _mm_with_tf32_products(a, b, IEEE):
    """kernels.tiles.mm, except that without IEEE the fp32 operands are cut to TF32's 10-bit
    mantissa first (what tl.dot's default precision does on a GPU; the interpreter multiplies exactly)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    tf32 = lambda x: (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # noqa: E731  ~0x1fff
    return tl.dot(tf32(a), tf32(b), input_precision="ieee")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in: on CUDA the test above runs real TF32")
def test_kernels_distance_products_are_ieee_when_the_others_are_tf32(monkeypatch):
    """CPU stand-in for the test above: every product the kernels leave to tl.dot's default
    precision (mm(.., IEEE=False), taken for bf16 inputs) runs with TF32-rounded operands, as on a
    GPU; the distance (and Cohesion moment) GEMMs, which must be IEEE, then still keep the densities
    and centroids within 1%, and the backward's distance-gradient products (dx @ Zr, gmom . Zr_j), IEEE
    too, z's gradient within 5e-3. The emulation is checked to bite: the whole call with TF32
    everywhere misses that 1% by far."""
    from ascender_dist.models.ascender.kernels import backward, forward, tiles

    if not tiles.interpreting():
        pytest.skip("the emulation patches the interpreter's plain device functions")
    for module in (tiles, forward, backward):
        monkeypatch.setattr(module, "mm", _mm_with_tf32_products)
    _check_bf16_cluster_densities("cpu")
    everywhere = lambda a, b, IEEE: _mm_with_tf32_products(a, b, False)  # noqa: E731
    for module in (tiles, forward, backward):
        monkeypatch.setattr(module, "mm", everywhere)
    with pytest.raises(AssertionError, match="rho|centroid"):
        _check_bf16_cluster_densities("cpu")


H100_OPTIN, A100_OPTIN = 232448, 166912  # shared bytes a block may use (227 / 163 KiB, opt-in maxima)


def test_devices_without_the_kernels_shared_memory_are_not_covered():
    """An sm_89 card (~99 KiB per block) would fail with OutOfResources at the first launch; it is
    not covered (auto takes the fast path, with the reason in the log). H100 and A100 limits pass at
    every head dim with the default widths (the 160 KiB that ahead-of-time compiles measure:
    test_triton_compile); a device just below that does not."""
    from ascender_dist.models.ascender.kernels.support import shared_memory_shortfall

    assert shared_memory_shortfall("NVIDIA H100", H100_OPTIN, 128) == ""
    assert shared_memory_shortfall("NVIDIA A100", A100_OPTIN, 64) == ""
    assert shared_memory_shortfall("NVIDIA A100", A100_OPTIN, 128, AscenderHParams(aux_compactness_weight=0.1)) == ""
    assert shared_memory_shortfall("a smaller one", 159 * 1024, 128) == (
        "a smaller one allows 159 KiB of shared memory per block, the kernels need 160 KiB at head dim 128, "
        "d_z 32, d_a 32")
    assert "NVIDIA L40S allows 99 KiB" in shared_memory_shortfall("NVIDIA L40S", 99 * 1024, 32)
    assert shared_memory_shortfall("unknown", None, 64) == ""  # torch without the property: as before


def _on_a_cuda_device(monkeypatch, name, optin):
    """triton_supported sees a CUDA tensor on a device called ``name`` with ``optin`` shared bytes
    per block (no GPU needed: q is a stand-in with what triton_supported reads of it)."""
    from types import SimpleNamespace

    from ascender_dist.models.ascender.kernels import support

    props = SimpleNamespace(name=name, shared_memory_per_block_optin=optin)
    monkeypatch.setattr(support.torch.cuda, "get_device_properties", lambda device: props)
    return lambda hd, dtype=torch.bfloat16: SimpleNamespace(shape=(1, 2, 8, hd), is_cuda=True, dtype=dtype,
                                                            device=torch.device("cuda", 0))  # fmt: skip


@pytest.mark.parametrize("name, optin", [("NVIDIA H100", H100_OPTIN), ("NVIDIA A100", A100_OPTIN)])
def test_cuda_support_depends_on_the_geometry_widths_not_only_the_head_dim(monkeypatch, name, optin):
    """The kernels' shared memory grows with d_z and d_a (Zr, Hr: d + 2 columns, padded to a power of
    two) and the L_coh value columns, not with the head dim alone: head dim 128 with d_z = d_a = 128
    measured 240 KiB (320 with L_coh), over H100's 227, and was still chosen by auto (OutOfResources
    at the first launch); 64 / 64 needs 192 KiB (over A100's 163). Only widths with a measured need
    (support.SHARED_BYTES_NEEDED: d_z, d_a <= 62) are covered; the presets' are, with L_coh or
    without: debug (head dim 16, 8 / 8), small and medium (64, 32 / 32), large (96, 48 / 48), and the
    default widths at head dim 128."""
    q_on_cuda = _on_a_cuda_device(monkeypatch, name, optin)
    for hd, d in [(16, 8), (64, 32), (96, 48), (128, 32)]:
        for aux in (0.0, 0.5):
            hp = AscenderHParams(d_z=d, d_a=d, aux_compactness_weight=aux)
            assert triton_supported(q_on_cuda(hd), hp) == (True, ""), (hd, d, aux)
    assert triton_supported(q_on_cuda(64)) == (True, "")  # no hparams: the defaults (32 / 32)
    for d_z, d_a in [(128, 128), (64, 64), (64, 32), (32, 63)]:
        ok, why = triton_supported(q_on_cuda(128), AscenderHParams(d_z=d_z, d_a=d_a, aux_compactness_weight=0.5))
        assert not ok and why == (f"head dim 128, d_z {d_z}, d_a {d_a} with the L_coh value columns: no measured "
                                  f"shared-memory need of the Triton kernels at these widths (covered: d_z, d_a <= 62)")
    assert triton_supported(q_on_cuda(128), AscenderHParams(d_z=62, d_a=62, use_sep=False, use_coh=False)) == (True, "")
    # fp64 (tests) halves the rows, not the bytes: the key-block backward above 64 columns needs 272 KiB
    assert triton_supported(q_on_cuda(64, F64), base_hp()) == (True, "")  # test_auto_resolves_to_triton_on_cuda
    assert triton_supported(q_on_cuda(128, F64)) == (False, f"{name} allows {optin // 1024} KiB of shared memory "
                                                           "per block, the kernels need 272 KiB at head dim 128, "
                                                           "d_z 32, d_a 32 in float64")


def test_support_refuses_more_batch_x_heads_than_a_cuda_grid_axis_holds(monkeypatch):
    """The launch grid is (row blocks, b * np): CUDA allows 65535 on the second axis and Triton does not
    check, so a larger batch (inference, evaluation) failed at launch instead of taking the fast path."""
    q_on_cuda = _on_a_cuda_device(monkeypatch, "NVIDIA H100", H100_OPTIN)
    q = q_on_cuda(64)
    assert triton_supported(type(q)(**{**vars(q), "shape": (4095, 16, 8, 64)})) == (True, "")
    assert triton_supported(type(q)(**{**vars(q), "shape": (4096, 16, 8, 64)})) == (
        False, "batch x local heads = 65536 is above CUDA's 65535 blocks on a grid's second axis")


def test_cuda_support_refuses_a_device_with_less_shared_memory_than_the_presets_need(monkeypatch):
    q_on_cuda = _on_a_cuda_device(monkeypatch, "NVIDIA L40S", 101376)  # 99 KiB
    hp = base_hp(d_z=32, d_a=32)
    assert triton_supported(q_on_cuda(64), hp) == (False, "NVIDIA L40S allows 99 KiB of shared memory per block, "
                                                          "the kernels need 160 KiB at head dim 64, d_z 32, d_a 32")


def test_kernels_under_autocast_compute_what_they_compute_without_it():
    """HF inference runs under torch.autocast: the torch-side row algebra and neighbour search ran in
    bf16 there (the kernels' fp32 contract held only outside autocast)."""
    hp = base_hp(causal=True)
    inputs = [x.detach().to(DEVICE, torch.bfloat16) for x in make_inputs(b=1, n=21, hd=16)]
    params = make_params(hp, 2).to(DEVICE, F32)
    plain = triton_attention(*inputs, params, hp, use_sep=True)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        cast = triton_attention(*inputs, params, hp, use_sep=True)
    assert torch.equal(cast.out, plain.out)
    for key, val in plain.rows.items():
        assert torch.equal(cast.rows[key], val), key
