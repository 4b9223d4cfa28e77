"""ConnectionHParams validation and the parameter count the configs report."""

import pytest
import torch

from ascender_dist.config.errors import ConfigError
from ascender_dist.models.connection import ConnectionHParams, ConnectionLayer, connection_param_count


@pytest.mark.parametrize(
    "field, value, hidden, needle",
    [
        ("num_slots", 0, 64, "model.connection.num_slots: must be >= 1"),
        ("rank", 65, 64, "model.connection.rank: must be <= hidden size (got 65 > 64)"),
        ("rank", 0, 64, "model.connection.rank: must be >= 1"),
        ("max_steps", 0, 64, "model.connection.max_steps: must be >= 1"),
        ("threshold", -0.1, 64, "model.connection.threshold: must be >= 0"),
        ("connection", "quadratic", 64, "model.connection.connection: must be one of ['linear', 'bilinear']"),
        ("stop_granularity", "token", 64, "model.connection.stop_granularity: must be one of"),
        ("causal_chunk_size", 0, 64, "model.connection.causal_chunk_size: must be >= 1"),
        ("slot_init", "random", 64, "model.connection.slot_init: must be one of ['orthogonal']"),
        # 0 leaves the influence, and so every connection weight's gradient, exactly 0 forever
        ("connection_init_scale", 0.0, 64, "model.connection.connection_init_scale: must be > 0"),
        # one slot has no pair i != j: the bilinear maps would be stored, counted and never used
        ("num_slots", 1, 64, "model.connection.num_slots: must be >= 2 for the bilinear connection"),
        # torch.Generator.manual_seed overflows past 2**64 - 1 (a traceback when the layer is built)
        ("slot_seed", 2**64, 64, "model.connection.slot_seed: must be in [-2**63, 2**64)"),
        # NaN passes every < / <= check (a NaN threshold stopped every sample after one step) and a
        # config.json reaches the class without the YAML loader's finiteness check
        ("threshold", float("nan"), 64, "model.connection.threshold: must be a finite number (got nan)"),
        ("compression_eps", float("inf"), 64, "model.connection.compression_eps: must be a finite number"),
        ("init_std", float("nan"), 64, "model.connection.init_std: must be a finite number"),
    ],
)
def test_validate_names_the_field(field, value, hidden, needle):
    hp = ConnectionHParams(**{field: value})
    with pytest.raises(ConfigError) as e:
        hp.validate("model.connection", hidden)
    assert str(e.value).startswith(needle)
    assert "\n" not in str(e.value)


def test_validate_accepts_defaults_and_checks_tp_divisibility():
    ConnectionHParams().validate("model.connection", 512, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match=r"model.connection.rank: must be divisible by tensor parallel size 3"):
        ConnectionHParams(rank=32).validate("model.connection", 516, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"^model.connection: hidden size 510"):
        ConnectionHParams(rank=30).validate("model.connection", 510, tensor_parallel_size=4)


def test_bilinear_term_of_the_design_note():
    hp = ConnectionHParams(num_slots=64, connection="bilinear", rank=32)
    assert connection_param_count(hp, 1024) - 6 * 1024 * 1024 == 268_435_456  # 2 N^2 D r


@pytest.mark.parametrize("connection", ["linear", "bilinear"])
def test_param_count_matches_stored_weights(connection):
    hp = ConnectionHParams(num_slots=5, connection=connection, rank=3)
    layer = ConnectionLayer(hp, 12)
    assert connection_param_count(hp, 12) == sum(p.numel() for p in layer.parameters())
    assert "slots" in dict(layer.named_buffers()) and "slots" not in dict(layer.named_parameters())


def test_fixed_slots_are_orthogonal_and_identical_across_instances():
    hp = ConnectionHParams(num_slots=6, connection="linear")
    a, b = ConnectionLayer(hp, 16).slots, ConnectionLayer(hp, 16).slots
    assert torch.equal(a, b)
    gram = a.double() @ a.double().T / 16
    assert torch.allclose(gram, torch.eye(6, dtype=torch.float64), atol=1e-6)


def test_rank_is_only_checked_for_the_bilinear_connection():
    ConnectionHParams(connection="linear", rank=999).validate("m", 64)
    with pytest.raises(ConfigError):
        ConnectionHParams(connection="bilinear", rank=999).validate("m", 64)


def test_a_linear_connection_keeps_one_slot_and_seeds_at_the_edges_of_torchs_range():
    ConnectionHParams(num_slots=1, connection="linear").validate("model.connection", 64)
    for seed in (-(2**63), 2**64 - 1):
        ConnectionHParams(num_slots=2, rank=2, slot_seed=seed).validate("model.connection", 8)
        ConnectionLayer(ConnectionHParams(num_slots=2, rank=2, slot_seed=seed), 8)  # the seed is usable


def test_the_connection_trains_from_the_smallest_accepted_init_scale():
    """With connection_init_scale > 0 the connection weights get a nonzero gradient at step 0."""
    for kind in ("linear", "bilinear"):
        hp = ConnectionHParams(num_slots=4, connection=kind, rank=2, connection_init_scale=1e-3, threshold=0.0,
                               causal=False)
        layer = ConnectionLayer(hp, 8)
        x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(0))
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        weights = {n: p.grad for n, p in layer.named_parameters() if n in ("c", "src", "tgt")}
        assert weights and any(g is not None and g.abs().max() > 0 for g in weights.values()), (kind, weights)


def test_more_slots_than_dims_give_orthonormal_columns_as_documented():
    from ascender_dist.models.connection import make_fixed_slots

    slots = make_fixed_slots(12, 8, seed=3, dtype=torch.float64)  # N > D: rows cannot be orthogonal
    assert torch.allclose(slots.T @ slots / 8, torch.eye(8, dtype=torch.float64), atol=1e-12)
    assert slots.square().mean().sqrt().item() == pytest.approx((8 / 12) ** 0.5)
