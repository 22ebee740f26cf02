"""The routed experts' top-k reduce in one pass: ``y[i] = scale * sum_j w[i, j] * out[i, j]``.

Mirrors ``reference.topk_reduce``: ``out [rows, k, row_len]`` (any float dtype) read once, the sum over
``j = 0 .. k-1`` in fp32, in that order, times ``scale``, rounded once into ``y [rows, row_len]``. The grid is
``(row blocks, column blocks)``; without weights (``HAS_W`` false: the experts applied them) the terms are
summed as they are. ``add [rows, row_len]`` (optional, any float dtype) joins the fp32 sum after the
scale, before the one rounding. The overlapped boundary's slot sum is this kernel too: ``out`` a strided
view of the reduce buffer's slots (``k`` = ranks, in rank order), no weights, scale 1, ``add`` the shared
expert's output.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["topk_reduce"]

_BLOCK_N = 1024  # columns per program: a 2 KB bf16 span, 16-byte loads across 4 warps


@triton.jit
def _topk_reduce_kernel(out_ptr, w_ptr, y_ptr, add_ptr, rows, row_len, k, scale, out_row_stride, out_k_stride,
                        w_row_stride, y_row_stride, add_row_stride, HAS_W: tl.constexpr, HAS_ADD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (r < rows)[:, None] & (c < row_len)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(k):
        v = tl.load(out_ptr + r[:, None] * out_row_stride + j * out_k_stride + c[None, :], mask=ok, other=0.0)
        if HAS_W:
            w = tl.load(w_ptr + r * w_row_stride + j, mask=r < rows, other=0.0).to(tl.float32)
            acc += v.to(tl.float32) * w[:, None]
        else:
            acc += v.to(tl.float32)
    acc = acc * scale
    if HAS_ADD:
        acc += tl.load(add_ptr + r[:, None] * add_row_stride + c[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + r[:, None] * y_row_stride + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


def topk_reduce(out: torch.Tensor, weights: Optional[torch.Tensor], scale: float, y: torch.Tensor,
                add: Optional[torch.Tensor] = None) -> None:
    """Write ``y [rows, row_len] = scale * sum_j weights[:, j] * out[:, j, :] (+ add)`` (``out [rows, k,
    row_len]`` with unit inner stride, ``weights [rows, k]`` or None, ``y`` and ``add`` rows with unit inner
    stride); arguments checked by the caller."""
    rows, k, row_len = out.shape
    if rows == 0 or row_len == 0:
        return
    block_m = 4
    grid = (triton.cdiv(rows, block_m), triton.cdiv(row_len, _BLOCK_N))
    w = weights if weights is not None else out
    _topk_reduce_kernel[grid](out, w, y, add if add is not None else y, rows, row_len, k, float(scale),
                              out.stride(0), out.stride(1), w.stride(0) if weights is not None else 0, y.stride(0),
                              add.stride(0) if add is not None else 0, HAS_W=weights is not None,
                              HAS_ADD=add is not None, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, num_warps=4)
