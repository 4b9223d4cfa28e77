"""AscenderHParams validation (one-line ConfigError naming the field) and per-head params."""

import dataclasses

import pytest
import torch

from ascender_dist.config.errors import ConfigError
from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams
from ascender_dist.models.ascender.params import alibi_slopes


def test_defaults_are_valid_for_head_dim_64():
    AscenderHParams().validate("model.ascender", head_dim=64)


@pytest.mark.parametrize(
    "changes, path, fragment",
    [
        (dict(k=64, window=32), "model.ascender.k", "must be <= window (got 64 > 32)"),
        (dict(k=0), "model.ascender.k", ">= 1"),
        (dict(tau_sep=0.0), "model.ascender.tau_sep", "> 0"),
        (dict(tau_coh=-1.0), "model.ascender.tau_coh", "> 0"),
        (dict(tau_score_init=0.0), "model.ascender.tau_score_init", ">= 0.01, the floor"),
        (dict(kappa_init=0.0), "model.ascender.kappa_init", ">= 0.001, the floor"),
        (dict(d_z=65), "model.ascender.d_z", "head dim 64"),
        (dict(d_a=65), "model.ascender.d_a", "head dim 64"),
        (dict(window=-1), "model.ascender.window", ">= 0"),
        (dict(window=0, num_global=2), "model.ascender.num_global", "window > 0"),
        (dict(alpha_align=-1.0), "model.ascender.alpha_align", ">= 0"),
        (dict(lambda_sep=-0.5), "model.ascender.lambda_sep", ">= 0"),
        (dict(kernel_tau_form="tau3"), "model.ascender.kernel_tau_form", "tau, tau2"),
        (dict(std_form="biased"), "model.ascender.std_form", "population, sample"),
        (dict(other_bias="rope"), "model.ascender.other_bias", "none, alibi"),
        (dict(gate_placement="x"), "model.ascender.gate_placement", "pre_norm, post_norm"),
        (dict(neighbour_source="keys"), "model.ascender.neighbour_source", "affinity, base_scores"),
        (dict(chunk_size=0), "model.ascender.chunk_size", ">= 1"),
        (dict(aux_crowding_weight=-1.0), "model.ascender.aux_crowding_weight", ">= 0"),
        # an auxiliary loss of a bias that is off was accepted and trained nothing (its total was 0)
        (dict(use_coh=False, aux_compactness_weight=0.3), "model.ascender.aux_compactness_weight",
         "must be 0 when use_coh is false"),
        (dict(use_sep=False, aux_crowding_weight=0.5), "model.ascender.aux_crowding_weight",
         "must be 0 when use_sep is false"),
        (dict(use_align=False, aux_alignment_weight=0.2), "model.ascender.aux_alignment_weight",
         "must be 0 when use_align is false"),
        # NaN passes every < / > check, and a config.json reaches the class without the YAML loader
        (dict(lambda_sep=float("nan")), "model.ascender.lambda_sep", "must be a finite number (got nan)"),
        (dict(tau_coh=float("inf")), "model.ascender.tau_coh", "must be a finite number (got inf)"),
    ],
)
def test_invalid_fields_name_their_path(changes, path, fragment):
    hp = dataclasses.replace(AscenderHParams(), **changes)
    with pytest.raises(ConfigError) as err:
        hp.validate("model.ascender", head_dim=64)
    msg = str(err.value)
    assert msg.startswith(path + ": ") and fragment in msg and "\n" not in msg


def test_k_larger_than_window_allowed_without_window():
    AscenderHParams(k=200, window=0, num_global=0).validate("m", head_dim=64)


def test_fields_are_plain_types():
    for f in dataclasses.fields(AscenderHParams):
        assert f.type in ("int", "float", "bool", "str"), f.name


def test_schedule_helpers():
    hp = AscenderHParams(separation_start_step=10, aux_alignment_weight=0.1, aux_start_step=5)
    assert not hp.separation_active(9) and hp.separation_active(10)
    assert not hp.aux_active(4) and hp.aux_active(5)
    assert not AscenderHParams().aux_active(10**6)  # all weights 0
    assert AscenderHParams(kernel_tau_form="tau2", tau_sep=0.5).kernel_denominator(0.5) == 0.25


def test_params_have_leading_head_dim_and_are_listed():
    hp = AscenderHParams(omega_init=0.1, delta_init=0.3)
    p = AscenderHeadParams(hp, num_heads=3)
    assert p.omega.shape == (3, 3) and torch.all(p.omega == 0.1)
    assert p.lambdas.shape == (3, 3) and p.delta.shape == (3,) and torch.all(p.delta == 0.3)
    names = AscenderHeadParams.per_head_parameter_names(p)
    assert set(names) == {"omega", "delta", "kappa", "tau_score"}
    for name, tensor in p.named_parameters():
        assert tensor.shape[0] == 3, name
    fixed = AscenderHeadParams(dataclasses.replace(hp, trainable_delta_kappa_temp=False), 3)
    assert AscenderHeadParams.per_head_parameter_names(fixed) == ["omega"]
    assert "delta" in fixed.state_dict() and "kappa" in fixed.state_dict()


