"""Shared launch geometry for the row-copy kernels: tensors are ``[rows, row_len]`` with unit inner stride."""

from __future__ import annotations

import math

import torch
import triton

_CHUNK_BYTES = 4096  # one program's span along a row: 16-byte vectors for a whole warp group
_PROGRAM_BYTES = 16384  # bytes one program moves: enough loads in flight, small enough grids stay wide


def as_rows(t: torch.Tensor, name: str, writable: bool) -> torch.Tensor:
    """View ``t [rows, ...]`` as ``[rows, row_len]``; inputs may be copied, outputs must be views."""
    if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1):
        return t
    rows = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    dense = rows.shape[1] <= 1 or rows.stride(1) == 1
    if not dense:
        rows = rows.contiguous()
    if writable and t.numel() > 0 and (rows.data_ptr() != t.data_ptr() or not dense):
        raise ValueError(f"{name}: trailing dims must be dense to write in place, got strides {tuple(t.stride())}")
    return rows


def block_shape(row_len: int, element_size: int):
    """(BLOCK_M, BLOCK_N, num_warps) for a row-copy kernel."""
    block_n = max(16, min(triton.next_power_of_2(max(row_len, 1)), _CHUNK_BYTES // element_size))
    block_m = max(1, _PROGRAM_BYTES // (block_n * element_size))
    return block_m, block_n, 4
