"""Vectorised Connection Transformer layer (pure torch, tensor-parallel ready).

Replaces the self-attention sub-layer of a transformer block: input and output are megatron's
``[s, b, h]`` hidden states; residual and layer norm belong to the surrounding block.

Pipeline (D = hidden, N = slots, r = bilinear rank, c = causal chunk size):

1. compression: each token attends over the N fixed slots, ``A = softmax(x Wq (H Wk)^T / sqrt D)``
   [b, s, N]; slot activations ``A^T (x Wv)`` [b, N, D], optionally divided by the slot load
   ``sum_t A`` (weighted mean, so they do not grow with s); state ``H + activation``.
2. reasoning: up to ``max_steps`` of ``state += relu(influence(state))``, with the linear
   ``influence[j] = sum_i C[i, j] state[i]`` or the bilinear
   ``influence[j] = sum_{i != j} state[i] src[i, j] tgt[i, j]``; converged samples (or slots) are
   frozen by masks; the loop stops when all converged (one host sync per check).
3. expansion: each token attends over the reasoned slots, ``softmax(x Wq' (R Wk')^T / sqrt D) R Wv'``.

Causal mode (chunked prefix states): tokens of chunk k use the reasoned state of the prefix of
completed chunks ``< k`` for keys and values, and add the raw (un-reasoned) compression of their
own chunk's tokens ``<= t`` to the values. Reasoning runs on ``b * ceil(s / c)`` prefix states.
Cost: O(s D^2) projections + O(s N D) compression/expansion + O(s c (N + D)) own-chunk mixing +
O((s / c) * steps * N^2 D r) reasoning: linear in s for a fixed c.

Tensor parallelism (Megatron style, tp ranks, D_l = D / tp, r_l = r / tp); see ``TP_SHARD_DIM``:

* column-parallel (output features sharded, ``[D, D_l]``): ``w_q_in, w_k_slots, w_v_in, w_q_out,
  w_k_out``; row-parallel (input features sharded, ``[D_l, D]``): ``w_v_out``;
* bilinear ``src [N_src, D, N_tgt, r_l]``, ``tgt [N_tgt, N_src, r_l, D]`` (the stacked pair maps
  ``[N, N, D, r]`` / ``[N, N, r, D]`` stored in the order the batched matmuls read them, see
  ``pair_weights``) sharded along the rank r; each rank
  computes a partial influence, ``reduce_fn`` sums it, so the slot state is identical on all ranks;
* linear ``c [N, N]`` and the fixed ``slots`` buffer are replicated.

Three communication hooks (identity when tp == 1; megatron's mappings under TP):

* ``reduce_fn(t)``: forward all-reduce SUM over the TP group, backward identity
  (``reduce_from_tensor_model_parallel_region``). Applied to partial compression scores
  [b, s, N], partial bilinear influences [m, N, D] (once per step), partial expansion scores
  [b, s, N] and the partial output [b, s, D] (once per layer, like attention's output).
* ``copy_fn(t)``: forward identity, backward all-reduce SUM (``copy_to_tensor_model_parallel_region``).
  Applied to every replicated tensor right before it meets sharded weights or activations.
* ``gather_fn(t)``: all-gather along the last dim in rank order, backward keeps this rank's slice
  (``gather_from_tensor_model_parallel_region``). Applied once to the slot activations
  [b, (chunks,) N, D_l].

All stop decisions read the post-reduce state, so every rank of the group takes the same number of
steps and issues the same collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ascender_dist.config.connection_hparams import ConnectionHParams

CommFn = Callable[[Tensor], Tensor]

# Which dim of each state-dict entry is split across TP ranks (None: replicated).
TP_SHARD_DIM: dict[str, Optional[int]] = {
    "w_q_in": 1,
    "w_k_slots": 1,
    "w_v_in": 1,
    "w_q_out": 1,
    "w_k_out": 1,
    "w_v_out": 0,
    "c": None,
    "src": 3,
    "tgt": 2,
    "slots": None,
}


def _identity(t: Tensor) -> Tensor:
    return t


def make_fixed_slots(num_slots: int, hidden_size: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Deterministic orthogonal slots [N, D]: orthonormal rows scaled to norm sqrt D (per-element
    RMS 1) when N <= D; when N > D, orthonormal columns scaled the same way (per-element RMS
    sqrt(D / N), rows of unequal norm: N rows in D dims cannot be orthogonal).

    Seeded, so every TP rank (and every restart) builds the same buffer without a broadcast.
    """
    g = torch.Generator().manual_seed(seed)
    slots = torch.empty(num_slots, hidden_size, dtype=torch.float64)
    nn.init.orthogonal_(slots, generator=g)
    return (slots * math.sqrt(hidden_size)).to(dtype)


