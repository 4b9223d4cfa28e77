"""The chunked fast path against the dense reference: forward, every gradient, statistics and
aux losses; plain attention at omega = 0; no future leak; no n x n tensor; the entry point."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ascender_dist.models.ascender import (
    AscenderHeadParams,
    AscenderHParams,
    ascender_attention,
    fast_attention,
    reference_attention,
)
from ascender_dist.models.ascender.fast_moments import MOMENT_STRIDE
from tests.helpers.causality import assert_gradients_causal

torch.set_num_threads(1)
F64, F32 = torch.float64, torch.float32


def make_inputs(b=2, nh=2, n=37, hd=8, dz=4, da=5, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, nh, n, d, generator=g, dtype=dtype).requires_grad_() for d in (hd, hd, hd, dz, da)]


def make_params(hp, nh, dtype=F64, seed=1):
    p = AscenderHeadParams(hp, nh).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        p.omega.copy_(0.3 + torch.rand(nh, 3, generator=g, dtype=dtype))
        p.lambdas.copy_(0.5 + torch.rand(nh, 3, generator=g, dtype=dtype))
        p.delta.copy_(0.1 * torch.rand(nh, generator=g, dtype=dtype))
        p.kappa.copy_(1.0 + torch.rand(nh, generator=g, dtype=dtype))
        p.tau_score.copy_(0.7 + 0.6 * torch.rand(nh, generator=g, dtype=dtype))
    return p


def base_hp(**changes):
    hp = AscenderHParams(d_z=4, d_a=5, k=3, window=0, num_global=0, chunk_size=8, tau_sep=2.0)
    return dataclasses.replace(hp, **changes)


def grads_of(result, inputs, params, with_aux):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(result.out.shape, generator=g, dtype=result.out.dtype)
    loss = (result.out * w).sum() + (result.aux["total"] if with_aux else 0)
    tensors = list(inputs) + list(params.parameters())
    return torch.autograd.grad(loss, tensors, allow_unused=True, materialize_grads=True)


CASES = {
    "causal_full_n37": dict(hp=dict(causal=True), n=37),
    "bidir_full_n37": dict(hp=dict(causal=False), n=37),
    "causal_window_n37": dict(hp=dict(causal=True, window=4, num_global=2), n=37),
    "bidir_window_n20": dict(hp=dict(causal=False, window=3, num_global=1), n=20),
    "causal_n1": dict(hp=dict(causal=True), n=1),
    "causal_n5_k_gt_n": dict(hp=dict(causal=True, k=8), n=5),
    "causal_n64_chunk16": dict(hp=dict(causal=True, chunk_size=16), n=64),
    "sample_tau2_post_alibi": dict(
        hp=dict(causal=True, std_form="sample", kernel_tau_form="tau2", gate_placement="post_norm",
                other_bias="alibi"), n=29),  # fmt: skip
    "bidir_alibi_post": dict(hp=dict(causal=False, gate_placement="post_norm", other_bias="alibi"), n=19),
    "aux_causal": dict(
        hp=dict(causal=True, aux_compactness_weight=0.3, aux_crowding_weight=0.5, aux_alignment_weight=0.2),
        n=30, aux=True),  # fmt: skip
    "aux_bidir_window": dict(
        hp=dict(causal=False, window=4, num_global=1, aux_compactness_weight=0.3, aux_crowding_weight=0.5,
                aux_alignment_weight=0.2), n=22, aux=True),  # fmt: skip
    "only_sep": dict(hp=dict(use_align=False, use_coh=False), n=21),
    "causal_base_scores": dict(hp=dict(causal=True, neighbour_source="base_scores"), n=37),
    "bidir_window_base_scores": dict(hp=dict(causal=False, window=4, num_global=1, neighbour_source="base_scores"),
                                     n=22),  # fmt: skip
    "only_align": dict(hp=dict(use_sep=False, use_coh=False), n=21),
    "only_coh": dict(hp=dict(use_sep=False, use_align=False), n=21),
    # kernel widths 100x apart either way: each kernel's exponent has its own floor (one floor on the
    # shared exponent floored the other kernel at tiny^(1/100) = 0.42 in float32, or tiny^(1/100) of it)
    "kernel_ratio_100": dict(hp=dict(causal=True, tau_sep=1.0, tau_coh=0.01), n=37),
    "kernel_ratio_0.01": dict(hp=dict(causal=True, tau_sep=0.01, tau_coh=1.0), n=37),
}


def compare(case, dtype, rtol, atol):
    spec = CASES[case]
    hp = base_hp(**spec["hp"])
    with_aux = spec.get("aux", False)
    inputs = make_inputs(n=spec["n"], dtype=dtype)
    params = make_params(hp, 2, dtype=dtype)
    ref = reference_attention(*inputs, params, hp, use_sep=hp.use_sep, with_aux=with_aux)
    fast = fast_attention(*inputs, params, hp, use_sep=hp.use_sep, with_aux=with_aux, with_stats=True)
    torch.testing.assert_close(fast.out, ref.out, rtol=rtol, atol=atol)
    for name, gr, gf in zip(
        ["q", "k", "v", "z", "h"] + [n for n, _ in params.named_parameters()],
        grads_of(ref, inputs, params, with_aux),
        grads_of(fast, inputs, params, with_aux),
    ):
        torch.testing.assert_close(gf, gr, rtol=rtol, atol=atol, msg=lambda m: f"grad {name}: {m}")
    for name in ("u", "gate_align", "rho", "eta", "centroid", "gate_coh", "neighbour_idx", "neighbour_valid"):
        if name in ref.rows:
            torch.testing.assert_close(fast.rows[name], ref.rows[name], rtol=rtol, atol=atol, msg=name)
    assert set(fast.stats) == set(ref.stats)
    for name in ref.stats:
        torch.testing.assert_close(fast.stats[name], ref.stats[name], rtol=rtol, atol=atol, msg=name)
    assert set(fast.aux) == set(ref.aux)
    for name in ref.aux:
        torch.testing.assert_close(fast.aux[name], ref.aux[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_fast_matches_reference_float64(case):
    compare(case, F64, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", ["causal_full_n37", "bidir_full_n37", "causal_window_n37", "aux_causal"])
def test_fast_matches_reference_float32(case):
    compare(case, F32, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_float32_is_not_thrown_off_by_a_common_offset_in_z(causal):
    """ASCender reads z only through differences; the fused path forms distances from dot products,
    where an offset shared by every z would cancel the distances away in float32 (error 3.5 before
    z was centred): out, every gradient and the centroids stay within float32 rounding (the same
    error as without the offset, 5e-5 of the largest z gradient here)."""
    hp = base_hp(causal=causal, use_align=False, tau_coh=0.5, **dict(aux_compactness_weight=0.3))
    inputs64 = make_inputs(n=37, dtype=F64)
    with torch.no_grad():
        inputs64[3].mul_(0.05).add_(30.0)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    params64, params32 = make_params(hp, 2), make_params(hp, 2).float()
    ref = reference_attention(*inputs64, params64, hp, use_sep=True, with_aux=True)
    fast = fast_attention(*inputs32, params32, hp, use_sep=True, with_aux=True)

    def close(name, got, want):
        err = (got.detach().double() - want.detach()).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"{name}: {err:.3g}"  # z * 0.05: dz ~ 50

    close("out", fast.out, ref.out)
    close("centroid", fast.rows["centroid"], ref.rows["centroid"])
    close("compactness", fast.aux["compactness"], ref.aux["compactness"])
    w = torch.randn(ref.out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    g_ref = torch.autograd.grad((ref.out * w).sum() + ref.aux["total"], inputs64)
    g_fast = torch.autograd.grad((fast.out * w.float()).sum() + fast.aux["total"], inputs32)
    for name, got, want in zip(["q", "k", "v", "z", "h"], g_fast, g_ref):
        close(f"grad {name}", got, want)


@pytest.mark.parametrize("stride", [8, 16])
@pytest.mark.parametrize("case", ["causal_full_n37", "causal_window_n37", "aux_causal", "only_coh"])
def test_fast_matches_reference_with_several_moment_states(monkeypatch, case, stride):
    """Causal row moments read running states every MOMENT_STRIDE (256) rows, differentiated in
    closed form; the other cases are shorter than one stride, so shrink it: 2-5 states, chunk 8
    rows, with the state boundary at (stride 8) and before (stride 16) a chunk's first row."""
    from ascender_dist.models.ascender import fast_moments as fast_module

    monkeypatch.setattr(fast_module, "MOMENT_STRIDE", stride)
    compare(case, F64, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("path", [reference_attention, fast_attention], ids=["reference", "fast"])
def test_aux_total_is_the_literal_weighted_sum(path, causal):
    """aux["total"] = 0.3 L_coh + 0.5 L_sep + 0.2 L_align, written out here: both paths weight
    through one shared helper, so comparing their totals cannot see a swapped or dropped weight."""
    hp = base_hp(causal=causal, aux_compactness_weight=0.3, aux_crowding_weight=0.5, aux_alignment_weight=0.2)
    inputs = make_inputs(n=21)
    with torch.no_grad():
        aux = path(*inputs, make_params(hp, 2), hp, use_sep=True, with_aux=True).aux
    assert set(aux) == {"compactness", "crowding", "alignment", "total"}
    assert all(aux[name].item() > 1e-3 for name in ("compactness", "crowding", "alignment"))
    want = 0.3 * aux["compactness"] + 0.5 * aux["crowding"] + 0.2 * aux["alignment"]
    torch.testing.assert_close(aux["total"], want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_fast_zero_omega_is_sdpa(causal):
    hp = base_hp(causal=causal, omega_init=0.0, window=4, num_global=1)
    q, k, v, z, h = make_inputs(n=33, dtype=F32)
    out = fast_attention(q, k, v, z, h, AscenderHeadParams(hp, 2), hp, use_sep=True).out
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), rtol=1e-6, atol=1e-6)


