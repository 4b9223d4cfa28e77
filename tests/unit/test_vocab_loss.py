"""The LM loss normalises over the tokenizer's vocabulary only: padding ids (added so TP splits the
embedding evenly) get zero probability and zero gradient, so the loss does not depend on their rows."""

import torch

from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)


def test_padding_ids_take_no_probability_mass(single_rank_group):
    from ascender_dist.models.build import vocab_cross_entropy
    from ascender_dist.parallel.setup import init_model_parallel

    init_model_parallel(1, 1, seed=0)
    vocab, padded = 500, 512
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, padded, generator=g, dtype=torch.float64).float().requires_grad_()  # [b, s, v]
    labels = torch.randint(0, vocab, (3, 5), generator=g)
    loss = vocab_cross_entropy(logits, labels, vocab)  # [b, s]
    reference = torch.nn.functional.cross_entropy(logits.detach().double()[..., :vocab].reshape(-1, vocab),
                                                  labels.reshape(-1), reduction="none").view(3, 5)
    assert (loss.double() - reference).abs().max().item() < 1e-5
    loss.sum().backward()
    assert torch.all(logits.grad[..., vocab:] == 0)
    assert logits.grad[..., :vocab].abs().sum() > 0
    shifted = logits.detach().clone()
    shifted[..., vocab:] = 1e4  # trained, zeroed or huge padding rows: the same loss
    assert torch.equal(vocab_cross_entropy(shifted, labels, vocab), loss.detach())
    unpadded = vocab_cross_entropy(logits.detach(), labels, padded)  # no padding: megatron's loss
    assert not torch.allclose(unpadded, loss.detach())


def test_bf16_logits_are_masked_in_their_fp32_copy_not_in_place(single_rank_group):
    """bf16 logits: the padding mask goes in place into the loss's own fp32 copy (one logits-sized
    tensor less at the peak); the model's bf16 logits stay as they were, the loss and its gradient
    equal those of the fp32 logits."""
    from ascender_dist.models.build import vocab_cross_entropy
    from ascender_dist.parallel.setup import init_model_parallel

    init_model_parallel(1, 1, seed=0)
    vocab, padded = 500, 512
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, padded, generator=g).to(torch.bfloat16).requires_grad_()
    before = logits.detach().clone()
    labels = torch.randint(0, vocab, (2, 4), generator=g)
    loss = vocab_cross_entropy(logits, labels, vocab)
    assert torch.equal(logits.detach(), before)
    as_fp32 = logits.detach().float().requires_grad_()
    expected = vocab_cross_entropy(as_fp32, labels, vocab)
    assert torch.equal(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    assert torch.equal(logits.grad, as_fp32.grad.to(torch.bfloat16)) and torch.all(logits.grad[..., vocab:] == 0)


def test_the_pipeline_loss_leaves_the_logits_eval_batch_returns(single_rank_group):
    """megatron's cross entropy turns fp32 logits into probabilities in place (when no padding mask
    made a copy): DeepSpeed's eval_batch(return_logits=True) returned those (found by a review). Under
    no_grad (eval_batch) the pipeline's loss works on a copy; the value is the same."""
    from ascender_dist.models.pipeline import GuardedPipelineLoss
    from ascender_dist.parallel.setup import init_model_parallel

    init_model_parallel(1, 1, seed=0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 256, generator=g)  # [s, b, v]: 256 ids, no padding
    labels = torch.randint(0, 256, (3, 5), generator=g)  # [b, s]
    kept = logits.clone()
    loss_fn = GuardedPipelineLoss(vocab_size=256)
    with torch.no_grad():
        loss = loss_fn(logits, labels)
    assert torch.equal(logits, kept)
    in_place = loss_fn(logits.clone().requires_grad_(), labels)  # training: megatron's own, in place
    assert torch.equal(loss, in_place.detach())
