"""ConnectionLayer against the slow seed reference: outputs, gradients, stop rule, causality."""

import dataclasses
import itertools

import pytest
import torch

from ascender_dist.models.connection import ConnectionHParams, ConnectionLayer
from ascender_dist.models.connection import reference as ref
from tests.helpers.causality import assert_gradients_causal

D = 8


def make(dtype=torch.float64, seed=0, **overrides):
    """A small layer whose token projections are large enough for samples to differ."""
    kw = dict(num_slots=4, connection="bilinear", rank=3, max_steps=5, threshold=0.5,
              causal=False, causal_chunk_size=3, init_std=0.4, connection_init_scale=0.6)
    kw.update(overrides)
    hp = ConnectionHParams(**kw)
    torch.manual_seed(seed)
    return ConnectionLayer(hp, D, dtype=dtype), hp


def inputs(s=7, b=2, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, D, generator=g, dtype=dtype)


def weights(layer):
    """The layer's own parameters (so reference grads land on them) plus the slots buffer."""
    return ref.weights_from_layer(layer)


def ref_steps(steps, hp):
    """Reference step lists -> tensor shaped like layer.last_stats.steps."""
    t = torch.tensor(steps)
    return t.squeeze(-1) if hp.stop_granularity == "sample" else t


CONFIGS = list(itertools.product([False, True], ["linear", "bilinear"], ["sample", "slot"], [True, False]))


def assert_matches_reference_float64(layer, hp) -> None:
    """Output, steps and every gradient (parameters and input) of ``layer`` against the reference."""
    x = inputs().requires_grad_()
    g = torch.randn(7, 2, D, dtype=torch.float64)
    params = [p for _, p in layer.named_parameters()]

    y = layer(x)
    grads = torch.autograd.grad((y * g).sum(), params + [x])
    y_ref, steps = ref.forward(x, weights(layer), hp)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), params + [x], allow_unused=True)

    assert torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(layer.last_stats.steps, ref_steps(steps, hp))
    for (name, _), gl, gr in zip(list(layer.named_parameters()) + [("x", x)], grads, grads_ref):
        gr = torch.zeros_like(gl) if gr is None else gr  # reference never touches src/tgt[i, i]
        assert torch.allclose(gl, gr, rtol=1e-9, atol=1e-12), name


@pytest.mark.parametrize("causal, connection, granularity, normalize", CONFIGS)
def test_forward_and_grads_equal_reference_float64(causal, connection, granularity, normalize):
    layer, hp = make(causal=causal, connection=connection, stop_granularity=granularity,
                     normalize_compression=normalize)
    assert_matches_reference_float64(layer, hp)


@pytest.mark.parametrize("causal, connection, granularity", list(itertools.product(
    [False, True], ["linear", "bilinear"], ["sample", "slot"])))
def test_early_stops_freeze_states_as_the_reference_does(causal, connection, granularity):
    """make()'s defaults run every sample to max_steps in most configurations; a weak connection and
    a low threshold stop after a step or two, so frozen states (and their gradients) are compared."""
    layer, hp = make(causal=causal, connection=connection, stop_granularity=granularity, threshold=0.3,
                     connection_init_scale=0.05, max_steps=8)
    assert_matches_reference_float64(layer, hp)
    assert int(layer.last_stats.steps.max()) < hp.max_steps  # the stop fired everywhere


@pytest.mark.parametrize("causal, connection", [(False, "bilinear"), (True, "bilinear"), (True, "linear")])
def test_forward_and_grads_equal_reference_float32(causal, connection):
    layer, hp = make(dtype=torch.float32, causal=causal, connection=connection)
    x = inputs(dtype=torch.float32).requires_grad_()
    params = [p for _, p in layer.named_parameters()]
    y = layer(x)
    grads = torch.autograd.grad(y.square().sum(), params + [x])
    y_ref, steps = ref.forward(x, weights(layer), hp)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), params + [x], allow_unused=True)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer.last_stats.steps, ref_steps(steps, hp))
    for gl, gr in zip(grads, grads_ref):
        gr = torch.zeros_like(gl) if gr is None else gr
        assert float((gl - gr).norm() / gr.norm()) < 2e-5  # fp32 accumulations differ in order