# Causal moment states every MOMENT_STRIDE (256) rows are out of reach of these lengths: the leak
# tests also run at stride 8 (states at 8, 16, 24, 32), with t = 16 on a state boundary, where a
# state holding a key after its boundary is read by row t while that key is in t's future.
LEAK_POSITIONS = [5, 16, 21]
LEAK_STRIDES = [256, 8]


def leak_hp(source="affinity", **changes):
    """Causal with every mask path: a window, globals, ALiBi, all three aux losses."""
    return base_hp(causal=True, window=5, num_global=2, other_bias="alibi", neighbour_source=source,
                   aux_compactness_weight=0.3, aux_crowding_weight=0.5, aux_alignment_weight=0.2, **changes)


def set_moment_stride(monkeypatch, stride):
    from ascender_dist.models.ascender import fast_moments

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", stride)


@pytest.mark.parametrize("stride", LEAK_STRIDES)
@pytest.mark.parametrize("source", ["affinity", "base_scores"])
@pytest.mark.parametrize("t", LEAK_POSITIONS)
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_no_future_leak(monkeypatch, impl, t, source, stride):
    """Causal: changing every input after position t leaves outputs and statistics at <= t
    unchanged to the last bit (t sits inside a chunk, so chunk-level leaks show too; t = 16 on a
    moment-state boundary at stride 8), for both neighbour sources (the base scores rank q . k,
    the affinity h . h)."""
    set_moment_stride(monkeypatch, stride)
    hp = leak_hp(source)
    inputs = [x.detach() for x in make_inputs(b=1, n=40, dtype=F32)]
    params = make_params(hp, 2, dtype=F32)
    # t inside the first chunk (0..7), first (16) and inside (21) of a later one (16..23), chunk_size 8
    changed = [x.clone() for x in inputs]
    g = torch.Generator().manual_seed(3)
    for x in changed:
        x[..., t + 1 :, :] = 5 * torch.randn(x[..., t + 1 :, :].shape, generator=g)
    kw = dict(step=0, return_decomposition=True, impl=impl)
    out_a, info_a = ascender_attention(*inputs, params, hp, **kw)
    out_b, info_b = ascender_attention(*changed, params, hp, **kw)
    assert torch.equal(out_a[..., : t + 1, :], out_b[..., : t + 1, :])
    assert not torch.equal(out_a[..., t + 1 :, :], out_b[..., t + 1 :, :])
    for name, ra in info_a["rows"].items():
        assert torch.equal(ra[:, :, : t + 1], info_b["rows"][name][:, :, : t + 1]), name
    for name, ma in info_a.get("maps", {}).items():
        assert torch.equal(ma[..., : t + 1, : t + 1], info_b["maps"][name][..., : t + 1, : t + 1]), name


