"""The fast path's closed-form backward of the per-row algebra (fast_row_grads) against autograd
through fast_rows.row_algebra, float64, leaf by leaf, for every option that changes the algebra
and a gradient on every row statistic it returns."""

import dataclasses

import pytest
import torch

from ascender_dist.models.ascender import fast_moments
from ascender_dist.models.ascender.fast_neighbours import chunk_bounds, neighbours
from ascender_dist.models.ascender.neighbour_rule import search_vectors
from ascender_dist.models.ascender.fast_row_grads import row_algebra_backward
from ascender_dist.models.ascender.fast_rows import row_algebra, row_inputs
from ascender_dist.models.ascender.fast_tiles import Call, kernel_tiles, operands
from tests.unit.test_ascender_fast import base_hp, make_inputs, make_params

F64 = torch.float64

CONFIGS = {
    "causal": dict(causal=True),
    "bidir": dict(causal=False),
    "post_sample_tau2": dict(causal=True, gate_placement="post_norm", std_form="sample", kernel_tau_form="tau2"),
    "bidir_post": dict(causal=False, gate_placement="post_norm"),
    "coh_width_differs": dict(causal=True, tau_coh=3.0),
    "only_align": dict(use_sep=False, use_coh=False),
    "only_coh": dict(use_sep=False, use_align=False),
    "only_sep": dict(use_align=False, use_coh=False),
}


def _as_leaves(x: dict) -> dict:
    """The chunk's inputs as autograd leaves: detached copies that require grad (tuples entry by entry)."""
    out = {}
    for key, val in x.items():
        if isinstance(val, tuple):
            out[key] = tuple(v_.detach().requires_grad_() for v_ in val)
        elif isinstance(val, torch.Tensor) and val.is_floating_point():
            out[key] = val.detach().requires_grad_()
        else:
            out[key] = val
    return out


def _chunk_case(hp, n, chunk):
    """Operands, the leaf inputs of one chunk and autograd's row_algebra on them."""
    inputs = [t.detach() for t in make_inputs(n=n, dtype=F64)]
    q, k, v, z, h = inputs
    params = make_params(hp, 2, dtype=F64)
    call = Call(hp, n, q.shape[-1], hp.use_sep, False, False)
    chunks = chunk_bounds(n, q.shape[0] * q.shape[1], hp)
    idx, valid = neighbours(*search_vectors(q, k, h, hp), hp, chunks)
    p = {name: getattr(params, name).detach() for name in ("omega", "lambdas", "delta", "kappa", "tau_score")}
    t = operands(call, q, k, v, z, h, p["delta"], p["tau_score"], params.alibi_slope)
    t.update(omega=p["omega"], lambdas=p["lambdas"], kappa=p["kappa"], tau=p["tau_score"], idx=idx, valid=valid)
    c0, c1 = chunks[chunk]
    L = c1 if hp.causal else n
    stats, _ = kernel_tiles(call, c0, c1, L, t, keep=False)
    return call, t, stats, c0, c1, L


@pytest.mark.parametrize("stride", [256, 16, 8])  # 16: a state ending before the chunk starts
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_row_algebra_backward_matches_autograd(monkeypatch, config, chunk, stride):
    monkeypatch.setattr(fast_moments, "MOMENT_STRIDE", stride)
    hp = dataclasses.replace(base_hp(**CONFIGS[config]), chunk_size=8)
    call, t, stats, c0, c1, L = _chunk_case(hp, 29, chunk)
    g = torch.Generator().manual_seed(3)
    with torch.enable_grad():
        x = _as_leaves(row_inputs(call, c0, c1, t, stats))
        parts, factor, rows = row_algebra(call, c0, c1, L, x)
    g_parts = {key: torch.randn(p.shape, generator=g, dtype=F64) for key, p in parts}
    g_factor = torch.randn(factor.shape, generator=g, dtype=F64) if factor is not None else None
    n = t["q"].shape[2]
    d_rows = {key: torch.randn(*r.shape[:2], n, *r.shape[3:], generator=g, dtype=F64) for key, r in rows.items()}
    d_rows["lsep"] = None  # tile outputs (not row_algebra's) are skipped
    d_c = torch.randn(rows["centroid"].shape, generator=g, dtype=F64) if "centroid" in rows else None
    outs = [p for _, p in parts] + ([factor] if factor is not None else []) + [rows[k_] for k_ in rows]
    gouts = list(g_parts.values()) + ([g_factor] if factor is not None else [])
    gouts += [d_rows[k_][:, :, c0:c1] + (d_c if k_ == "centroid" else 0) for k_ in rows]
    leaves = {k_: v_ for k_, v_ in x.items() if isinstance(v_, torch.Tensor) and v_.requires_grad}
    leaves.update({f"{k_}#{i}": v_ for k_, val in x.items() if isinstance(val, tuple) for i, v_ in enumerate(val)})
    auto = torch.autograd.grad(outs, list(leaves.values()), gouts, allow_unused=True)
    auto = {name: a for name, a in zip(leaves, auto) if a is not None}
    with torch.no_grad():
        x = row_inputs(call, c0, c1, t, stats)
        saved = {}
        row_algebra(call, c0, c1, L, x, saved=saved)
        mine = row_algebra_backward(call, c0, c1, x, saved, rows, g_parts, g_factor, d_rows, d_c)
    assert auto.keys() - {"nweight"} <= mine.keys()  # the 0/1 neighbour weights get no gradient
    assert auto, "no gradient reached any leaf"
    for name, ref in auto.items():
        if name != "nweight":
            torch.testing.assert_close(mine[name], ref, rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")
