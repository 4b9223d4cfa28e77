"""Causality checks shared by the layer and model tests: the gradient-side check, a token batch with
its future rewritten, and a model made bidirectional on purpose (the negative control).

The forward checks (rewrite every input after position t, the outputs at <= t stay the same) do
not see a leak that only the backward has: the fast path and the Triton kernels differentiate by
hand. So: for a loss on the outputs at positions <= t, the inputs after t must get exactly zero
gradient, and the gradients of the inputs at <= t (and of the parameters) must be bit-for-bit the
same when the inputs after t are rewritten. Exact, not approximate: masked keys contribute exact
zeros (measured 0.0 in float64 and float32 on every path), so any nonzero is a leak.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch


def rewrite_future(x: torch.Tensor, t: int, dim: int, seed: int = 3, scale: float = 5.0) -> torch.Tensor:
    """A copy of ``x`` with every position after ``t`` along ``dim`` replaced by ``scale`` x fresh
    normal values (seeded, same dtype and device)."""
    y = x.detach().clone()
    tail = y.narrow(dim, t + 1, y.shape[dim] - t - 1)
    g = torch.Generator().manual_seed(seed)
    tail.copy_(scale * torch.randn(tail.shape, generator=g, dtype=torch.float64))
    return y


def prefix_loss_grads(forward: Callable, inputs: Sequence[torch.Tensor], t: int, dim: int,
                      params: Sequence[torch.Tensor] = (), seed: int = 9):  # fmt: skip
    """Outputs and gradients of loss = sum_k <w_k, out_k[:t + 1]> (positions along ``dim``, fixed
    seeded weights w_k) over the tensors ``forward(*inputs)`` returns, with respect to fresh leaf
    copies of ``inputs`` and to ``params``. Returns (outputs detached, input grads, param grads)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    outs = forward(*leaves)
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    g = torch.Generator().manual_seed(seed)
    loss = 0
    for out in outs:
        head = out.narrow(dim, 0, t + 1)
        w = torch.randn(head.shape, generator=g, dtype=torch.float64).to(head.device, head.dtype)
        loss = loss + (head * w).sum()
    grads = torch.autograd.grad(loss, leaves + list(params), allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs], grads[: len(leaves)], grads[len(leaves):]


def assert_gradients_causal(forward: Callable, inputs: Sequence[torch.Tensor], t: int, dim: int, *,
                            names: Sequence[str] | None = None, params: Sequence[torch.Tensor] = (),
                            param_names: Sequence[str] | None = None) -> None:  # fmt: skip
    """For a loss on the outputs at positions <= t: every input's gradient after t is exactly 0
    (with the original and with a rewritten future), its gradient at <= t is nonzero (the check
    is not vacuous) and bit-for-bit unchanged by the rewritten future, and so is every parameter
    gradient. The rewritten future must change the outputs after t (else it tests nothing)."""
    names = list(names or [f"input {i}" for i in range(len(inputs))])
    param_names = list(param_names or [f"param {i}" for i in range(len(params))])
    n = inputs[0].shape[dim]
    assert 0 <= t < n - 1, (t, n)
    changed = [rewrite_future(x, t, dim, seed=3 + i) for i, x in enumerate(inputs)]
    outs_a, gin_a, gpar_a = prefix_loss_grads(forward, inputs, t, dim, params)
    outs_b, gin_b, gpar_b = prefix_loss_grads(forward, changed, t, dim, params)
    assert any(not torch.equal(a.narrow(dim, t + 1, n - t - 1), b.narrow(dim, t + 1, n - t - 1))
               for a, b in zip(outs_a, outs_b)), "the rewritten future does not reach the outputs"  # fmt: skip
    for name, ga, gb in zip(names, gin_a, gin_b):
        for which, grad in (("original", ga), ("rewritten", gb)):
            future = grad.narrow(dim, t + 1, n - t - 1)
            leak = future.abs().max().item()
            assert leak == 0, f"gradient leak: a loss on positions <= {t} reaches {name} after {t} ({which} " \
                              f"future): max |grad| {leak:.3g}"  # fmt: skip
        past_a, past_b = ga.narrow(dim, 0, t + 1), gb.narrow(dim, 0, t + 1)
        assert past_a.abs().max() > 0, f"gradient of {name} at <= {t} is zero: the check would be vacuous"
        assert torch.equal(past_a, past_b), \
            f"future leak: gradient of {name} at <= {t} changed by {(past_a - past_b).abs().max().item():.3g}"
    for name, ga, gb in zip(param_names, gpar_a, gpar_b):
        assert torch.equal(ga, gb), f"future leak: gradient of {name} changed by {(ga - gb).abs().max().item():.3g}"


def token_pair(t: int, vocab: int, length: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded [batch, length] batch of token ids and a copy with every token after position t
    replaced by another id (each one differs)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    changed = tokens.clone()
    changed[:, t + 1:] = (tokens[:, t + 1:] + 1 + torch.randint(0, vocab - 1, changed[:, t + 1:].shape,
                                                                  generator=g)) % vocab
    assert torch.all(changed[:, t + 1:] != tokens[:, t + 1:])
    return tokens, changed


def make_bidirectional(module) -> int:
    """Swap every custom layer's hparams in ``module`` for causal=False (what the config check
    refuses), so a leak check can be shown to catch it; returns how many layers were swapped."""
    from ascender_dist.models.specs.ascender import AscenderCoreAttention
    from ascender_dist.models.specs.connection import ConnectionSelfAttention

    swapped = 0
    for m in module.modules():
        if isinstance(m, AscenderCoreAttention):
            m.hp = dataclasses.replace(m.hp, causal=False)
            swapped += 1
        elif isinstance(m, ConnectionSelfAttention):
            m.layer.hp = dataclasses.replace(m.layer.hp, causal=False)
            swapped += 1
    return swapped