def outputs_of(path, params, hp):
    """(q, k, v, z, h) -> [out, every differentiable row statistic] of ``path``, aux on."""

    def forward(*inputs):
        result = path(*inputs, params, hp, use_sep=True, with_aux=True)
        return [result.out] + [r for r in result.rows.values() if r.is_floating_point()]

    return forward


GRAD_LEAK_CASES = [("reference", "affinity", 256)] + [
    ("fast", source, stride) for source in ("affinity", "base_scores") for stride in LEAK_STRIDES
]


@pytest.mark.parametrize("t", LEAK_POSITIONS)
@pytest.mark.parametrize("impl, source, stride", GRAD_LEAK_CASES, ids=["-".join(map(str, c)) for c in GRAD_LEAK_CASES])
def test_no_future_leak_in_gradients(monkeypatch, impl, source, stride, t):
    """The backward is causal too (the fast path's is written by hand, moment states' in closed
    form): for a loss on the outputs and row statistics at <= t, q, k, v, z and h after t get
    exactly zero gradient, and the gradients at <= t and of every per-head parameter are bit-for-bit
    unchanged when everything after t is rewritten (float64; both neighbour sources; stride 8:
    several moment states, t = 16 on a boundary)."""
    set_moment_stride(monkeypatch, stride)
    hp = leak_hp(source)
    params = make_params(hp, 2)
    path = fast_attention if impl == "fast" else reference_attention
    inputs = [x.detach() for x in make_inputs(b=1, n=40)]
    named = list(params.named_parameters())
    assert_gradients_causal(outputs_of(path, params, hp), inputs, t, dim=2, names=["q", "k", "v", "z", "h"],
                            params=[p for _, p in named], param_names=[name for name, _ in named])  # fmt: skip


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("causal,window", [(True, 0), (False, 6)])
def test_fast_path_never_builds_an_n_by_n_tensor(causal, window):
    n, nh, chunk = 256, 2, 16
    hp = base_hp(causal=causal, window=window, num_global=2 if window else 0, chunk_size=chunk, k=4)
    inputs = make_inputs(b=1, nh=nh, n=n, dtype=F32)
    params = make_params(hp, nh, dtype=F32)
    with _LargestTensor() as mode:
        out = fast_attention(*inputs, params, hp, use_sep=True).out
        out.square().sum().backward()
    widest_row = max(chunk, 8)  # a [chunk, n] tile, or a whole-sequence [n, hd] tensor
    assert mode.largest <= nh * n * widest_row, mode.largest
    assert mode.largest < nh * n * n / 8


