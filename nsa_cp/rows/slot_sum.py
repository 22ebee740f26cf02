"""The owner's sum of an overlapped boundary: every rank's partials of this rank's rows, in rank order.

``slots [P, M, row_len]`` (a view: slot q holds rank q's partials of this rank's rows, the first ``n`` rows
of each slot are real) -> ``[n, row_len]`` = ``sum_q slots[q, :n]`` in fp32 in rank order 0 .. P-1, plus
``add`` (the shared expert's output) in fp32, rounded once to ``dtype``: what the P2P reduce-scatter
computes for a row-independent consumer, bit for bit. CUDA tensors go through the top-k reduce's Triton
kernel (the slots as its ``k`` axis, scale 1: one pass over the slots); others through torch in the same
order.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["slot_sum"]


def slot_sum(slots: torch.Tensor, n: int, add: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``[n, row_len]`` in ``dtype``: the fp32 sum over ``slots [P, M, row_len]`` (rows ``:n``, rank order),
    plus ``add [n, row_len]`` (any float dtype) when given, rounded once. Shapes are the caller's to check."""
    size, _, row_len = slots.shape
    out = torch.empty((n, row_len), dtype=dtype, device=slots.device)
    if n == 0 or row_len == 0:
        return out
    if slots.is_cuda and slots.stride(2) == 1:
        from .kernels import triton_available

        if triton_available():
            from .kernels.topk_reduce import topk_reduce as kernel

            rows = slots.as_strided((n, size, row_len), (slots.stride(1), slots.stride(0), 1))
            kernel(rows, None, 1.0, out, add.contiguous() if add is not None else None)
            return out
    acc = torch.zeros((n, row_len), dtype=torch.float32, device=slots.device)
    for q in range(size):  # rank order, as the P2P reduce-scatter sums
        acc += slots[q, :n].float()
    if add is not None:
        acc += add.float()
    return out.copy_(acc)