def test_alibi_slopes_shard_by_global_head():
    full = AscenderHeadParams(AscenderHParams(), 8).alibi_slope
    half = AscenderHeadParams(AscenderHParams(), 4, global_num_heads=8, head_offset=4).alibi_slope
    assert torch.equal(full[4:], half)
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # non-power-of-two head counts (GPT-small has 12): the ALiBi paper's get_slopes, written out by
    # hand: the slopes of the lower power of two, then every other slope of the next power of two
    expected_6 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert torch.equal(alibi_slopes(6), torch.tensor(expected_6))
    expected_12 = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    assert torch.allclose(alibi_slopes(12), torch.tensor(expected_12), rtol=1e-6, atol=0)


def test_shared_omega_is_one_vector_seen_by_every_head():
    hp = AscenderHParams(omega_init=0.25, share_omega_across_heads=True)
    p = AscenderHeadParams(hp, num_heads=4)
    params = dict(p.named_parameters())
    assert "omega" not in params and params["omega_shared"].shape == (1, 3)
    assert torch.all(params["omega_shared"] == 0.25)
    with torch.no_grad():
        params["omega_shared"].copy_(torch.tensor([[0.1, 0.2, 0.3]]))
    assert p.omega.shape == (4, 3)  # the per-head view the attention math reads
    assert torch.equal(p.omega, torch.tensor([[0.1, 0.2, 0.3]]).expand(4, 3))
    # not a per-head tensor: never partitioned over tensor-parallel ranks
    assert AscenderHeadParams.per_head_parameter_names(p) == ["delta", "kappa", "tau_score"]
    assert "omega_shared" in AscenderHeadParams.SHARED_TENSORS and "omega_shared" not in p.PER_HEAD_TENSORS
    assert set(p.state_dict()) == {"omega_shared", "lambdas", "delta", "kappa", "tau_score"}
    with pytest.raises(RuntimeError):  # a view of one vector: writing per head must not silently do nothing
        with torch.no_grad():
            p.omega.copy_(torch.zeros(4, 3))
    # gradients of every head sum into the shared gains
    weights = torch.arange(12, dtype=torch.float32).view(4, 3)
    (p.omega * weights).sum().backward()
    assert torch.equal(params["omega_shared"].grad, weights.sum(0, keepdim=True))


def test_per_head_omega_keeps_its_name_and_shape():
    p = AscenderHeadParams(AscenderHParams(), num_heads=4)
    assert isinstance(p.omega, torch.nn.Parameter) and p.omega.shape == (4, 3)
    assert "omega" in p.state_dict() and "omega_shared" not in p.state_dict() and not p.shares_omega


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("extra", [{}, {"window": 4, "num_global": 2, "other_bias": "alibi"}])
def test_shared_omega_equals_per_head_with_equal_gains(impl, extra):
    """Same output as per-head omega holding the shared values in every head; its gradient is the
    sum of the per-head gradients; the other per-head parameters get the same gradients."""
    from ascender_dist.models.ascender import ascender_attention

    f64 = torch.float64
    hp = dataclasses.replace(AscenderHParams(d_z=4, d_a=5, k=3, window=0, num_global=0, chunk_size=8), **extra)
    b, nh, n = 2, 3, 21
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, nh, n, d, generator=g, dtype=f64) for d in (8, 8, 8, 4, 5)]
    weights = torch.randn(b, nh, n, 8, generator=g, dtype=f64)
    gains = torch.tensor([[0.7, 0.4, 1.3]], dtype=f64)
    per_head = AscenderHeadParams(hp, nh).to(f64)
    shared = AscenderHeadParams(dataclasses.replace(hp, share_omega_across_heads=True), nh).to(f64)
    with torch.no_grad():
        per_head.omega.copy_(gains.expand(nh, 3))
        shared.omega_shared.copy_(gains)
    outs = []
    for p in (per_head, shared):
        out = ascender_attention(*inputs, p, hp, step=0, impl=impl)
        (out * weights).sum().backward()
        outs.append(out.detach())
    assert torch.allclose(outs[0], outs[1], atol=1e-12)
    assert torch.allclose(shared.omega_shared.grad, per_head.omega.grad.sum(0, keepdim=True), atol=1e-10)
    assert shared.omega_shared.grad.abs().min() > 0
    for name in ("delta", "kappa", "tau_score"):
        assert torch.allclose(getattr(shared, name).grad, getattr(per_head, name).grad, atol=1e-10), name
    # logged per head (TensorBoard ascender/omega_*/layerNN/headMM): the shared value in every head
    _, info = ascender_attention(*inputs, shared, hp, step=0, impl=impl, return_decomposition=True)
    for col, name in enumerate(("align", "sep", "coh")):
        assert torch.equal(info["stats"][f"omega_{name}"], gains[0, col].expand(nh)), name
    for name in ("delta", "kappa", "tau_score"):  # the learned, unbounded per-head values, logged to watch them
        assert torch.equal(info["stats"][name], getattr(shared, name).detach()), name
