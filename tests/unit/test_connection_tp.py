"""Tensor parallelism contract of ConnectionLayer, simulated with TP=2 ranks as two threads.

Each "rank" is a thread holding a shard layer; reduce/copy/gather are real collectives over a
barrier (so a rank that took a different number of reasoning steps would hang and the barrier
times out), with megatron's autograd semantics: reduce = all-reduce fwd / identity bwd, copy =
identity fwd / all-reduce bwd, gather = all-gather fwd / own slice bwd.
"""

import itertools
import threading

import pytest
import torch

from ascender_dist.models.connection import ConnectionHParams, ConnectionLayer, TP_SHARD_DIM, shard_state_dict

D, TP = 8, 2


class Group:
    """In-process collective group: every rank's tensor, summed/concatenated in rank order."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.buf = [None] * world
        self.calls = [0] * world

    def _exchange(self, rank, t):
        self.calls[rank] += 1
        self.buf[rank] = t.detach()
        self.barrier.wait()
        parts = list(self.buf)
        self.barrier.wait()  # nobody overwrites buf before everyone has read it
        return parts

    def all_reduce(self, rank, t):
        parts = self._exchange(rank, t)
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p  # same order on every rank -> bit-identical result, like NCCL
        return out

    def all_gather(self, rank, t):
        return torch.cat(self._exchange(rank, t), dim=-1)


def comm_fns(group: Group, rank: int):
    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return group.all_reduce(rank, t)

        @staticmethod
        def backward(ctx, g):
            return g

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return group.all_reduce(rank, g)

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return group.all_gather(rank, t)

        @staticmethod
        def backward(ctx, g):
            return g.chunk(group.world, dim=-1)[rank].contiguous()

    return dict(reduce_fn=Reduce.apply, copy_fn=Copy.apply, gather_fn=Gather.apply)


def run_ranks(full: ConnectionLayer, hp, x, g):
    """Run TP shard layers in threads; return per-rank (y, grads by name, x.grad, steps)."""
    group = Group(TP)
    results, errors = [None] * TP, []

    def rank_main(rank):
        try:
            torch.set_num_threads(1)
            layer = ConnectionLayer(hp, D, tp_size=TP, tp_rank=rank, dtype=x.dtype, **comm_fns(group, rank))
            layer.load_state_dict(shard_state_dict(full.state_dict(), TP, rank))
            reasoned = []  # the replicated slot states each rank reasons over (its stop reads them)
            reason = layer.reason

            def recorded(state, base=None):
                out = reason(state, base=base)
                reasoned.append(out[0].detach().clone())
                return out

            layer.reason = recorded
            xr = x.clone().requires_grad_()
            y = layer(xr)
            (y * g).sum().backward()
            grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
            results[rank] = (y.detach(), grads, xr.grad.clone(), layer.last_stats.steps.clone(), reasoned)
        except BaseException as e:  # noqa: BLE001 - surface thread failures in the test
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert group.calls[0] == group.calls[1] > 0
    return results


@pytest.mark.parametrize(  # every combination: the sharding differs per connection, stop and mode
    "causal, connection, granularity, normalize",
    list(itertools.product((False, True), ("linear", "bilinear"), ("sample", "slot"), (True, False))),
)
def test_tp2_shards_match_unsharded_layer(causal, connection, granularity, normalize):
    _check_tp2_shards_match_unsharded_layer(causal, connection, granularity, normalize)


@pytest.mark.parametrize("causal, connection", list(itertools.product((False, True), ("linear", "bilinear"))))
def test_tp2_shards_match_unsharded_layer_on_the_split_state_path(monkeypatch, causal, connection):
    """The bf16 / fp16 path (slots plus an added part: one more influence and split expansion
    collectives), taken in float64."""
    monkeypatch.setattr(ConnectionLayer, "_split_state", lambda self, x: True)
    _check_tp2_shards_match_unsharded_layer(causal, connection, "sample", True)


def _check_tp2_shards_match_unsharded_layer(causal, connection, granularity, normalize):
    hp = ConnectionHParams(num_slots=4, connection=connection, rank=4, max_steps=6, threshold=0.2,
                           stop_granularity=granularity, causal=causal, causal_chunk_size=3,
                           init_std=0.4, connection_init_scale=0.05, normalize_compression=normalize)
    torch.manual_seed(0)
    full = ConnectionLayer(hp, D, dtype=torch.float64)
    x = torch.randn(7, 2, D, dtype=torch.float64) * torch.tensor([0.1, 3.0], dtype=torch.float64)[None, :, None]
    g = torch.randn(7, 2, D, dtype=torch.float64)
    xf = x.clone().requires_grad_()
    y_full = full(xf)
    (y_full * g).sum().backward()
    full_grads = {n: p.grad for n, p in full.named_parameters()}

    ranks = run_ranks(full, hp, x, g)

    for rank, (y, grads, x_grad, steps, reasoned) in enumerate(ranks):
        # the slot states are replicated: every rank must reason over bit-identical ones (their stop
        # decisions read them); y comes out of one all-reduce, identical on the ranks by construction
        assert reasoned and all(torch.equal(a, b) for a, b in zip(reasoned, ranks[0][4], strict=True))
        assert torch.allclose(y, y_full, rtol=1e-10, atol=1e-12)
        assert torch.equal(steps, full.last_stats.steps)
        assert torch.allclose(x_grad, xf.grad, rtol=1e-9, atol=1e-12)
        for name, gr in grads.items():
            dim = TP_SHARD_DIM[name]
            expected = full_grads[name] if dim is None else full_grads[name].chunk(TP, dim)[rank]
            assert torch.allclose(gr, expected, rtol=1e-9, atol=1e-12), (rank, name)
    if granularity == "sample" and causal:
        assert len(set(full.last_stats.steps.flatten().tolist())) > 1  # stop masks were exercised


def test_sharded_layer_has_local_shapes_and_requires_comm():
    hp = ConnectionHParams(num_slots=3, rank=4)
    layer = ConnectionLayer(hp, D, tp_size=2, tp_rank=1, reduce_fn=lambda t: t, copy_fn=lambda t: t,
                            gather_fn=lambda t: t)
    assert layer.w_q_in.shape == (D, D // 2) and layer.w_v_out.shape == (D // 2, D)
    assert layer.src.shape == (3, D, 3, 2) and layer.tgt.shape == (3, 3, 2, D)  # r halved
    with pytest.raises(ValueError, match="needs reduce_fn"):
        ConnectionLayer(hp, D, tp_size=2, tp_rank=0)
