"""Pure-torch implementations: the oracle for the kernels, and the CPU path.

Data movement (``pack_into_slot``, ``padded_to_compact``, ``compact_to_padded``): every function has a
Triton twin in ``nsa_cp.rows.kernels`` with the same signature and the same result bit for bit. Tensors are
viewed as rows: ``[rows, row_len]`` after flattening the trailing dims. Shapes use ``P = cp_size``,
``M = max_rank_len``, ``T = total_len``.

Norm and FP8 (``fused_add_rmsnorm``, ``quant_fp8_g128``, ``dequant_fp8_g128`` and their ``*_into_slot`` forms)
follow docs/design.md's conventions ("The fused layer boundary"), written so that every step is one IEEE fp32
operation whose order a kernel can reproduce: the mean is ``sum(s^2) / H`` (the sum of squares in fp64 rounded
once to fp32, then one fp32 division; CUDA's ``mean`` multiplies by 1/H, and so does CUDA's division by a
Python scalar, so the divisors here are tensors), ``rstd = 1 / sqrt(mean + eps)`` (two correctly rounded
steps), ``y = (s * rstd) * w``. The Triton kernels in ``nsa_cp.rows.kernels.norm_rows`` follow that order; the
fp64 sum rounds to the same fp32 total in any summation order (but for ~1 row in 10^7), so they match this
oracle almost always bit for bit (see tests/kernels/test_norm_kernels.py).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..geometry.layout import ShardLayout
from ..geometry.wire import FP8_AMAX_FLOOR, FP8_E4M3_G128, FP8_GROUP, FP8_MAX, FP8_PAD_SCALE, WireFormat  # noqa: F401  re-exported

__all__ = [
    "pack_into_slot",
    "padded_to_compact",
    "compact_to_padded",
    "fused_add_rmsnorm",
    "rmsnorm_fp32",
    "fused_add_rmsnorm_into_slot",
    "fused_add_rmsnorm_quant_into_slot",
    "quant_fp8_g128",
    "dequant_fp8_g128",
    "quant_fp8_g128_into_slot",
    "quant_into_slot",
    "FP8_GROUP",
    "FP8_MAX",
    "FP8_AMAX_FLOOR",
    "FP8_PAD_SCALE",
    "topk_reduce",
]



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


# ---- norm


def rmsnorm_fp32(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``s [rows, H]`` (fp32) -> ``s * rstd * weight`` in fp32, ``rstd = 1 / sqrt(sum(s^2) / H + eps)``."""
    h = s.shape[-1]
    # the sum of squares in fp64, rounded once to fp32: exact squares, an error far below fp32's quantum, so
    # the same fp32 total whatever order a kernel (or torch) sums in (nsa_cp/rows/kernels/norm_rows.py)
    total = s.double().square().sum(dim=-1, keepdim=True).float()
    # a tensor divisor: on CUDA, torch divides by a Python scalar as a product with its reciprocal, which
    # is not the correctly rounded quotient the kernels compute (div_rn); a tensor gets a true division
    variance = total / torch.full_like(total, h)
    # sqrt in fp64, rounded to fp32: the correctly rounded fp32 square root (torch's vectorised fp32 sqrt on
    # CPU is not always; the kernels use sqrt_rn)
    rstd = 1.0 / torch.sqrt((variance + eps).double()).float()
    return (s * rstd) * weight.detach().to(torch.float32)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Add + RMSNorm over the last dim: ``(y, residual)``.

    ``s = x + residual`` in fp32; ``residual`` is overwritten IN PLACE with ``s`` rounded to its dtype
    (and returned); ``y = s * rstd * weight`` in fp32 (weight cast to fp32), rounded once to x's dtype.
    ``residual=None``: ``y = rmsnorm(x)`` and the residual returned is ``x`` itself (same tensor).
    Works on values: tensors with autograd history are read detached, nothing is recorded.
    """
    with torch.no_grad():
        s = x.detach().to(torch.float32)
        if residual is not None:
            s = s + residual.detach().to(torch.float32)
            residual.detach().copy_(s)  # one rounding to residual's dtype
        y = rmsnorm_fp32(s, weight, eps).to(x.dtype)
    return y, (x if residual is None else residual)


def fused_add_rmsnorm_into_slot(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    slot: torch.Tensor,
    n: int,
) -> None:
    """Rows ``[0, n)`` of x / residual: add + norm as ``fused_add_rmsnorm`` (residual rows updated in place),
    ``slot[:n] = y``; ``slot[n:] = 0``. Rows of x / residual from n on are not touched."""
    if n:
        y, _ = fused_add_rmsnorm(x[:n], None if residual is None else residual[:n], weight, eps)
        slot[:n].copy_(y)
    slot[n:].zero_()


# ---- FP8, per-token groups of 128 columns


def quant_fp8_g128(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, H]`` (H a multiple of 128) -> ``(q float8_e4m3fn [rows, H], scale fp32 [rows, H/128])``.

    Per row and group of 128 columns: ``amax = max(|x|)`` in fp32, clamped to >= 1e-10;
    ``scale = amax / 448``; ``q = clamp(x / scale, -448, 448)`` rounded to nearest even (the format's
    definition: nsa_cp/geometry/wire.py). Shapes are not checked here (``nsa_cp.rows.quant`` does it).
    """
    return FP8_E4M3_G128.quantize_reference(x)


