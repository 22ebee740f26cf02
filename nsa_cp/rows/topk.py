"""The routed experts' top-k reduce: ``[rows, k, ...]`` expert outputs and ``[rows, k]`` weights -> ``[rows, ...]``.

CUDA tensors go through the Triton kernel (``kernels.topk_reduce``: the expert outputs read once, no fp32
copy of them); others through ``reference.topk_reduce``. Both sum in fp32 over ``j = 0 .. k-1`` and round once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import reference

__all__ = ["topk_reduce"]


def topk_reduce(out: torch.Tensor, weights: Optional[torch.Tensor], scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * sum_j weights[:, j] * out[:, j]`` as ``[rows, *out.shape[2:]]`` in ``dtype``; ``out [rows, k, ...]``,
    ``weights [rows, k]`` or None (the experts applied them). Shapes are the caller's to check."""
    if out.is_cuda:
        from .kernels import triton_available

        if triton_available():
            from .kernels.topk_reduce import topk_reduce as kernel

            flat = out.reshape(out.shape[0], out.shape[1], math.prod(out.shape[2:]))
            if flat.shape[2] > 1 and flat.stride(2) != 1:
                flat = flat.contiguous()
            y = torch.empty((out.shape[0], *out.shape[2:]), dtype=dtype, device=out.device)
            kernel(flat, weights.contiguous() if weights is not None else None, scale, y.view(out.shape[0], flat.shape[2]))
            return y
    return reference.topk_reduce(out, weights, scale, dtype)
