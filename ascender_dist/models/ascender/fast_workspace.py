"""Tile buffers reused across the query chunks of one pass of the fused fast path.

Every chunk builds a few [B, C, L] tiles (kernels, affinity, scores, probabilities and, in
backward, their gradients) and drops them before the next chunk builds its own. Allocated fresh
each time, a tile of a few MiB comes from memory that glibc hands back to the kernel on free and
the kernel faults in and zeroes again on first touch: ~70k minor faults per fwd+bwd at n = 2048,
which more than halved the rate of the GEMMs writing fresh tiles (docs/ascender.md, "Cost").
Writing each tile into the buffer of its role, allocated once per pass at the largest tile's
size, removes that cost and changes no value: the same kernels write the same numbers.

A role's buffer holds one live tile at a time: a role is requested again only after its
previous tile is dead, and a tile whose role-mate is dead takes that role (the fused path names
them: the forward's probabilities go into the kernels' buffer, the backward's affinity gradient
and row-dot products into the probabilities'). The buffers live as long as the chunk loop, one
largest tile per role: two in forward, five in backward, as many as the largest chunk held at
once before, so the peak memory is unchanged.
"""

from __future__ import annotations

import math

import torch


class TileWorkspace:
    """Per-role tile buffers of one pass (forward or backward) over the chunks of one call."""

    def __init__(self, max_numel: int, dtype: torch.dtype, device: torch.device):
        self.max_numel, self.dtype, self.device = max_numel, dtype, device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def tile(self, role: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` in the buffer of ``role``; it stays
        valid until the next request of the same role (and dtype)."""
        dtype = self.dtype if dtype is None else dtype
        numel = math.prod(shape)
        buf = self._buffers.get((role, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, self.max_numel), dtype=dtype, device=self.device)
            self._buffers[(role, dtype)] = buf
        return buf[:numel].view(shape)


def max_tile_numel(chunks: list[tuple[int, int]], n: int, batch_heads: int, causal: bool) -> int:
    """Entries of the largest [B, C, L] tile over the chunks (causal: L = the chunk's end)."""
    return max((batch_heads * (c1 - c0) * (c1 if causal else n) for c0, c1 in chunks), default=0)