def test_bilinear_diagonal_pairs_get_no_gradient():
    layer, _ = make()
    layer(inputs()).sum().backward()
    diag = torch.arange(4)
    src_grad, tgt_grad = layer.src.grad.permute(0, 2, 1, 3), layer.tgt.grad.transpose(0, 1)  # [i, j, ...]
    assert src_grad[diag, diag].abs().max() == 0 and tgt_grad[diag, diag].abs().max() == 0
    off = ~torch.eye(4, dtype=torch.bool)
    assert src_grad[off].abs().amax(dim=(-1, -2)).gt(0).all() and tgt_grad[off].abs().amax(dim=(-1, -2)).gt(0).all()


# ------------------------------------------------------------------ adaptive stop


def scaled_states(m=4, n=4, seed=2):
    """Slot states whose scale differs per sample; influence is 1-homogeneous, so big ones take longer."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, n, D, generator=g, dtype=torch.float64).abs()
    return h * torch.tensor([0.05, 0.5, 2.0, 8.0], dtype=torch.float64)[:m, None, None]


@pytest.mark.parametrize("connection, granularity", list(itertools.product(["linear", "bilinear"], ["sample", "slot"])))
def test_converged_samples_freeze_while_others_go_on(connection, granularity):
    layer, hp = make(connection=connection, stop_granularity=granularity, max_steps=8, threshold=0.05,
                     connection_init_scale=0.08)
    h = scaled_states()
    out, steps, iterations = layer.reason(h)
    w = weights(layer)
    never_stop = dataclasses.replace(hp, threshold=-1.0)
    for m in range(h.shape[0]):
        expected, st = ref.reason(h[m], w, hp)
        assert torch.allclose(out[m], expected, rtol=1e-12, atol=1e-12)
        assert steps[m].tolist() == (st[0] if granularity == "sample" else st)
    assert len(set(steps.flatten().tolist())) > 1, "test needs samples that stop at different steps"
    assert iterations == int(steps.max()) == 8
    # freezing is observable: the earliest stopper would have moved had it gone on
    first = int(steps.flatten(1).max(1).values.argmin()) if granularity == "slot" else int(steps.argmin())
    assert not torch.allclose(out[first], ref.reason(h[first], w, never_stop)[0])


def test_stop_check_interval_changes_iterations_not_results():
    h = scaled_states(m=3)
    results = {}
    for every in (1, 3, 0):
        layer, _ = make(max_steps=8, threshold=0.3, connection_init_scale=0.05, stop_check_every=every)
        results[every] = layer.reason(h)
    (o1, s1, i1), (o3, s3, i3), (o0, s0, i0) = results[1], results[3], results[0]
    assert torch.equal(o1, o3) and torch.equal(o1, o0)  # frozen samples carried bit-for-bit
    assert torch.equal(s1, s3) and torch.equal(s1, s0)
    assert (i1, i3, i0) == (int(s1.max()), 3, 8), (i1, i3, i0)


def test_threshold_zero_runs_max_steps():
    layer, _ = make(max_steps=3, threshold=0.0)
    _, steps, iterations = layer.reason(scaled_states() + 1.0)
    assert iterations == 3 and bool((steps == 3).all())


def test_stats_scalars_for_logging():
    layer, _ = make(causal=True)
    layer(inputs())
    stats = layer.last_stats
    assert stats.steps.shape == (2, 3)  # [b, chunks]
    sc = stats.scalars()
    assert stats.causal and torch.equal(stats.input_steps(), stats.steps[:, 1:])
    assert sc["steps_max"] == float(stats.steps[:, 1:].max()) and 1 <= sc["steps_mean"] <= sc["steps_max"] <= 5


def test_logged_steps_leave_out_the_bare_slot_state_of_a_causal_layer():
    """The first chunk reasons from the bare slots, the same for every input: its steps would dilute the
    logged mean (and could set the max) with a number no input moves."""
    from ascender_dist.models.connection.layer import ReasoningStats

    steps = torch.tensor([[8, 2, 4], [8, 3, 3]])  # [b, chunks]
    assert ReasoningStats(steps, 8, causal=True).scalars() == {"steps_mean": 3.0, "steps_max": 4.0, "iterations": 8.0}
    assert ReasoningStats(steps[:, :1], 8, causal=True).scalars()["steps_mean"] == 8.0  # one chunk: nothing else
    assert ReasoningStats(torch.tensor([8, 2]), 8).scalars()["steps_mean"] == 5.0  # full layer: every state


# ------------------------------------------------------------------ causality


@pytest.mark.parametrize("connection, normalize", [("bilinear", True), ("linear", False)])
@pytest.mark.parametrize("t", [0, 2, 3, 5, 9])
def test_no_future_leak_bit_for_bit(connection, normalize, t):
    layer, _ = make(dtype=torch.float32, causal=True, connection=connection, normalize_compression=normalize)
    x = inputs(s=11, dtype=torch.float32)
    x2 = x.clone()
    x2[t + 1 :] = torch.randn_like(x2[t + 1 :]) * 10  # rewrite the future, including a partial chunk
    y, y2 = layer(x), layer(x2)
    assert torch.equal(y[: t + 1], y2[: t + 1])
    assert not torch.equal(y[t + 1 :], y2[t + 1 :])  # the changed future does matter


@pytest.mark.parametrize("granularity", ["sample", "slot"])
@pytest.mark.parametrize("connection, t", [("bilinear", 0), ("bilinear", 2), ("bilinear", 3), ("bilinear", 5),
                                           ("linear", 0), ("linear", 2)])
def test_no_future_leak_through_the_adaptive_stop(connection, t, granularity):
    """The test above runs every chunk to max_steps (the stop never fires there). Here the visible
    chunks stop after 1 step while the rewritten future keeps the batched loop going to max_steps:
    the past must stay frozen bit for bit and its stop decisions must not depend on the future."""
    layer, hp = make(dtype=torch.float32, causal=True, connection=connection,
                     normalize_compression=connection == "bilinear", stop_granularity=granularity, max_steps=8,
                     threshold=0.3, connection_init_scale=0.05)
    x = inputs(s=11, dtype=torch.float32)
    x2 = x.clone()
    x2[t + 1 :] = torch.randn(x2[t + 1 :].shape, generator=torch.Generator().manual_seed(4)) * 10
    y, steps = layer(x), layer.last_stats.steps.clone()
    y2, steps2, iterations2 = layer(x2), layer.last_stats.steps.clone(), layer.last_stats.iterations
    visible = t // hp.causal_chunk_size + 1  # chunks whose prefix state tokens <= t read
    assert torch.equal(y[: t + 1], y2[: t + 1])
    assert torch.equal(steps[:, :visible], steps2[:, :visible])
    # not vacuous: the visible chunks stopped early while the loop ran on for the changed future
    assert int(steps2[:, :visible].max()) < iterations2 == hp.max_steps, (steps2, iterations2)
    assert not torch.equal(steps, steps2)


def assert_layer_gradients_causal(layer, t):
    """tests.helpers.causality on the layer ([s, b, D]: positions along dim 0), float64, s = 11."""
    named = list(layer.named_parameters())
    assert_gradients_causal(layer, [inputs(s=11)], t, dim=0, names=["x"], params=[p for _, p in named],
                            param_names=[name for name, _ in named])  # fmt: skip


@pytest.mark.parametrize("connection, normalize", [("bilinear", True), ("linear", False)])
@pytest.mark.parametrize("t", [0, 2, 3, 5, 9])
def test_no_future_leak_in_gradients(connection, normalize, t):
    """The backward is causal too: for a loss on the outputs at <= t, the tokens after t get exactly
    zero gradient, and the gradients of the tokens at <= t and of every parameter are bit-for-bit
    unchanged when everything after t is rewritten (float64; chunks of 3: t = 2 ends a chunk, 3
    starts one, 9 starts the partial last chunk)."""
    layer, _ = make(causal=True, connection=connection, normalize_compression=normalize)
    assert_layer_gradients_causal(layer, t)


@pytest.mark.parametrize("granularity", ["sample", "slot"])
@pytest.mark.parametrize("connection, t", [("bilinear", 0), ("bilinear", 2), ("bilinear", 3), ("bilinear", 5),
                                           ("linear", 0), ("linear", 2)])
def test_no_future_leak_in_gradients_through_the_adaptive_stop(connection, t, granularity):
    """The gradient check above with the adaptive stop firing: frozen samples / slots must pass no
    gradient to the future that keeps the batched loop going (the visible chunks stop after 1 step,
    the rewritten future runs to max_steps: checked on the rewritten run, the helper's last)."""
    layer, hp = make(causal=True, connection=connection, normalize_compression=connection == "bilinear",
                     stop_granularity=granularity, max_steps=8, threshold=0.3, connection_init_scale=0.05)
    assert_layer_gradients_causal(layer, t)
    steps, iterations = layer.last_stats.steps, layer.last_stats.iterations
    visible = t // hp.causal_chunk_size + 1
    assert int(steps[:, :visible].max()) < iterations == hp.max_steps, (steps, iterations)


def test_causal_handles_length_not_multiple_of_chunk_and_chunk_longer_than_sequence():
    for s, c in [(5, 3), (4, 16)]:
        layer, hp = make(causal=True, causal_chunk_size=c)
        x = inputs(s=s)
        y_ref, _ = ref.forward(x, weights(layer), hp)
        assert torch.allclose(layer(x), y_ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ compression scale


def test_normalised_compression_does_not_grow_with_sequence_length():
    """Read off the state the layer hands to reasoning (slots + compressed activation), so the test
    fails if the layer's division by the slot load goes."""
    def slot_activation_norm(layer, s):
        x = torch.randn(s, 1, D, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        states, reason = [], layer.reason
        layer.reason = lambda state: states.append(state.detach()) or reason(state)
        with torch.no_grad():
            layer(x)
        del layer.reason
        return float((states[0] - layer.slots).norm())

    norm_layer, _ = make(normalize_compression=True)
    raw_layer, _ = make(normalize_compression=False)
    raw_ratio = slot_activation_norm(raw_layer, 4096) / slot_activation_norm(raw_layer, 64)
    norm_ratio = slot_activation_norm(norm_layer, 4096) / slot_activation_norm(norm_layer, 64)
    assert raw_ratio > 4 and norm_ratio < 1.5, (raw_ratio, norm_ratio)


# ------------------------------------------------------------------ interpretability


def test_connection_matrix_bilinear_is_pairwise_map_norm():
    layer, _ = make()
    m = layer.connection_matrix()
    src, tgt = (t.detach() for t in layer.pair_weights())
    for i, j in itertools.product(range(4), range(4)):
        expected = 0.0 if i == j else float(torch.linalg.matrix_norm(src[i, j] @ tgt[i, j]))
        assert abs(float(m[i, j]) - expected) < 1e-10


def test_connection_matrix_linear_is_c_and_slot_loads_are_distributions():
    layer, _ = make(connection="linear")
    assert torch.equal(layer.connection_matrix(), layer.c.detach())
    loads = layer.slot_loads(inputs())
    assert loads.shape == (2, 7, 4)
    assert torch.allclose(loads.sum(-1), torch.ones(2, 7, dtype=torch.float64))


def test_layout_is_seq_batch_hidden():
    layer, _ = make(causal=True)
    x = inputs(s=7, b=3)
    y = layer(x)
    assert y.shape == (7, 3, D)
    y_b1 = layer(x[:, 1:2])  # samples are independent: the batch axis is dim 1
    assert torch.allclose(y[:, 1:2], y_b1, rtol=1e-12, atol=1e-12)


def _check_bf16_prefix_sums_are_accurate(device):
    """_cumsum / _exclusive_cumsum of 512 equal bf16 values, forward and backward, within one bf16
    rounding (2^-8 relative) of the exact sums."""
    from ascender_dist.models.connection.layer import _cumsum, _exclusive_cumsum

    value = float(torch.tensor(0.37, dtype=torch.bfloat16))
    t = torch.full((2, 512, 3), value, dtype=torch.bfloat16, device=device, requires_grad=True)
    counts = torch.arange(1, 513, dtype=torch.float64)[None, :, None]
    got = _cumsum(t, dim=1)
    assert got.dtype == torch.bfloat16
    assert float(((got.detach().double().cpu() - value * counts) / (value * counts)).abs().max()) <= 2**-8
    excl = _exclusive_cumsum(t, dim=1).detach().double().cpu()
    assert float(excl[:, 0].abs().max()) == 0.0
    assert float(((excl[:, 1:] - value * counts[:, :-1]) / (value * counts[:, :-1])).abs().max()) <= 2**-8
    got.backward(torch.ones_like(got))  # d/dt_i sum_j cumsum_j = 512 - i: a reverse prefix sum
    later = counts.flip(1)
    assert float(((t.grad.double().cpu() - later) / later).abs().max()) <= 2**-8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CPU cumsum accumulates in fp32 itself")
def test_prefix_sums_of_bf16_tensors_accumulate_in_fp32_forward_and_backward():
    """CUDA's scan keeps a bf16 running sum (the slot loads of a 128-token chunk were off by up to
    ~5%); the layer's prefix sums accumulate in fp32 and round once. The CPU kernel accumulates in
    fp32 itself, so this discriminates on a GPU only (benchmarks/gpu_check runs tests marked cuda);
    test_prefix_sums_survive_a_cumsum_that_accumulates_in_its_own_dtype is its CPU stand-in."""
    _check_bf16_prefix_sums_are_accurate("cuda")


def _scan_in_own_dtype(t, dim, *, dtype=None, out=None):
    """cumsum as CUDA's scan does it for bf16: the running sum kept in the (requested) dtype,
    rounded at every step; differentiable, so the backward's reverse sum rounds the same way."""
    assert out is None
    x = t if dtype is None else t.to(dtype)
    parts = x.unbind(dim)
    running, sums = parts[0], [parts[0]]
    for part in parts[1:]:
        running = running + part
        sums.append(running)
    return torch.stack(sums, dim)


@pytest.fixture
def cumsum_in_own_dtype(monkeypatch):
    monkeypatch.setattr(torch, "cumsum", _scan_in_own_dtype)
    monkeypatch.setattr(torch.Tensor, "cumsum", _scan_in_own_dtype)


def test_prefix_sums_survive_a_cumsum_that_accumulates_in_its_own_dtype(cumsum_in_own_dtype):
    """CPU stand-in for the CUDA test above: with torch.cumsum replaced by a step-by-step bf16 scan
    (sanity-checked to be off by far more than 2^-8), the prefix-sum helpers still meet it, which
    they can only do by accumulating in fp32 themselves."""
    value = float(torch.tensor(0.37, dtype=torch.bfloat16))
    naive = torch.full((512,), value, dtype=torch.bfloat16).cumsum(0).double()
    exact = value * torch.arange(1, 513, dtype=torch.float64)
    assert float(((naive - exact) / exact).abs().max()) > 0.1  # the fake does round in bf16
    _check_bf16_prefix_sums_are_accurate("cpu")


def test_bf16_causal_layer_is_unchanged_by_a_cumsum_that_accumulates_in_its_own_dtype(monkeypatch):
    """The whole causal layer in bf16 (normalised compression, 256-token chunks): with the bf16 scan
    its output stays within 2^-9 of the output with the CPU's fp32-accumulating cumsum (every prefix
    sum of the layer goes through fp32; measured 0 here, 7e-3 if one of them does not)."""
    layer, _ = make(dtype=torch.bfloat16, causal=True, causal_chunk_size=256, normalize_compression=True)
    x = inputs(s=512, dtype=torch.float64).bfloat16()
    with torch.no_grad():
        want = layer(x).double()
        monkeypatch.setattr(torch, "cumsum", _scan_in_own_dtype)
        monkeypatch.setattr(torch.Tensor, "cumsum", _scan_in_own_dtype)
        got = layer(x).double()
    assert float((got - want).abs().max() / want.abs().max()) <= 2**-9


# ---------------------------------------------------------------- slot state in bf16 (slots + added part)
@pytest.fixture
def split_state(monkeypatch):
    """Take the low-precision state path (slots plus an added part, ConnectionLayer._split_state) at
    any dtype: in float64 it must compute the function the reference does."""
    monkeypatch.setattr(ConnectionLayer, "_split_state", lambda self, x: True)


@pytest.mark.parametrize("causal, connection, granularity, normalize", CONFIGS)
def test_split_state_path_equals_reference_float64(split_state, causal, connection, granularity, normalize):
    layer, hp = make(causal=causal, connection=connection, stop_granularity=granularity,
                     normalize_compression=normalize)  # fmt: skip
    assert_matches_reference_float64(layer, hp)


def _bf16_and_float64_layers(connection, causal):
    """A bf16 layer at the default init (hidden 256, 32 slots) and a float64 copy of its weights."""
    hp = ConnectionHParams(num_slots=32, connection=connection, rank=4, causal=causal, causal_chunk_size=128)
    torch.manual_seed(0)
    low = ConnectionLayer(hp, 256, dtype=torch.bfloat16)
    exact = ConnectionLayer(hp, 256, dtype=torch.float64)
    exact.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    return low, exact


@pytest.mark.parametrize("connection", ["linear", "bilinear"])
def test_bf16_reasoning_keeps_the_activation_on_its_own_scale(connection):
    """The part reasoning adds to the slots, from an activation of RMS 0.02 (the default init's),
    sample by sample (each sample's difference from the mean over samples: what a token can read
    from it): kept beside the slots (elements ~1), its error is within 3x the bf16 activation's own
    (measured 1.7-2x); rounded into one bf16 state with them (the old path, checked here too) it
    was ~80x."""
    low, exact = _bf16_and_float64_layers(connection, causal=True)
    act = 0.02 * torch.randn(8, 32, 256, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    act_low = act.bfloat16()
    with torch.no_grad():
        want = exact.reason(exact.slots + act)[0] - exact.slots
        split = low.reason(act_low.float(), base=low.slots)[0].double()
        summed = low.reason(low.slots + act_low)[0].double() - exact.slots
    per_sample = lambda t: t - t.mean(0)  # noqa: E731
    err = lambda got: float((per_sample(got) - per_sample(want)).norm() / per_sample(want).norm())  # noqa: E731
    act_alone = float((per_sample(act_low.double()) - per_sample(act)).norm() / per_sample(act).norm())
    assert err(split) <= 3 * act_alone, (err(split), act_alone)
    assert err(summed) > 20 * act_alone, (err(summed), act_alone)  # the old path loses the activation


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_bf16_layer_carries_what_other_tokens_wrote_near_the_bf16_floor(causal, mode):
    """How the output at tokens >= 128 changes when only tokens < 128 change, in bf16 (weights and
    inputs, or an fp32 layer under autocast to bf16, as the HF model runs) against float64: within
    1.55x of the error of the float64 outputs rounded to bf16 (linear connection, measured 1.36x
    causal, 1.39x full on a Zen 5 EPYC; bilinear 1.42x / 1.40x; the state summed in bf16 gave
    1.83x / 1.68x, bilinear 1.94x / 1.62x; an fp32 layer under autocast took that path, 1.61x / 1.53x)."""
    low, exact = _bf16_and_float64_layers("linear", causal)
    x = torch.randn(512, 1, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    x2 = x.clone()
    x2[:128] = torch.randn(128, 1, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        y, y2 = exact(x.double()), exact(x2.double())
        want = (y - y2)[128:]
        if mode == "bf16":
            got = (low(x).double() - low(x2).double())[128:]
        else:
            wide = ConnectionLayer(low.hp, 256, dtype=torch.float32)
            wide.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = (wide(x.float()).double() - wide(x2.float()).double())[128:]
    floor = (y.bfloat16().double() - y2.bfloat16().double())[128:]
    err = lambda d: float((d - want).norm() / want.norm())  # noqa: E731
    assert err(got) <= 1.55 * err(floor), (err(got), err(floor))


def test_fp16_causal_layer_stays_finite_where_a_slot_has_almost_no_load_yet():
    """p / Z of the own-chunk mixing exceeded fp16's range when a slot had almost no load up to a
    token that still read it (sharp compression): inf, then nan where the causal mask multiplied it
    by 0, in an fp16 layer and in an fp32 layer under fp16 autocast (found by a review). The mixing
    weights are formed in fp32; the fp16 outputs now follow the fp32 layer's."""
    hp = ConnectionHParams(num_slots=8, connection="bilinear", rank=4, max_steps=2, causal=True, causal_chunk_size=8)
    torch.manual_seed(0)
    layer = ConnectionLayer(hp, 32)
    with torch.no_grad():
        layer.w_q_in.normal_(std=1.0)  # sharp compression and expansion
        layer.w_k_slots.normal_(std=1.0)
    x = torch.randn(40, 2, 32)
    with torch.no_grad():
        want = layer(x)
        half = layer.to(torch.float16)(x.half()).float()
        layer.float()
        with torch.autocast("cpu", dtype=torch.float16):
            autocast = layer(x).float()
    assert torch.isfinite(half).all() and torch.isfinite(autocast).all()
    scale = want.abs().max()
    assert (half - want).abs().max() < 2e-2 * scale and (autocast - want).abs().max() < 2e-2 * scale