class _TileStorages(TorchDispatchMode):
    """Records the storages of every [B, chunk, L >= min_keys] tile an op writes (forward and backward)."""

    def __init__(self, chunk: int, min_keys: int):
        super().__init__()
        self.chunk, self.min_keys, self.storages, self.tiles = chunk, min_keys, set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            is_tile = isinstance(o, torch.Tensor) and o.dim() == 3 and o.shape[1] == self.chunk
            if is_tile and o.shape[2] >= self.min_keys:
                self.storages.add(o.untyped_storage().data_ptr())
                self.tiles += 1
        return out


def test_fast_path_writes_every_chunk_tile_into_a_few_reused_buffers():
    """Fresh tiles per chunk cost page faults (docs/ascender.md, Cost): the tiles of all chunks
    share one buffer per role, two in forward and five in backward. Counted: tiles with more
    keys than a moment stride plus a chunk (the row moments' [C, keys since the last state]
    products are not chunk tiles), neighbours searched in a band (a full search scores
    [C, keys] tiles of its own, outside the fused path)."""
    n, nh, chunk = 2 * MOMENT_STRIDE, 2, 16
    # one kernel width (a second adds its own kernel and gradient tiles); a banded neighbour search
    hp = base_hp(causal=True, chunk_size=chunk, k=4, window=6, num_global=2, tau_sep=1.0, tau_coh=1.0)
    inputs = make_inputs(b=1, nh=nh, n=n, dtype=F32)
    params = make_params(hp, nh, dtype=F32)
    with _TileStorages(chunk, MOMENT_STRIDE + chunk + 1) as mode:
        out = fast_attention(*inputs, params, hp, use_sep=True).out
        out.square().sum().backward()
    assert mode.tiles >= 15 * 7  # the last 15 chunks each write several tiles ...
    assert len(mode.storages) <= 2 + 5 + 1, len(mode.storages)  # ... into 2 + 5 buffers (+ the rare clamp mask)


