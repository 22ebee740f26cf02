"""Pure-torch implementations of the data movement: the oracle for the kernels, and the CPU path.

Every function here has a Triton twin in ``nsa_cp.kernels`` with the same signature and the same
result bit for bit (they only move data). Tensors are viewed as rows: ``[rows, row_len]`` after
flattening the trailing dims. Shapes use ``P = cp_size``, ``M = max_rank_len``, ``T = total_len``.
"""

from __future__ import annotations

import torch

from .layout import ShardLayout

__all__ = ["pack_into_slot", "padded_to_compact", "compact_to_padded"]


def pack_into_slot(x: torch.Tensor, slot: torch.Tensor) -> None:
    """Write ``x [n, ...]`` into ``slot [M, ...]`` (``n <= M``): rows ``[0, n)`` = x, rows ``[n, M)`` = 0."""
    n = x.shape[0]
    slot[:n].copy_(x)
    slot[n:].zero_()


def padded_to_compact(padded: torch.Tensor, layout: ShardLayout, compact: torch.Tensor) -> None:
    """Copy the real rows of ``padded [P*M, ...]`` into ``compact [T, ...]``."""
    for rank in range(layout.cp_size):
        src_start, src_stop = layout.rows(rank, compact=False)
        dst_start, dst_stop = layout.rows(rank, compact=True)
        compact[dst_start:dst_stop].copy_(padded[src_start:src_stop])


def compact_to_padded(compact: torch.Tensor, layout: ShardLayout, padded: torch.Tensor) -> None:
    """Copy ``compact [T, ...]`` into ``padded [P*M, ...]``, zeroing every padding row."""
    for rank in range(layout.cp_size):
        src_start, src_stop = layout.rows(rank, compact=True)
        slot = padded[rank * layout.max_rank_len : (rank + 1) * layout.max_rank_len]
        pack_into_slot(compact[src_start:src_stop], slot)
