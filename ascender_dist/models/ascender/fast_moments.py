"""Row moments of the folded Alignment / Cohesion scores without the [C, s] tile: causal moment
states every MOMENT_STRIDE keys (or one global covariance), their closed-form backward, and the
per-chunk mean / variance read from them."""

from __future__ import annotations

import torch

from .common import swap_last_two

MOMENT_STRIDE = 256  # rows between two causal moment states of the fused path


def moment_chunks(n: int) -> list[tuple[int, int]]:
    return [(s0, min(s0 + MOMENT_STRIDE, n)) for s0 in range(0, n, MOMENT_STRIDE)]


def moment_state_index(c0: int, causal: bool) -> tuple[int, int]:
    """(si, s0) for a chunk starting at row c0: the moment state si holds the keys j < s0 (causal:
    the last state boundary at or before c0; bidirectional: the one global state, s0 = c0)."""
    si = c0 // MOMENT_STRIDE if causal else 0
    return si, (si * MOMENT_STRIDE if causal else c0)


def chunk_groups(chunks: list[tuple[int, int]], causal: bool, n: int) -> list[tuple[int, int, list]]:
    """Consecutive query chunks grouped (g0, g1, chunks) so that the per-row work that reads no
    tile (the Alignment block) runs once per group instead of once per chunk. Causal: chunks
    starting in one moment stride (they read the same state), while the group's [G, g1 - s0]
    moment tile stays within one chunk's [C, n] score tile; bidirectional: at most
    MOMENT_STRIDE rows (or one chunk)."""
    groups: list[tuple[int, int, list]] = []
    for c0, c1 in chunks:
        if groups:
            g0, _, members = groups[-1]
            s0 = g0 // MOMENT_STRIDE * MOMENT_STRIDE
            if causal:
                fits = c0 // MOMENT_STRIDE == g0 // MOMENT_STRIDE and 4 * (c1 - g0) * (c1 - s0) <= (c1 - c0) * n
            else:
                fits = c1 - g0 <= MOMENT_STRIDE
            if fits:
                groups[-1] = (g0, c1, members + [(c0, c1)])
                continue
        groups.append((c0, c1, [(c0, c1)]))
    return groups


def moment_states(y3: torch.Tensor, causal: bool, starts: list[int]) -> list[tuple]:
    """Moment states of the keys y3 [B, s, e] for row_moments_chunk.

    Causal: entry i holds (mean [B, 1, e], centred scatter [B, e, e]) of the keys
    j < starts[i] (() when starts[i] == 0), merged block by block (Chan et al.).
    Bidirectional: one entry, (mean, covariance) over all keys. The fused path calls it without
    autograd and differentiates it in closed form (moment_states_backward)."""
    n = y3.shape[1]
    if not causal:
        mean = y3.mean(1, keepdim=True)
        yc = y3 - mean
        return [(mean, yc.transpose(1, 2) @ yc / n)]
    states, count, mean, scatter = [], 0, None, None
    for s0, s1 in zip(starts, list(starts[1:]) + [n]):
        states.append((mean, scatter) if count else ())
        if s1 == n:
            break  # the last block feeds no state
        yb = y3[:, s0:s1]
        mb = yb.mean(1, keepdim=True)
        yc = yb - mb
        sb = yc.transpose(1, 2) @ yc
        nb = s1 - s0
        if count == 0:
            mean, scatter = mb, sb
        else:
            delta = mb - mean
            tot = count + nb
            scatter = scatter + sb + delta.transpose(1, 2) @ delta * (count * nb / tot)
            mean = mean + delta * (nb / tot)
        count += nb
    return states


def moment_states_backward(y3, states, grads: dict, causal: bool, gy3: torch.Tensor, swap: bool = False) -> None:
    """Add to gy3 [B, s, e] the gradient reaching the keys through the moment states.

    For a state over keys j < c with mean m and scatter M = sum_j (y_j - m)(y_j - m)^T:
    dL/dy_j = (G + G^T)(y_j - m) + g_m / c, with G = dL/dM, g_m = dL/dm (the path through m
    inside M vanishes: sum_j (y_j - m) = 0). Key block r feeds every state si > r, so the
    (G + G^T) and the offsets are summed from the last stride backwards: O(s e^2). swap: gy3 is
    kept in the left layout of Zr (swap_last_two), one block at a time."""
    n = y3.shape[1]
    if not grads:
        return
    if not causal:
        g_mean, g_cov = grads[0]
        mean = states[0][0]
        grad = torch.zeros_like(mean) if g_mean is None else g_mean / n
        if g_cov is not None:
            grad = torch.baddbmm(grad, y3 - mean, g_cov + g_cov.transpose(1, 2), alpha=1.0 / n)
        gy3.add_(swap_last_two(grad) if swap else grad)
        return
    acc = offset = None
    blocks = moment_chunks(n)
    for r in reversed(range(len(blocks))):
        if r + 1 in grads:
            g_mean, g_scatter = grads[r + 1]
            mean = states[r + 1][0]
            sym = g_scatter + g_scatter.transpose(1, 2) if g_scatter is not None else torch.zeros_like(states[r + 1][1])
            off = mean @ sym
            if g_mean is not None:
                off = off - g_mean / ((r + 1) * MOMENT_STRIDE)
            acc = sym if acc is None else acc + sym
            offset = off if offset is None else offset + off
        if acc is not None:
            s0, s1 = blocks[r]
            grad = torch.baddbmm(-offset, y3[:, s0:s1], acc)
            gy3[:, s0:s1] += swap_last_two(grad) if swap else grad


