"""Slow, obviously-right reference of the Connection Transformer layer (tests only).

A direct transcription of the seed's pseudocode, one sample (and, causally, one token) at a
time, with the corrections from the design note:

* linear connection over the SLOT axis: ``influence[j] = sum_i C[i, j] * H[i]`` (no N == D);
* bilinear connection as the seed's Python double loop over slot pairs ``i != j``;
* the seed's stop rule per sample: apply the ReLU update, stop once no slot moved by more than
  ``threshold`` (or after ``max_steps``); ``stop_granularity='slot'`` freezes each slot alone;
* compression by cross-attention of tokens onto the N fixed slots, optionally normalised by the
  slot load (a weighted mean over tokens), and expansion by cross-attention of tokens onto the
  reasoned slots;
* causal: token t of chunk k reads the reasoned state of the prefix ``tokens[: k * c]`` for the
  expansion keys and values, plus the raw (un-reasoned) compression of its own chunk's tokens
  ``k * c .. t`` added to the values.

Weights are a dict of FULL (unsharded) tensors named as the layer's state dict: projections are
[D_in, D_out] and applied as ``x @ W``; ``c`` [N, N]; ``src`` [N, N, D, r]; ``tgt`` [N, N, r, D];
``slots`` [N, D].
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ascender_dist.config.connection_hparams import ConnectionHParams


def weights_from_layer(layer) -> dict[str, Tensor]:
    """The layer's parameters in the reference's layout (views: gradients reach the layer).

    The layer stores the bilinear maps as src [i, D, j, r] / tgt [j, i, r, D] for its batched
    matmuls; the reference reads the seed's [i, j, D, r] / [i, j, r, D].
    """
    w = {**dict(layer.named_parameters()), "slots": layer.slots}
    if "src" in w:
        w["src"], w["tgt"] = layer.pair_weights()
    return w


def token_slot_weights(x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Seed step 1 for one sample x [S, D]: attention of each token over the slots, and values."""
    d = x.shape[-1]
    q = x @ w["w_q_in"]  # [S, D]
    k = w["slots"] @ w["w_k_slots"]  # [N, D]
    v = x @ w["w_v_in"]  # [S, D]
    a = torch.softmax(q @ k.T / math.sqrt(d), dim=-1)  # [S, N]: token -> slot weights
    return a, v


def compress(x: Tensor, w: dict[str, Tensor], hp: ConnectionHParams) -> tuple[Tensor, Tensor]:
    """Initial slot state H + A^T V for one sample x [S, D] (S may be 0); also the slot loads."""
    a, v = token_slot_weights(x, w)
    act = a.T @ v  # [N, D]: sum over tokens
    load = a.sum(0)  # [N]
    if hp.normalize_compression:
        act = act / load.clamp_min(hp.compression_eps)[:, None]
    return w["slots"] + act, load


def influence(h: Tensor, w: dict[str, Tensor], hp: ConnectionHParams) -> Tensor:
    """Influence of every slot on every other, slot by slot, for one sample h [N, D]."""
    n = h.shape[0]
    out = [torch.zeros_like(h[0]) for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if hp.connection == "linear":
                out[j] = out[j] + w["c"][i, j] * h[i]  # C[i, j]: influence of slot i on slot j
            elif i != j:
                temp = h[i] @ w["src"][i, j]  # [D] -> [r]
                out[j] = out[j] + temp @ w["tgt"][i, j]  # [r] -> [D]
    return torch.stack(out)  # [N, D]


def reason(h: Tensor, w: dict[str, Tensor], hp: ConnectionHParams) -> tuple[Tensor, list[int]]:
    """The seed's reasoning loop for one sample h [N, D]; returns the state and steps taken.

    'sample': one step count for the sample. 'slot': one per slot; a slot whose update norm was
    <= threshold is frozen afterwards, while still influencing the others.
    """
    n = h.shape[0]
    if hp.stop_granularity == "sample":
        steps = 0
        for _ in range(hp.max_steps):
            update = torch.relu(influence(h, w, hp))
            h = h + update
            steps += 1
            if not bool((torch.linalg.vector_norm(update, dim=-1) > hp.threshold).any()):
                break
        return h, [steps]
    frozen = [False] * n
    steps = [0] * n
    for _ in range(hp.max_steps):
        update = torch.relu(influence(h, w, hp))
        rows = []
        for j in range(n):
            if frozen[j]:
                rows.append(h[j])
                continue
            rows.append(h[j] + update[j])
            steps[j] += 1
            if float(torch.linalg.vector_norm(update[j].detach())) <= hp.threshold:
                frozen[j] = True
        h = torch.stack(rows)
        if all(frozen):
            break
    return h, steps


def expand_token(x_t: Tensor, key_state: Tensor, value_state: Tensor, w: dict[str, Tensor]) -> Tensor:
    """Seed step 3 for one token x_t [D] reading slot states [N, D]; returns [D]."""
    d = x_t.shape[-1]
    q = x_t @ w["w_q_out"]  # [D]
    k = key_state @ w["w_k_out"]  # [N, D]
    v = value_state @ w["w_v_out"]  # [N, D]
    p = torch.softmax(q @ k.T / math.sqrt(d), dim=-1)  # [N]
    return p @ v  # [D]


def forward_full(x: Tensor, w: dict[str, Tensor], hp: ConnectionHParams) -> tuple[Tensor, list[list[int]]]:
    """Non-causal layer on x [S, B, D] -> ([S, B, D], steps per sample)."""
    outs, steps = [], []
    for b in range(x.shape[1]):
        xb = x[:, b]  # [S, D]
        state, _ = compress(xb, w, hp)
        reasoned, st = reason(state, w, hp)
        outs.append(torch.stack([expand_token(xb[t], reasoned, reasoned, w) for t in range(xb.shape[0])]))
        steps.append(st)
    return torch.stack(outs, dim=1), steps  # [S, B, D]


def forward_causal(x: Tensor, w: dict[str, Tensor], hp: ConnectionHParams) -> tuple[Tensor, list[list[list[int]]]]:
    """Causal layer on x [S, B, D] -> ([S, B, D], steps per sample per chunk), token by token."""
    c = hp.causal_chunk_size
    outs, steps = [], []
    for b in range(x.shape[1]):
        xb = x[:, b]  # [S, D]
        a, v = token_slot_weights(xb, w)  # [S, N], [S, D]; a token's weights depend on it alone
        reasoned_by_chunk, steps_b, rows = {}, [], []
        for t in range(xb.shape[0]):
            k = t // c
            start = k * c
            if k not in reasoned_by_chunk:
                state, _ = compress(xb[:start], w, hp)  # completed chunks only
                reasoned_by_chunk[k], st = reason(state, w, hp)
                steps_b.append(st)
            _, prefix_load = compress(xb[:start], w, hp)
            own = a[start : t + 1].T @ v[start : t + 1]  # [N, D]: own chunk up to t, raw
            if hp.normalize_compression:
                own_load = prefix_load + a[start : t + 1].sum(0)  # [N]
                own = own / own_load.clamp_min(hp.compression_eps)[:, None]
            reasoned = reasoned_by_chunk[k]
            rows.append(expand_token(xb[t], reasoned, reasoned + own, w))
        outs.append(torch.stack(rows))
        steps.append(steps_b)
    return torch.stack(outs, dim=1), steps  # [S, B, D]


def forward(x: Tensor, w: dict[str, Tensor], hp: ConnectionHParams):
    """Reference layer on megatron-layout x [S, B, D]; returns (y [S, B, D], steps)."""
    return forward_causal(x, w, hp) if hp.causal else forward_full(x, w, hp)