def test_entry_point_schedule_and_unused_parameters_get_zero_grad():
    hp = base_hp(causal=True, separation_start_step=100)
    inputs = make_inputs(n=20)
    params = make_params(hp, 2)
    out = ascender_attention(*inputs, params, hp, step=99, impl="fast")
    ref = reference_attention(*inputs, params, hp, use_sep=False).out
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert params.delta.grad is not None and torch.all(params.delta.grad == 0)
    assert params.kappa.grad is not None and torch.all(params.kappa.grad == 0)
    after = ascender_attention(*inputs, params, hp, step=100, impl="fast")
    torch.testing.assert_close(after, reference_attention(*inputs, params, hp, use_sep=True).out)


@pytest.mark.parametrize("share_omega", [False, True])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_every_parameter_gets_a_gradient_when_no_bias_is_active(impl, share_omega):
    """Alignment and Cohesion off and Separation not yet started: no bias reads omega or lambdas,
    yet every trainable tensor needs a gradient (zero) on every path, or data-parallel gradient
    reduction sees a parameter without one (the reference path used to leave omega's None)."""
    hp = base_hp(causal=True, use_align=False, use_coh=False, separation_start_step=100,
                 trainable_lambdas=True, trainable_delta_kappa_temp=True, share_omega_across_heads=share_omega)
    inputs = make_inputs(n=12)
    params = AscenderHeadParams(hp, 2).to(F64)  # initial values (make_params writes per-head omegas)
    ascender_attention(*inputs, params, hp, step=99, impl=impl).sum().backward()
    for name, param in params.named_parameters():
        assert param.grad is not None, (impl, name)
        if name != "tau_score":  # the score temperature scales q.k on every path
            assert torch.all(param.grad == 0), (impl, name)
    assert torch.any(params.tau_score.grad != 0)


def test_entry_point_attaches_aux_gradient_and_reports_stats():
    hp = base_hp(causal=True, aux_compactness_weight=0.3, aux_crowding_weight=0.5, aux_alignment_weight=0.2)
    inputs = make_inputs(n=18)
    params = make_params(hp, 2)
    out, info = ascender_attention(*inputs, params, hp, step=0, return_decomposition=True, impl="fast")
    g_attached = torch.autograd.grad(out.sum(), inputs)
    ref = reference_attention(*inputs, params, hp, use_sep=True, with_aux=True)
    g_manual = torch.autograd.grad(ref.out.sum() + ref.aux["total"], inputs)
    for a, b in zip(g_attached, g_manual):
        torch.testing.assert_close(a, b)
    stats = info["stats"]
    for key in ("mass_moved_align", "mass_moved_sep", "mass_moved_coh", "mass_moved_all", "omega_sep",
                "gate_align_mean", "gate_coh_mean", "eta_mean"):  # fmt: skip
        assert stats[key].shape == (2,) and not stats[key].requires_grad, key
    for key in ("gate_align", "gate_coh", "eta"):  # per head: each head's rows [b, s] averaged (b = heads = 2 here)
        rows = info["rows"][key].detach()
        per_head = torch.stack([rows[:, head].mean() for head in range(rows.shape[1])])
        torch.testing.assert_close(stats[f"{key}_mean"], per_head, rtol=1e-6, atol=0, msg=key)
        assert not torch.allclose(per_head, torch.stack([rows[i].mean() for i in range(rows.shape[0])])), key
    assert torch.all(stats["mass_moved_all"] > 0) and torch.all(stats["mass_moved_all"] <= 1)
    assert set(info["aux"]) == {"compactness", "crowding", "alignment", "total"}
    for name, value in info["aux"].items():  # logged per layer: train/loss is the task loss alone
        assert stats[f"aux_{name}"].shape == () and torch.equal(stats[f"aux_{name}"], value), name


def test_entry_point_reference_returns_maps_and_rejects_unknown_impl():
    hp = base_hp()
    inputs = make_inputs(n=9)
    out, info = ascender_attention(*inputs, make_params(hp, 2), hp, step=0, return_decomposition=True,
                                   impl="reference")  # fmt: skip
    assert info["maps"]["A"].shape == (2, 2, 9, 9)
    with pytest.raises(ValueError, match="impl must be one of .*'flex'"):
        ascender_attention(*inputs, make_params(hp, 2), hp, step=0, impl="flex")


