"""The fused fast path's tile workspace: one buffer per role, reused across chunks."""

import torch

from ascender_dist.models.ascender.fast_workspace import TileWorkspace, max_tile_numel


def test_a_role_reuses_its_buffer_and_roles_do_not_share():
    ws = TileWorkspace(max_numel=4 * 6 * 10, dtype=torch.float32, device=torch.device("cpu"))
    a = ws.tile("S", (4, 6, 5))
    b = ws.tile("S", (4, 6, 10))  # a later, larger chunk of the same role: same memory
    c = ws.tile("P", (4, 6, 10))
    assert a.data_ptr() == b.data_ptr()
    assert c.data_ptr() != b.data_ptr()
    assert b.shape == (4, 6, 10) and b.is_contiguous() and b.dtype == torch.float32
    assert ws.tile("mask", (4, 6, 10), torch.bool).dtype == torch.bool


def test_a_tile_larger_than_the_hint_grows_the_buffer():
    ws = TileWorkspace(max_numel=8, dtype=torch.float64, device=torch.device("cpu"))
    small = ws.tile("w", (2, 4))
    big = ws.tile("w", (3, 5))
    assert big.shape == (3, 5) and big.numel() == 15
    assert ws.tile("w", (2, 4)).data_ptr() == big.data_ptr() != small.data_ptr()


def test_max_tile_numel_is_the_largest_chunk_tile():
    chunks = [(0, 4), (4, 8), (8, 10)]
    assert max_tile_numel(chunks, n=10, batch_heads=3, causal=True) == 3 * 4 * 8
    assert max_tile_numel(chunks, n=10, batch_heads=3, causal=False) == 3 * 4 * 10
    assert max_tile_numel([], n=0, batch_heads=3, causal=True) == 0  # an empty sequence has no chunk
