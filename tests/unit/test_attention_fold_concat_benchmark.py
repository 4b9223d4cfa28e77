"""benchmarks/attention_fold_concat.py without timing anything: both variants of every GEMM group
compute the same numbers (so the timing compares equal work), and the net change weights the score
GEMMs twice (forward and backward's recompute) against the same round's SDPA."""

import pytest
import torch

import benchmarks.attention_fold_concat as fold


@pytest.mark.parametrize("group", list(fold.GROUPS))
def test_concatenated_operands_compute_what_the_separate_gemms_do(group):
    gemms = fold.FoldGemms(n=3 * fold.CHUNK)
    separate = [x.clone() for x in gemms.run(group, concatenated=False)]
    concatenated = gemms.run(group, concatenated=True)
    if group != "scores":  # one tensor whose column blocks are the separate results
        concatenated = list(torch.split(concatenated[0], list(fold.WIDTHS), dim=-1))
    assert len(separate) == len(concatenated)
    for a, b in zip(separate, concatenated):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)


def test_net_change_weights_each_group_by_its_runs_per_step_over_that_rounds_sdpa():
    rnd = {"sdpa": 2.0}
    for g in fold.GROUPS:
        rnd[f"{g}/separate"], rnd[f"{g}/concatenated"] = 1.0, 1.5
    # scores run twice per fwd+bwd, the two gradient groups once: (2 + 1 + 1) * 0.5 / 2
    assert fold.net_change_x_sdpa([rnd]) == [pytest.approx(1.0)]


def test_report_names_machine_commit_and_load():
    rnd = {"sdpa": 1.0, **{f"{g}/{v}": 0.1 for g in fold.GROUPS for v in ("separate", "concatenated")}}
    result = dict(n=2048, chunk=64, widths=fold.WIDTHS, rounds=[rnd] * 5, load_start=0.5, load_end=0.7, threads=1,
                  machine="Some CPU", machine_record={"logical_cpus": 2}, git_commit="b" * 40, git_dirty=False)
    text = "\n".join(fold.report(result))
    assert "Machine: Some CPU. Commit bbbbbbbbbbbb." in text and "load 0.5 / 0.7" in text
    assert "| scores: S = sum of q_part k_part^T | 2 | 100.0 | 100.0 | 1.00 | 1.00 |" in text
    assert "median +0.000, minimum +0.000" in text