def _compare_forward_and_grads(path, device, hp, n, out_tol, grad_tol):
    """``path`` (same signature as reference_attention) against the reference on ``device``:
    output and the gradient of every input and learned per-head tensor."""
    inputs = [x.detach().to(device).requires_grad_() for x in make_inputs(n=n, dtype=F32)]
    params = make_params(hp, 2, dtype=F32).to(device)
    ref = reference_attention(*inputs, params, hp, use_sep=True)
    got = path(*inputs, params, hp, use_sep=True)
    torch.testing.assert_close(got.out, ref.out, rtol=out_tol, atol=out_tol)
    w = torch.randn(ref.out.shape, generator=torch.Generator().manual_seed(7), dtype=F32).to(device)
    tensors = inputs + list(params.parameters())
    names = ["q", "k", "v", "z", "h"] + [name for name, _ in params.named_parameters()]
    g_ref = torch.autograd.grad((ref.out * w).sum(), tensors, allow_unused=True, materialize_grads=True)
    g_got = torch.autograd.grad((got.out * w).sum(), tensors, allow_unused=True, materialize_grads=True)
    for name, a, b in zip(names, g_got, g_ref):
        assert b.abs().max() > 0, f"reference grad {name} is zero: the comparison would be vacuous"
        torch.testing.assert_close(a, b, rtol=grad_tol, atol=grad_tol, msg=lambda m: f"grad {name}: {m}")


def test_grad_comparison_helper_on_the_fast_path():
    """The forward + every-gradient comparison helper, exercised on CPU with the fast path."""
    hp = base_hp(causal=True, window=4, num_global=1)
    _compare_forward_and_grads(fast_attention, "cpu", hp, n=33, out_tol=1e-5, grad_tol=1e-5)


@pytest.mark.parametrize("stride", [256, 16])
@pytest.mark.parametrize("case", ["causal_full_n37", "causal_window_n37", "aux_causal", "bidir_full_n37"])
def test_fast_matches_reference_with_multi_chunk_groups(monkeypatch, case, stride):
    """The Alignment rows run once per group of chunks (fast_moments.chunk_groups); in these
    short cases the causal tile cap leaves one chunk per group, so lift the cap: groups of all
    chunks of one moment stride (stride 16: two chunks of 8 rows, several states)."""
    from ascender_dist.models.ascender import fast_moments, fast_tiles

    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", stride)
    groups = fast_moments.chunk_groups
    monkeypatch.setattr(fast_tiles, "chunk_groups", lambda chunks, causal, n: groups(chunks, causal, 10**9))
    compare(case, F64, rtol=1e-9, atol=1e-10)


def test_chunk_groups_partition_the_chunks_within_one_moment_stride():
    from ascender_dist.models.ascender.fast_moments import MOMENT_STRIDE, chunk_groups

    for n, rows in ((2048, 64), (8192, 16), (1000, 43), (256, 16)):
        chunks = [(c0, min(c0 + rows, n)) for c0 in range(0, n, rows)]
        for causal in (True, False):
            groups = chunk_groups(chunks, causal, n)
            assert [c for _, _, members in groups for c in members] == chunks
            for g0, g1, members in groups:
                assert (members[0][0], members[-1][1]) == (g0, g1)
                if causal:  # one moment state; the [G, g1 - s0] moment tile within a quarter of a score tile
                    assert len({c0 // MOMENT_STRIDE for c0, _ in members}) == 1
                    if len(members) > 1:
                        assert 4 * (g1 - g0) * (g1 - g0 // MOMENT_STRIDE * MOMENT_STRIDE) <= rows * n
                else:
                    assert len(members) == 1 or g1 - g0 <= MOMENT_STRIDE
            assert any(len(m) > 1 for _, _, m in groups) or n == 256


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_run_in_fp32_like_the_triton_path(low):
    """bf16 / fp16 inputs: the fast path computes in fp32 and casts the output back (softmax, row
    statistics and the gradient sums over chunks in 8-bit mantissas would differ by path)."""
    hp = base_hp(causal=True)
    inputs = [x.detach().to(low).requires_grad_() for x in make_inputs(b=1, n=21, hd=8)]
    params = make_params(hp, 2, dtype=F32).to(low)
    got = fast_attention(*inputs, params, hp, use_sep=True)
    want = fast_attention(*[x.detach().float() for x in inputs], make_params(hp, 2, dtype=F32).to(low).to(F32), hp,
                          use_sep=True)  # fmt: skip
    assert got.out.dtype == low
    assert torch.equal(got.out, want.out.to(low))  # fp32 work, one rounding at the end
    got.out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == low and torch.isfinite(x.grad).all() for x in inputs)
    assert params.omega.grad is not None and params.omega.grad.dtype == low
