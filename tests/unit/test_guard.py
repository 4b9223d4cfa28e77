"""Bad-step guard pieces that need no training run: where collective flags live, and the pipeline
loss that poisons a bad micro-batch only when it is trained on."""

import torch
import torch.distributed as dist

from ascender_dist.models import pipeline
from ascender_dist.training import guard


def test_collective_flags_live_where_the_backend_wants_them(monkeypatch):
    """NCCL takes CUDA tensors only: a CPU flag all-reduced over NCCL raises on every GPU step."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert guard.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert guard.collective_device() == torch.device("cpu")


class AlwaysBad:
    def is_bad(self, loss: float) -> bool:
        return True


def test_pipeline_loss_is_poisoned_in_training_only(monkeypatch):
    monkeypatch.setattr(pipeline, "pipeline_loss", lambda logits, labels: logits.sum())
    loss_fn = pipeline.GuardedPipelineLoss(AlwaysBad())
    logits = torch.ones(2, requires_grad=True)
    assert torch.isnan(loss_fn(logits, None))  # the step is skipped on every rank
    with torch.no_grad():  # DeepSpeed's eval_batch: validation reports the loss as it is
        assert loss_fn(logits, None).item() == 2.0
