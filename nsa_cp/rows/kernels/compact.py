"""Convert between the padded (rank-major) and the compact layout in one launch.

Mirrors ``reference.padded_to_compact`` / ``reference.compact_to_padded``. The grid is
``(row blocks of a slot, cp_size, column blocks)``; each program reads its rank's count and offset from
device tensors, so no host sync and graph replays with new counts work. Expanding writes every row of
the padded buffer (zeros in the padding); compacting reads only real rows. ``nsa_cp._C.padded_compact``
(csrc/row_copy.cu) does the same at a fraction of the host time per launch; ``impl`` /
NSA_CP_ROW_KERNELS choose (see ``_rows.native_module``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _native
from ...geometry.layout import ShardLayout
from ._rows import as_rows, block_shape, byte_strides, native_module

__all__ = ["padded_to_compact", "compact_to_padded"]


@triton.jit
def _padded_compact_kernel(
    padded_ptr,
    compact_ptr,
    counts_ptr,
    offsets_ptr,
    slot_rows,
    row_len,
    padded_row_stride,
    compact_row_stride,
    TO_COMPACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rank = tl.program_id(1)
    pid_n = tl.program_id(2)
    n_rows = tl.load(counts_ptr + rank)
    first = tl.load(offsets_ptr + rank).to(tl.int64)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < row_len
    real = (rows < n_rows)[:, None] & col_ok[None, :]
    padded_offs = (rank * slot_rows + rows)[:, None] * padded_row_stride + cols[None, :]
    compact_offs = (first + rows)[:, None] * compact_row_stride + cols[None, :]
    if TO_COMPACT:
        values = tl.load(padded_ptr + padded_offs, mask=real)
        tl.store(compact_ptr + compact_offs, values, mask=real)
    else:
        values = tl.load(compact_ptr + compact_offs, mask=real, other=0.0)
        in_slot = (rows < slot_rows)[:, None] & col_ok[None, :]
        tl.store(padded_ptr + padded_offs, values, mask=in_slot)


def _launch(padded: torch.Tensor, compact: torch.Tensor, layout: ShardLayout, to_compact: bool, impl) -> None:
    padded_rows = as_rows(padded, "padded", writable=not to_compact)
    compact_rows = as_rows(compact, "compact", writable=to_compact)
    m = layout.max_rank_len
    row_len = padded_rows.shape[1]
    for name, t, rows in (("padded", padded_rows, layout.padded_len), ("compact", compact_rows, layout.total_len)):
        if t.shape[0] != rows:
            raise ValueError(f"{name}: expected {rows} rows for {layout!r}, got shape {list(t.shape)}")
    if m == 0 or row_len == 0:
        return
    counts, offsets = layout.device_tensors(padded.device)
    native = native_module(padded, impl)
    if native is not None:
        padded_ptr, padded_stride, _ = byte_strides(padded_rows)
        with _native.launch_device(padded.device):
            native.padded_compact(padded_ptr, padded_stride, *byte_strides(compact_rows),
                                  row_len * padded.element_size(), counts.data_ptr(), offsets.data_ptr(), m,
                                  layout.cp_size, to_compact, _native.current_stream(padded.device))
        return
    block_m, block_n, warps = block_shape(row_len, padded.element_size())
    grid = (triton.cdiv(m, block_m), layout.cp_size, triton.cdiv(row_len, block_n))
    _padded_compact_kernel[grid](
        padded_rows,
        compact_rows,
        counts,
        offsets,
        m,
        row_len,
        padded_rows.stride(0),
        compact_rows.stride(0),
        TO_COMPACT=to_compact,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )


def padded_to_compact(
    padded: torch.Tensor, layout: ShardLayout, compact: torch.Tensor, impl: Optional[str] = None
) -> None:
    """Copy the real rows of ``padded [P*M, ...]`` into ``compact [T, ...]`` (same trailing shape).
    ``impl``: "native", "triton", "auto" or None (NSA_CP_ROW_KERNELS)."""
    _launch(padded, compact, layout, True, impl)


def compact_to_padded(
    compact: torch.Tensor, layout: ShardLayout, padded: torch.Tensor, impl: Optional[str] = None
) -> None:
    """Copy ``compact [T, ...]`` into ``padded [P*M, ...]``, writing zeros to every padding row.
    ``impl`` as for ``padded_to_compact``."""
    _launch(padded, compact, layout, False, impl)
