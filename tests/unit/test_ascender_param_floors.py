"""The learned score temperature and density scale are used at their floors when they train below
them (TAU_SCORE_MIN, KAPPA_MIN): on every path (reference, fast, Triton under the interpreter) a
value below the floor computes exactly what the floor computes and gets only the gradient that
would raise it (so a parameter that overshot can come back), and a value above it is used as it is;
an initial value below a floor is refused."""

import pytest
import torch

from ascender_dist.config.ascender_hparams import KAPPA_MIN, TAU_SCORE_MIN
from ascender_dist.config.errors import ConfigError
from ascender_dist.models.ascender import ascender_attention
from ascender_dist.models.ascender import attention as entry

from .test_ascender_fast import base_hp, make_inputs, make_params

import triton  # noqa: E402,F401  a [dev] requirement: missing, collection fails instead of testing the torch path

torch.set_num_threads(1)
F64 = torch.float64
IMPLS = ("reference", "fast", "triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: compiled on CUDA, interpreted on CPU


def _run(impl: str, name: str, value: float, sign: float = 1.0):
    """Output and the gradient of ``name`` (tau_score or kappa) with head 0's value set to ``value``,
    for the loss sign * (out . w)."""
    hp = base_hp(causal=True, kappa_init=1.0)
    inputs = [x.detach().to(DEVICE).requires_grad_() for x in make_inputs(b=1, nh=2, n=21, hd=16, dtype=F64)]
    params = make_params(hp, 2).to(DEVICE)
    with torch.no_grad():
        getattr(params, name)[0] = value
        params.kappa[1] = 0.05  # head 1 above both floors, kappa small enough that eta = rho / kappa < 1 acts
    if impl == "triton":  # the path really taken, not a fallback to the torch path
        assert entry._pick_impl("triton", inputs[0], hp) == "triton"
    out = ascender_attention(*inputs, params, hp, step=10, impl=impl)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype).to(DEVICE)
    (grad,) = torch.autograd.grad(sign * (out * w).sum(), [getattr(params, name)])
    return out.detach(), grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,floor", [("tau_score", TAU_SCORE_MIN), ("kappa", KAPPA_MIN)])
def test_a_value_below_its_floor_is_used_at_the_floor(impl, name, floor):
    at_floor, _ = _run(impl, name, floor)
    for below in (floor / 2, 0.0, -1.0):  # a temperature or density scale that trained through 0
        out, grad = _run(impl, name, below)
        assert torch.isfinite(out).all()
        assert torch.equal(out, at_floor), (impl, name, below)
        _, flipped = _run(impl, name, below, sign=-1.0)
        # one of the two losses pushes head 0 up (a negative gradient): only that one reaches it
        pair = sorted([grad[0].item(), flipped[0].item()])
        assert pair[0] < 0 and pair[1] == 0, (impl, name, below, pair)
        assert grad[1] != 0  # head 1 trains as usual
    above, _ = _run(impl, name, 4 * floor)
    assert not torch.allclose(above, at_floor)  # above the floor the learned value is what acts


@pytest.mark.parametrize("field,value", [("tau_score_init", TAU_SCORE_MIN / 2), ("kappa_init", KAPPA_MIN / 2),
                                         ("tau_score_init", 0.0), ("kappa_init", -1.0)])
def test_an_initial_value_below_its_floor_is_refused(field, value):
    with pytest.raises(ConfigError, match=rf"^model\.ascender\.{field}: must be >= .* the floor"):
        base_hp(**{field: value}).validate("model.ascender", head_dim=16)


@pytest.mark.parametrize("name", ["tau_score", "kappa"])
def test_the_floors_gradient_above_the_floor_is_the_finite_difference(name):
    """Every other gradient test compares paths that all go through _Floor's hand-written backward (a
    doubled gradient passed them all): the reference's gradient of tau_score / kappa, each head above
    its floor, against central finite differences of the loss in float64."""
    hp = base_hp(causal=True, kappa_init=1.0)
    inputs = [x.detach() for x in make_inputs(b=1, nh=2, n=21, hd=16, dtype=F64)]
    params = make_params(hp, 2)
    with torch.no_grad():
        params.kappa[1] = 0.05  # eta = rho / kappa < 1 somewhere: kappa's gradient is not 0
    w = torch.randn(1, 2, 21, 16, generator=torch.Generator().manual_seed(3), dtype=F64)

    def loss():
        return (ascender_attention(*inputs, params, hp, step=10, impl="reference") * w).sum()

    param = getattr(params, name)
    (grad,) = torch.autograd.grad(loss(), [param])
    for head in range(2):
        eps = 1e-5 * param[head].item()
        with torch.no_grad():
            param[head] += eps
            up = loss()
            param[head] -= 2 * eps
            down = loss()
            param[head] += eps
        numeric = (up - down).item() / (2 * eps)
        assert abs(numeric) > 1e-4, (name, head, numeric)  # the check means something
        assert grad[head].item() == pytest.approx(numeric, rel=1e-4), (name, head)  # a doubled gradient: 1.0