def shard_state_dict(full: dict[str, Tensor], tp_size: int, tp_rank: int) -> dict[str, Tensor]:
    """The slice of an unsharded layer's state dict that TP rank ``tp_rank`` holds."""
    out = {}
    for name, t in full.items():
        dim = TP_SHARD_DIM[name]
        out[name] = t.clone() if dim is None else t.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out


def _cumsum(t: Tensor, dim: int) -> Tensor:
    """Prefix sums along ``dim``, accumulated in fp32 for bf16 / fp16 inputs and rounded once: CUDA's
    scan keeps its running sum in the tensor's dtype (a slot load over a 128-token chunk was off by
    up to ~5% in bf16; the CPU kernel accumulates in fp32 already)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.cumsum(dim, dtype=torch.float32).to(t.dtype)
    return t.cumsum(dim)


def _exclusive_cumsum(t: Tensor, dim: int) -> Tensor:
    """Sum of the entries strictly before each index along ``dim`` (the first is exactly zero)."""
    head = torch.zeros_like(t.narrow(dim, 0, 1))
    return torch.cat([head, _cumsum(t, dim).narrow(dim, 0, t.shape[dim] - 1)], dim=dim)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """At least fp32."""
    return torch.promote_types(dtype, torch.float32)


def _softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim in at least fp32 (bf16 scores lose the small weights)."""
    return torch.softmax(scores, dim=-1, dtype=_wide(scores.dtype)).to(scores.dtype)


@dataclass
class ReasoningStats:
    """What the last forward's reasoning loop did (for TensorBoard).

    ``steps``: updates applied per reasoning state, int tensor [b] (full) or [b, chunks] (causal),
    with a trailing [N] for ``stop_granularity='slot'``. ``iterations``: loop iterations run.
    ``causal``: steps are per chunk, and the first chunk's state is the bare slots.
    """

    steps: Tensor
    iterations: int
    causal: bool = False

    def input_steps(self) -> Tensor:
        """The steps of the states that depend on the input: a causal layer's first chunk reasons from
        the bare slots, the same state for every input, so it is left out (when there are later chunks;
        tools/inspect_connection.py reports it apart)."""
        if self.causal and self.steps.shape[1] > 1:
            return self.steps[:, 1:]
        return self.steps

    def scalars(self) -> dict[str, float]:
        """Mean/max steps of the input-dependent states (input_steps) as Python floats (one host sync:
        call only when logging)."""
        s = self.input_steps().float()
        mean, top = torch.stack([s.mean(), s.max()]).tolist()  # one device-to-host copy
        return {"steps_mean": mean, "steps_max": top, "iterations": float(self.iterations)}


