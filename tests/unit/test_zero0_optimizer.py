"""The fp32 ZeRO-0 optimizer on one rank: its norm and clipping are torch's clip_grad_norm_, a
non-finite gradient skips the step, and which copies of a parameter enter the norm (the multi-rank
norms are compared with one process in tests/distributed/test_layouts.py)."""

from __future__ import annotations

import copy

import torch

from ascender_dist.training.zero0_optimizer import ClippedAdamW, counted_once
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)


def _model_with_grads(scale: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


def test_step_clips_like_torch_and_reports_the_norm(single_rank_group):
    ours, ref = _model_with_grads(3.0), _model_with_grads(3.0)
    opt = ClippedAdamW(ours.parameters(), lr=1e-2, max_norm=1.0, tp_rank=0, norm_group=None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    assert expected > 1.0  # clipping engaged
    opt.step()
    ref_opt.step()
    assert abs(opt._global_grad_norm - expected) < 1e-5 * expected and not opt.overflow
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_non_finite_gradient_skips_the_step(single_rank_group):
    model = _model_with_grads(1.0)
    before = copy.deepcopy(list(model.parameters()))
    next(model.parameters()).grad[0, 0] = float("nan")
    opt = ClippedAdamW(model.parameters(), lr=1e-2, max_norm=1.0, tp_rank=0, norm_group=None)
    opt.step()
    assert opt.overflow and opt._global_grad_norm is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_non_finite_uncounted_copy_also_skips_the_step(single_rank_group):
    model = _model_with_grads(1.0)
    replicated = model[0].bias  # not TP-partitioned: on TP rank 1 its gradient is not in the norm
    replicated.grad[0] = float("inf")
    opt = ClippedAdamW(model.parameters(), lr=1e-2, max_norm=1.0, tp_rank=1, norm_group=None)
    opt.step()
    assert opt.overflow


def test_each_gradient_counts_once():
    partitioned, replicated, tied_copy = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    partitioned.tensor_model_parallel = True
    tied_copy.ds_pipe_replicated = True  # DeepSpeed's mark on a pipeline-tied weight's non-owner copy
    assert counted_once(partitioned, tp_rank=1) and counted_once(partitioned, tp_rank=0)
    assert counted_once(replicated, tp_rank=0) and not counted_once(replicated, tp_rank=1)
    assert not counted_once(tied_copy, tp_rank=0)


def test_deepspeed_config_leaves_zero0_optimizer_and_clipping_to_the_run(tmp_path):
    from ascender_dist.config.resolve import config_from_dict, derive
    from ascender_dist.training.deepspeed_config import to_deepspeed_config

    def ds(stage):
        cfg = config_from_dict({"output_dir": str(tmp_path), "parallel": {"zero_stage": stage},
                                "model": {"vocab_size": 128}, "optimizer": {"grad_clip": 0.5}})
        return to_deepspeed_config(cfg, derive(cfg, world_size=1))

    zero0, zero1 = ds(0), ds(1)
    assert "optimizer" not in zero0 and zero0["gradient_clipping"] == 0.0
    assert zero1["optimizer"]["type"] == "AdamW" and zero1["gradient_clipping"] == 0.5
