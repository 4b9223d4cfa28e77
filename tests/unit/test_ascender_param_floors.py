"""The learned score temperature and density scale are used at their floors when they train below
them (TAU_SCORE_MIN, KAPPA_MIN): on every path (reference, fast, Triton under the interpreter) a
value below the floor computes exactly what the floor computes, passes no gradient to the
parameter, and a value above it is used as it is; an initial value below a floor is refused."""

import pytest
import torch

from ascender_dist.config.ascender_hparams import KAPPA_MIN, TAU_SCORE_MIN
from ascender_dist.config.errors import ConfigError
from ascender_dist.models.ascender import ascender_attention

from .test_ascender_fast import base_hp, make_inputs, make_params

torch.set_num_threads(1)
F64 = torch.float64
IMPLS = ("reference", "fast", "triton")


def _run(impl: str, name: str, value: float):
    """Output and the gradient of ``name`` (tau_score or kappa) with head 0's value set to ``value``."""
    hp = base_hp(causal=True, kappa_init=1.0)
    inputs = make_inputs(b=1, nh=2, n=21, hd=16, dtype=F64)
    params = make_params(hp, 2)
    with torch.no_grad():
        getattr(params, name)[0] = value
        params.kappa[1] = 0.05  # head 1 above both floors, kappa small enough that eta = rho / kappa < 1 acts
    out = ascender_attention(*inputs, params, hp, step=10, impl=impl)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (grad,) = torch.autograd.grad((out * w).sum(), [getattr(params, name)])
    return out.detach(), grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,floor", [("tau_score", TAU_SCORE_MIN), ("kappa", KAPPA_MIN)])
def test_a_value_below_its_floor_is_used_at_the_floor(impl, name, floor):
    at_floor, _ = _run(impl, name, floor)
    for below in (floor / 2, 0.0, -1.0):  # a temperature or density scale that trained through 0
        out, grad = _run(impl, name, below)
        assert torch.isfinite(out).all()
        assert torch.equal(out, at_floor), (impl, name, below)
        assert grad[0] == 0 and grad[1] != 0  # head 0 held at the floor; head 1 trains
    above, _ = _run(impl, name, 4 * floor)
    assert not torch.allclose(above, at_floor)  # above the floor the learned value is what acts


@pytest.mark.parametrize("field,value", [("tau_score_init", TAU_SCORE_MIN / 2), ("kappa_init", KAPPA_MIN / 2)])
def test_an_initial_value_below_its_floor_is_refused(field, value):
    with pytest.raises(ConfigError, match=rf"^model\.ascender\.{field}: must be >= .* the floor"):
        base_hp(**{field: value}).validate("model.ascender", head_dim=16)
