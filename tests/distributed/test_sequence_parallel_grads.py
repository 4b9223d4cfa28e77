"""Sequence parallelism's gradients against TP=1, tensor by tensor.

TP=2 with ``sequence_parallel: true`` and TP=1 loaded with TP=2's weights each run one training-loss
forward + backward (no optimizer); the loss, the gathered logits and EVERY parameter's gradient
(gathered to full shape; a replicated one is each rank's own copy, what its optimizer applies) must
agree within a tight per-tensor relative tolerance, for gpt, a llama-style model (swiglu, RMSNorm,
GQA, rope), ASCender (aux losses on, shared omega; and GQA/swiglu/post_norm with trainable lambdas),
and learned absolute positions with untied embeddings.

Why: under SP each rank applies the norms and the row-parallel biases to its own half of the
sequence, so their gradients are partial sums that a hook must add up over TP
(models.specs.norm.reduce_sequence_parallel_grads). The only other SP gradient check (the layouts
matrix) compares 3 AdamW steps, and Adam's update is blind to a constant factor on a tensor's
gradient: a lost or doubled reduction would pass it. Here a gradient off by any factor fails, and two
negative controls (one rank's copy of a norm gradient doubled; the SP reduction left out) show that
the comparison really flags such defects. Connection layers refuse SP (checked here too), so the
Connection and mixed "SC" models have no SP gradients to compare.
"""

import pytest

from tests.distributed.workers.sequence_parallel_grads import DOUBLED_PARAM, SP_MODELS, SP_REFUSED
from tests.helpers.multiproc import assert_check, run_ranks

pytestmark = pytest.mark.distributed

TOL = 1e-5  # loss (~5.5) and logits, absolute; measured <= 4.8e-7 (one float32 ulp at the loss)
# Gradients, per tensor: max |g_sp - g_ref| <= GRAD_RTOL * max |g_ref| + GRAD_ATOL. Measured (fp32, this
# launch's models): <= 7.2e-7 of the tensor's max |g| for every compared tensor, so 1e-5 leaves ~14x for
# reduction-order noise while any factor error (a lost or doubled reduction: ~0.1 to 1) fails by 10^4.
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-11  # rounding floor (as test_model_parity)
MIN_REF_GRAD = 1e-7  # every compared gradient well above the floor, so the relative part is what checks it
# Below MIN_REF_GRAD, compared against the floor only: kappa under the default pre_norm gate placement,
# an eps residue (max |g| ~7e-9, reduction order moves it by ~2e-4 of itself; see test_model_parity's
# PRE_NORM_KAPPA). ascender_llama_post_norm_sp checks kappa where it acts (max |g| >= 5e-4).
SMALL_GRADS = {"ascender_aux_shared_omega_sp": ("core_attention.params.kappa",)}
# compared tensors per model (every parameter of the model): the comparison is not over a subset
NUM_GRADS = {"gpt_sp": 27, "llama_sp": 14, "ascender_aux_shared_omega_sp": 35, "ascender_llama_post_norm_sp": 24,
             "learned_pos_untied_sp": 29}
SP_CHECKS = [f"{name}_sp" for name in SP_MODELS]


def grad_mismatches(diffs: dict) -> dict:
    """name -> (max error, max |g_ref|) of every gradient outside GRAD_RTOL (NaN too)."""
    return {name: (diff, ref) for name, (diff, ref, _, _) in diffs["grads"].items()
            if not diff <= GRAD_RTOL * ref + GRAD_ATOL}


@pytest.fixture(scope="module")
def results():
    return run_ranks("tests.distributed.workers.sequence_parallel_grads:main", world_size=2, timeout=300)