class ConnectionLayer(nn.Module):
    """Connection Transformer mixing layer: ``forward(hidden_states [s, b, h]) -> [s, b, h]``.

    ``tp_size``/``tp_rank`` fix the local weight shapes (see the module docstring for the layout);
    ``reduce_fn``/``copy_fn``/``gather_fn`` are the TP collectives (identity by default, required
    when ``tp_size > 1``). ``last_stats`` holds the :class:`ReasoningStats` of the last forward.
    """

    def __init__(
        self,
        hp: ConnectionHParams,
        hidden_size: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        reduce_fn: Optional[CommFn] = None,
        copy_fn: Optional[CommFn] = None,
        gather_fn: Optional[CommFn] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        hp.validate("model.connection", hidden_size, tp_size)
        if tp_size > 1 and None in (reduce_fn, copy_fn, gather_fn):
            raise ValueError("tp_size > 1 needs reduce_fn, copy_fn and gather_fn")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
        self.hp, self.hidden_size, self.tp_size, self.tp_rank = hp, hidden_size, tp_size, tp_rank
        self.reduce_fn = reduce_fn or _identity
        self.copy_fn = copy_fn or _identity
        self.gather_fn = gather_fn or _identity
        d, n, dl = hidden_size, hp.num_slots, hidden_size // tp_size
        kw = {"device": device, "dtype": dtype}
        self.register_buffer("slots", make_fixed_slots(n, d, hp.slot_seed, dtype or torch.get_default_dtype()).to(device))
        self.w_q_in = nn.Parameter(torch.empty(d, dl, **kw))
        self.w_k_slots = nn.Parameter(torch.empty(d, dl, **kw))
        self.w_v_in = nn.Parameter(torch.empty(d, dl, **kw))
        self.w_q_out = nn.Parameter(torch.empty(d, dl, **kw))
        self.w_k_out = nn.Parameter(torch.empty(d, dl, **kw))
        self.w_v_out = nn.Parameter(torch.empty(dl, d, **kw))
        if hp.connection == "linear":
            self.c = nn.Parameter(torch.empty(n, n, **kw))
        else:
            rl = hp.rank // tp_size
            self.src = nn.Parameter(torch.empty(n, d, n, rl, **kw))  # [i, D, j, r_l]
            self.tgt = nn.Parameter(torch.empty(n, n, rl, d, **kw))  # [j, i, r_l, D]
            self.register_buffer("offdiag", 1.0 - torch.eye(n, **kw), persistent=False)
        self.last_stats: Optional[ReasoningStats] = None
        self.reset_parameters()

    def init_stds(self) -> dict[str, float]:
        """The std of each parameter's normal init, in the order reset_parameters draws them: the
        projections init_std, the connection scaled so one step's influence is ~connection_init_scale
        x state (the HF model draws a parameter a checkpoint lacks with the same std)."""
        hp, d, n = self.hp, self.hidden_size, self.hp.num_slots
        stds = {name: hp.init_std for name in ("w_q_in", "w_k_slots", "w_v_in", "w_q_out", "w_k_out", "w_v_out")}
        if hp.connection == "linear":
            stds["c"] = hp.connection_init_scale / math.sqrt(n)
        else:
            stds["src"] = 1.0 / math.sqrt(d)
            stds["tgt"] = hp.connection_init_scale / math.sqrt(hp.rank * max(n - 1, 1))
        return stds

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Normal init with :meth:`init_stds`."""
        for name, std in self.init_stds().items():
            nn.init.normal_(getattr(self, name), std=std, generator=generator)

    # ------------------------------------------------------------------ pieces

    def _local_cols(self, t: Tensor) -> Tensor:
        """This rank's slice of the last (hidden) dim of a replicated tensor."""
        dl = self.hidden_size // self.tp_size
        return t[..., self.tp_rank * dl : (self.tp_rank + 1) * dl]

    def _compression_weights(self, x: Tensor) -> Tensor:
        """Token -> slot attention A [b, s, N] (replicated); x [b, s, D] already through copy_fn."""
        q = x @ self.w_q_in  # [b, s, D_l]
        k = self.slots @ self.w_k_slots  # [N, D_l]
        scores = self.reduce_fn(q @ k.T)  # [b, s, N], summed over the hidden shards
        return _softmax(scores / math.sqrt(self.hidden_size))

    def pair_weights(self) -> tuple[Tensor, Tensor]:
        """Views of the bilinear weights as the seed's pair maps: src [i, j, D, r_l], tgt [i, j, r_l, D].

        Stored as src [i, D, j, r_l] and tgt [j, i, r_l, D] so that both batched matmuls of a step
        read the parameters as plain views: the canonical [N, N, D, r] layout would need a
        weight-sized permute copy per forward (1 GiB fp32 per copy at N=64, D=1024, r=32).
        The i == j entries are stored but never used (masked in ``_influence``).
        """
        return self.src.permute(0, 2, 1, 3), self.tgt.transpose(0, 1)

    def _influence(self, h: Tensor) -> Tensor:
        """Influence [m, N, D] of all slots on all slots, identical on every TP rank.

        linear:   einsum('ij,mid->mjd', C, h)
        bilinear: sum_{i != j} (h[:, i] @ src[i, j]) @ tgt[i, j], as two bmm batched over the source
        slot i and then the target slot j; the i == j terms are zeroed on the [i, m, j, r_l]
        activation (so the diagonal weights get exactly zero gradient). Partial over r_l under
        TP, summed by reduce_fn.
        """
        if self.hp.connection == "linear":
            return torch.einsum("ij,mid->mjd", self.c, h)  # sum over source slots i
        m, n, d = h.shape
        rl = self.src.shape[-1]
        h = self.copy_fn(h)
        temp = torch.bmm(h.transpose(0, 1), self.src.view(n, d, n * rl))  # [i, m, (j r_l)]
        temp = temp.view(n, m, n, rl) * self.offdiag[:, None, :, None]  # [i, m, j, r_l], no i == j
        temp = temp.permute(2, 1, 0, 3).reshape(n, m, n * rl)  # [j, m, (i r_l)]
        partial = torch.bmm(temp, self.tgt.view(n, n * rl, d)).transpose(0, 1)  # [m, j, D], partial over r
        return self.reduce_fn(partial)

    def reason(self, state: Tensor, base: Optional[Tensor] = None) -> tuple[Tensor, Tensor, int]:
        """Adaptive reasoning on state [m, N, D]; returns (state, steps, loop iterations).

        Each iteration applies ``relu(influence)`` to the still-active samples (or slots) and
        freezes those whose update norm (over D) is <= threshold in every slot (or in that slot).
        Frozen entries are carried bit-for-bit (``torch.where``), so checking for 'all converged'
        only every ``stop_check_every`` steps changes cost, never results. The check is the only
        host sync (one per checked step); everything else stays on the device.

        ``base``: the fixed slots [N, D] when ``state`` holds only what is added to them, in a wider
        dtype (``_split_state``): the influence is linear, so base's is computed once and each step
        adds the influence of the state rounded on its own scale; returns the part added to base.
        """
        hp = self.hp
        per_slot = hp.stop_granularity == "slot"
        active = torch.ones(state.shape[:2] if per_slot else state.shape[:1], dtype=torch.bool, device=state.device)
        steps = torch.zeros(active.shape, dtype=torch.int32, device=state.device)
        base_influence = None if base is None else self._influence(base[None]).to(state.dtype)  # [1, N, D]
        every, iterations = hp.stop_check_every, 0
        for step in range(hp.max_steps):
            if step > 0 and every > 0 and step % every == 0 and not bool(active.any()):
                break  # host sync: identical on all TP ranks, since `active` is post-reduce
            if base is None:
                update = torch.relu(self._influence(state))  # [m, N, D]
            else:
                update = torch.relu(base_influence + self._influence(state.to(base.dtype)).to(state.dtype))
            keep = active[:, :, None] if per_slot else active[:, None, None]
            state = torch.where(keep, state + update, state)
            steps = steps + active.to(steps.dtype)
            moved = torch.linalg.vector_norm(update.detach(), dim=-1) > hp.threshold  # [m, N]
            active = active & (moved if per_slot else moved.any(dim=-1))
            iterations += 1
        return state, steps, iterations

    def _expansion_probs(self, x: Tensor, keys_state: Tensor, eq: str) -> Tensor:
        """Token -> reasoned-slot attention (replicated); x and keys_state through copy_fn."""
        q = x @ self.w_q_out  # [..., tokens, D_l]
        k = keys_state @ self.w_k_out  # [..., N, D_l]
        scores = self.reduce_fn(torch.einsum(eq, q, k))  # [..., tokens, N]
        return _softmax(scores / math.sqrt(self.hidden_size))

    def _expand(self, xc: Tensor, reasoned: Tensor, eq_scores: str, eq_out: str) -> tuple[Tensor, Tensor]:
        """(p, y): token -> reasoned-slot attention [..., tokens, N] and the partial output
        [..., tokens, D] read from the reasoned slots [..., N, D] (xc through copy_fn)."""
        rc = self.copy_fn(reasoned)
        p = self._expansion_probs(xc, rc, eq_scores)
        values = self._local_cols(rc) @ self.w_v_out  # [..., N, D], partial over hidden shards
        return p, torch.einsum(eq_out, self.copy_fn(p), values)

    def _expand_split(self, xc: Tensor, added: Tensor, eq_scores: str, eq_out: str) -> tuple[Tensor, Tensor]:
        """_expand of the reasoned slots ``slots + added`` (``_split_state``; added in the wider dtype)
        without ever rounding their sum: keys, values, scores and output are linear in the slots, so
        the slots' and the added part's terms are computed each in the layer's dtype and summed in the
        wider one. Returns p in the layer's dtype and the partial output in the wider one."""
        low, wide, d = self.slots.dtype, added.dtype, self.hidden_size
        ac = self.copy_fn(added.to(low))  # [..., N, D]
        hc = self.copy_fn(self.slots)  # [N, D]
        q = xc @ self.w_q_out  # [..., tokens, D_l]
        scores = torch.einsum(eq_scores, q, ac @ self.w_k_out).to(wide) + (q @ (hc @ self.w_k_out).T).to(wide)
        p = _softmax(self.reduce_fn(scores) / math.sqrt(d)).to(low)  # [..., tokens, N]
        pc = self.copy_fn(p)
        y = torch.einsum(eq_out, pc, self._local_cols(ac) @ self.w_v_out).to(wide)
        return p, y + (pc @ (self._local_cols(hc) @ self.w_v_out)).to(wide)  # [..., tokens, D], partial

    def _split_state(self, x: Tensor) -> bool:
        """Carry the slot state as the slots plus a part added to them in fp32 (``reason``'s base)?
        In bf16 / fp16, or under an autocast to them (the HF model's inference): the state adds the
        token activation (RMS ~0.02 at init) to slots of elements ~1, whose rounding (spacing
        ~0.004-0.008 in bf16) kept ~10% of the activation's precision. fp32 keeps the plain sum (the
        same function: tests/unit/test_connection_layer.py)."""
        low = (torch.bfloat16, torch.float16)
        device = x.device.type
        return x.dtype in low or (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in low)

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states [s, b, h] -> [s, b, h]; records ``last_stats``."""
        x = hidden_states.transpose(0, 1)  # [b, s, D]
        y = self._forward_causal(x) if self.hp.causal else self._forward_full(x)
        return y.transpose(0, 1)  # [s, b, D]

    def _forward_full(self, x: Tensor) -> Tensor:
        """Non-causal: every token reads the slot state of the whole sequence."""
        xc = self.copy_fn(x)
        a = self._compression_weights(xc)  # [b, s, N]
        v = xc @ self.w_v_in  # [b, s, D_l]
        act = self.gather_fn(torch.einsum("bsn,bsd->bnd", self.copy_fn(a), v))  # [b, N, D]
        if self.hp.normalize_compression:  # after the gather: the division must see replicated values
            act = act / a.sum(1).clamp_min(self.hp.compression_eps)[..., None]  # / slot load [b, N, 1]
        if self._split_state(x):
            added, steps, iters = self.reason(act.to(_wide(x.dtype)), base=self.slots)  # [b, N, D]
            _, y = self._expand_split(xc, added, "bsd,bnd->bsn", "bsn,bne->bse")  # [b, s, D], partial
            y = y.to(x.dtype)
        else:
            reasoned, steps, iters = self.reason(self.slots + act)  # [b, N, D]
            _, y = self._expand(xc, reasoned, "bsd,bnd->bsn", "bsn,bne->bse")  # [b, s, D], partial
        self.last_stats = ReasoningStats(steps=steps.detach(), iterations=iters)
        return self.reduce_fn(y)

    def _forward_causal(self, x: Tensor) -> Tensor:
        """Causal chunked form: chunk k reads reasoned prefix chunks < k plus its own raw prefix."""
        hp, d = self.hp, self.hidden_size
        b, s, _ = x.shape
        c = hp.causal_chunk_size
        nch = -(-s // c)  # number of chunks
        x = F.pad(x, (0, 0, 0, nch * c - s))  # [b, nch*c, D]; tail padding is in the future of all real tokens
        xc = self.copy_fn(x)
        a = self._compression_weights(xc).view(b, nch, c, -1)  # [b, nch, c, N]
        v = (xc @ self.w_v_in).view(b, nch, c, -1)  # [b, nch, c, D_l]
        chunk_act = torch.einsum("bkcn,bkcd->bknd", self.copy_fn(a), v)  # [b, nch, N, D_l]
        prev_act = self.gather_fn(_exclusive_cumsum(chunk_act, dim=1))  # [b, nch, N, D]: chunks < k
        prev_load = _exclusive_cumsum(a.sum(2), dim=1)  # [b, nch, N]
        if hp.normalize_compression:  # after the gather: the division must see replicated values
            prev_act = prev_act / prev_load.clamp_min(hp.compression_eps)[..., None]
        eqs = ("bkcd,bknd->bkcn", "bkcn,bkne->bkce")
        if self._split_state(x):
            added, steps, iters = self.reason(prev_act.to(_wide(x.dtype)).reshape(b * nch, hp.num_slots, d),
                                              base=self.slots)
            p, y = self._expand_split(xc.view(b, nch, c, d), added.view(b, nch, hp.num_slots, d), *eqs)
            y = (y + self._own_chunk(p, a, prev_load, v).to(y.dtype)).to(x.dtype)  # [b, nch, c, D], partial
        else:
            state = self.slots + prev_act  # [b, nch, N, D]
            reasoned, steps, iters = self.reason(state.reshape(b * nch, hp.num_slots, d))  # [b*nch, N, D]
            p, y = self._expand(xc.view(b, nch, c, d), reasoned.view(b, nch, hp.num_slots, d), *eqs)
            y = y + self._own_chunk(p, a, prev_load, v)  # [b, nch, c, D], partial
        self.last_stats = ReasoningStats(steps=steps.detach().view(b, nch, *steps.shape[1:]), iterations=iters,
                                         causal=True)
        return self.reduce_fn(y).reshape(b, nch * c, d)[:, :s]  # [b, s, D]

    def _own_chunk(self, p: Tensor, a: Tensor, prev_load: Tensor, v: Tensor) -> Tensor:
        """Values from a token's own chunk, tokens t' <= t, as if added raw to the slot state.

        Token t reads ``sum_n p[t, n] U_t[n] / Z_t[n]`` with ``U_t = sum_{t' <= t} a[t', n] v[t']``;
        rewritten as a [c, c] causal mixing ``M[t, t'] = sum_n p[t, n] a[t', n] / Z_t[n]`` applied
        to v, costing O(s c (N + D)) instead of materialising [s, N, D]. ``Z_t`` is the slot load of
        the prefix up to t when normalising (weighted mean), else 1.
        p, a: [b, nch, c, N]; prev_load: [b, nch, N]; v: [b, nch, c, D_l]. Returns partial [b, nch, c, D].
        """
        c = p.shape[2]
        wide = _wide(p.dtype)
        # in at least fp32 with autocast off: p / Z exceeds fp16's range where a slot has almost no
        # load yet (inf, then nan where the mask multiplies it by 0); the causal entries of mix are
        # at most 1, so it is cast back for the product with v
        with torch.autocast(device_type=p.device.type, enabled=False):
            p, a = p.to(wide), a.to(wide)
            w = p
            if self.hp.normalize_compression:
                z = prev_load.to(wide)[:, :, None, :] + _cumsum(a, dim=2)  # [b, nch, c, N]: load up to t
                w = p / z.clamp_min(self.hp.compression_eps)
            mix = torch.einsum("bkcn,bkun->bkcu", w, a)  # [b, nch, c, c]
            causal = torch.ones(c, c, dtype=torch.bool, device=p.device).tril()
            # exact zeros: a finite future token adds exactly nothing (an inf in a future v still makes
            # 0 * inf = nan in mix @ v, as in any masked attention's eager path)
            mix = mix.masked_fill(~causal, 0.0)
        return (self.copy_fn(mix.to(v.dtype)) @ v) @ self.w_v_out  # [b, nch, c, D_l] @ [D_l, D]

    # ------------------------------------------------------------------ interpretability

    @torch.no_grad()
    def connection_matrix(self) -> Tensor:
        """[N, N] learned slot-to-slot connection: entry [i, j] is slot i's influence on slot j.

        Linear: C itself. Bilinear: the Frobenius norm of the pair's D x D map ``src[i,j] tgt[i,j]``
        (via r x r Gram matrices, O(N^2 D r^2)); the diagonal is 0. Needs the unsharded weights.
        """
        if self.hp.connection == "linear":
            return self.c.detach().clone()
        if self.tp_size > 1:
            raise NotImplementedError("connection_matrix needs the unsharded bilinear weights (tp_size == 1)")
        src, tgt = self.pair_weights()  # [i, j, D, r], [i, j, r, D]
        gs = torch.einsum("ijdk,ijdl->ijkl", src, src)  # [N, N, r, r] = src^T src
        gt = torch.einsum("ijke,ijle->ijkl", tgt, tgt)  # [N, N, r, r] = tgt tgt^T
        sq = (gs * gt).sum(dim=(-1, -2)).clamp_min(0)  # ||src tgt||_F^2 = tr(src^T src tgt tgt^T)
        return sq.sqrt() * self.offdiag

    @torch.no_grad()
    def slot_loads(self, hidden_states: Tensor) -> Tensor:
        """Which tokens load on which slot: compression weights [b, s, N] (rows sum to 1).

        Sum over s for per-slot totals. A collective under TP: call on every rank.
        """
        x = hidden_states.transpose(0, 1)  # [b, s, D]
        return self._compression_weights(x)