def dequant_fp8_g128(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q [rows, H]``, ``scale [rows, H/128]`` -> ``q * scale`` in fp32, rounded once to ``dtype``."""
    return FP8_E4M3_G128.dequantize_reference(q, scale, dtype)


def quant_into_slot(x: torch.Tensor, q_slot: torch.Tensor, scale_slot: torch.Tensor, n: int,
                    fmt: WireFormat = FP8_E4M3_G128) -> None:
    """Quantize rows ``[0, n)`` of x into ``q_slot [M, H]`` / ``scale_slot [M, H/group]`` in the wire format
    ``fmt``; rows ``[n, M)`` get ``q = 0`` and the format's ``pad_scale`` (what quantizing a zero row gives)."""
    if n:
        q, scale = fmt.quantize_reference(x[:n])
        q_slot[:n].copy_(q)
        scale_slot[:n].copy_(scale)
    q_slot[n:].view(torch.uint8).zero_()  # +0.0 in e4m3fn is the zero byte
    scale_slot[n:].fill_(fmt.pad_scale)


quant_fp8_g128_into_slot = quant_into_slot  # the FP8 wire's name (its default format)


def fused_add_rmsnorm_quant_into_slot(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    q_slot: torch.Tensor,
    scale_slot: torch.Tensor,
    n: int,
    fmt: WireFormat = FP8_E4M3_G128,
) -> None:
    """``fused_add_rmsnorm_into_slot`` followed by the quantization ``fmt`` of y (y rounded to x's dtype first, so the
    result equals quantizing the bf16 rows a norm-then-gather would have sent)."""
    if n:
        y, _ = fused_add_rmsnorm(x[:n], None if residual is None else residual[:n], weight, eps)
        quant_into_slot(y, q_slot, scale_slot, n, fmt)
    else:
        quant_into_slot(x[:0], q_slot, scale_slot, 0, fmt)


def topk_reduce(out: torch.Tensor, weights: Optional[torch.Tensor], scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * sum_j weights[:, j] * out[:, j]`` for ``out [rows, k, ...]`` and ``weights [rows, k]`` (None:
    the terms as they are): the sum over ``j = 0 .. k-1`` in fp32 in that order, rounded once to ``dtype``
    (``[rows, ...]``). The Triton twin (``kernels.topk_reduce``) may contract each step into one FMA, so the
    two agree within fp32 rounding, not bit for bit."""
    acc = torch.zeros((out.shape[0], *out.shape[2:]), dtype=torch.float32, device=out.device)
    for j in range(out.shape[1]):
        term = out[:, j].float()
        acc += term * weights[:, j].float().view(-1, *([1] * (term.dim() - 1))) if weights is not None else term
    return (acc * scale).to(dtype)