def assert_really_sequence_parallel(diffs: dict) -> None:
    """The TP=2 build ran with SP (norms saw half the sequence, parameters tagged and sharded) and
    the reference without (whole sequence)."""
    sp_build, ref_build = diffs["builds"]
    seq = diffs["seq_length"]
    assert sp_build["sequence_parallel"] and sp_build["config_sp"] and sp_build["norm_seq_lens"] == [seq // 2], sp_build
    assert not ref_build["sequence_parallel"] and not ref_build["config_sp"], ref_build
    assert ref_build["norm_seq_lens"] == [seq], ref_build
    assert sp_build["sp_tagged"] and set(sp_build["sp_tagged"]) <= set(diffs["grads"]), sp_build
    assert diffs["num_sharded"] > 0, diffs["num_sharded"]


def test_every_model_is_compared_exactly_once():
    assert sorted(SP_CHECKS) == sorted(NUM_GRADS)


@pytest.mark.parametrize("check", SP_CHECKS)
def test_sequence_parallel_loss_and_every_gradient_match_single_rank(results, check):
    per_rank = assert_check(results, check)
    assert len(per_rank) == 2
    for diffs in per_rank:
        assert_really_sequence_parallel(diffs)
        assert diffs["param_dtypes"] == ["torch.float32"], diffs["param_dtypes"]
        assert diffs["loss"] < TOL and diffs["logits"] < TOL, (diffs["loss"], diffs["logits"])
        grads = diffs["grads"]
        assert len(grads) == NUM_GRADS[check], sorted(grads)
        # non-trivial: every gradient nonzero in both layouts
        assert all(sp_norm > 0 and ref_norm > 0 for _, _, sp_norm, ref_norm in grads.values()), grads
        bad = grad_mismatches(diffs)
        assert not bad, f"SP gradients differ from TP=1 (name: (max error, max |g_ref|)): {bad}"
        exempt = SMALL_GRADS.get(check, ())
        small = {name: ref for name, (_, ref, _, _) in grads.items() if ref < MIN_REF_GRAD}
        listed = {name: ref for name, (_, ref, _, _) in grads.items() if exempt and name.endswith(exempt)}
        assert small == listed, ("gradients too small to compare, or SMALL_GRADS stale", small, listed)


@pytest.mark.parametrize("check", [f"{name}_sp_refused" for name in SP_REFUSED])
def test_connection_layers_refuse_sequence_parallelism(results, check):
    """Connection / mixed "SC" models cannot run SP at all (so there is no SP gradient to compare)."""
    for message in assert_check(results, check):
        assert message.startswith("parallel.sequence_parallel:") and "Connection" in message, message


def test_one_rank_doubling_a_replicated_norm_gradient_is_flagged(results):
    """Negative control: TP rank 1's copy of one SP norm gradient x2 after the reduction (a factor
    Adam would hide). That rank flags exactly that tensor, the other rank nothing."""
    clean, tampered = assert_check(results, "control_one_rank_norm_grad_doubled")
    assert_really_sequence_parallel(tampered)
    assert grad_mismatches(clean) == {}, grad_mismatches(clean)
    bad = grad_mismatches(tampered)
    assert set(bad) == {DOUBLED_PARAM}, bad
    diff, ref = bad[DOUBLED_PARAM]
    _, _, sp_norm, ref_norm = tampered["grads"][DOUBLED_PARAM]
    assert diff == pytest.approx(ref, rel=1e-4) and sp_norm == pytest.approx(2 * ref_norm, rel=1e-4), bad
    assert tampered["loss"] < TOL  # a gradient defect only: the forward is unchanged


def test_dropping_the_sequence_parallel_gradient_reduction_is_flagged(results):
    """Negative control: the SP hooks left out, each rank keeps its sequence half's partial gradient
    of every SP-tagged parameter (norms, row-parallel biases): on both ranks exactly those fail."""
    for diffs in assert_check(results, "control_sp_grad_reduction_dropped"):
        tagged = diffs["builds"][0]["sp_tagged"]
        # gpt: 2 layers x (2 norms x (weight, bias) + 2 row-parallel biases) + the final norm's 2
        assert len(tagged) == 14, tagged
        bad = grad_mismatches(diffs)
        assert sorted(bad) == tagged, bad
        assert min(diff / ref for diff, ref in bad.values()) > 1e-2, bad  # by far, not by rounding