def row_moments_chunk(causal: bool, x, state, yb, c0: int, s0: int, saved: dict | None = None):
    """Mean and population variance over visible keys j of p_ij = x_i . y_j for query rows
    [c0, c1), without the [C, s] p: from the state of the keys j < s0 (s0 <= c0: states are
    kept every MOMENT_STRIDE rows only, so their number, each e x e, stays small at long s)
    plus the keys yb = y[s0:c1] themselves; the p are shifted by the state mean so that E[p^2] - E[p]^2 does not cancel. Returns (mean, var_pop), [b, np, C].
    saved: filled with what row_moments_backward reads."""
    if not causal:
        mean, cov = state
        if saved is not None:
            saved.update(causal=False, x=x, state=state)
        return (x * mean).sum(-1), ((x @ cov) * x).sum(-1)
    C = x.shape[-2]
    shift = state[0] if state else yb[..., :1, :]
    keys = torch.arange(s0, s0 + yb.shape[-2], device=x.device)
    vis = keys[None, :] <= torch.arange(c0, c0 + C, device=x.device)[:, None]  # [C, c1 - s0]
    yc = yb - shift
    p = (x @ yc.transpose(-1, -2)) * vis
    t1, t2 = p.sum(-1), (p * p).sum(-1)
    if state:
        t2 = t2 + ((x @ state[1]) * x).sum(-1)
    count = c0 + torch.arange(1, C + 1, dtype=x.dtype, device=x.device)
    m = t1 / count
    raw = t2 / count - m * m
    if saved is not None:
        saved.update(causal=True, x=x, state=state, shift=shift, vis=vis, yc=yc, p=p, count=count, m=m, raw=raw)
    return m + (x * shift).sum(-1), raw.clamp(min=0)


def row_moments_backward(saved: dict, g_mean, g_var):
    """Closed-form backward of row_moments_chunk (its ``saved``) for the gradients g_mean, g_var
    [b, np, C] (either may be None): (g_x [b, np, C, e], g_yb [b, np, c1 - s0, e] or None,
    g_state: () or (g_state_mean, g_state_second) shaped as the state)."""
    x, state = saved["x"], saved["state"]
    zero = torch.zeros_like(x[..., 0])
    g_mean = zero if g_mean is None else g_mean
    g_var = zero if g_var is None else g_var
    if not saved["causal"]:
        mean, cov = state
        g_x = g_mean[..., None] * mean + g_var[..., None] * (x @ (cov + cov.transpose(-1, -2)))
        g_cov = (x * g_var[..., None]).transpose(-1, -2) @ x
        return g_x, None, ((g_mean[..., None] * x).sum(-2, keepdim=True), g_cov)
    count, p, yc, shift = saved["count"], saved["p"], saved["yc"], saved["shift"]
    g_var = g_var * (saved["raw"] >= 0)  # clamp(min=0)
    g_t1 = (g_mean - 2 * saved["m"] * g_var) / count
    g_t2 = g_var / count
    g_p = (p * (2 * g_t2)[..., None]).add_(g_t1[..., None]).mul_(saved["vis"])  # [b, np, C, c1 - s0]
    g_x = g_p @ yc
    g_x.addcmul_(g_mean[..., None], shift)
    g_yb = g_p.transpose(-1, -2) @ x
    g_shift = (g_mean[..., None] * x).sum(-2, keepdim=True) - g_yb.sum(-2, keepdim=True)
    if not state:
        g_yb[..., :1, :] += g_shift
        return g_x, g_yb, ()
    second = state[1]
    g_x.addcmul_(g_t2[..., None], x @ (second + second.transpose(-1, -2)))
    return g_x, g_yb, (g_shift, (x * g_t2[..., None]).transpose(-1, -2) @ x)
