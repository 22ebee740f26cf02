"""Fused residual add + RMSNorm (+ FP8 per-token-group quantization) over rows, one program per row.

Mirrors ``reference.fused_add_rmsnorm`` / ``fused_add_rmsnorm_into_slot`` /
``fused_add_rmsnorm_quant_into_slot`` / ``quant_fp8_g128_into_slot``. The NCCL path of the fused layer
boundary calls the ``*_into`` forms on this rank's slot of the padded gather buffer (the collective then
runs in place); the norm after a reduce-scatter calls ``fused_add_rmsnorm`` on the local rows.

Design record:
- A program holds its whole row in registers as ``[BLOCK_G, GROUP]`` (GROUP = 128 columns, one FP8
  scale group per tile row), so the row is read once, the residual written once, and y (or q and the
  scales) written once; y is never materialised in memory on the FP8 path. Rows up to 65536 columns.
- Every arithmetic step is the reference's, in the same order and with correctly rounded fp32
  division and square root (``div_rn`` / ``sqrt_rn``; Triton's ``/`` is an approximate division on
  GPUs), each one rounded operation (no FMA contraction): ``var = fp32(sum(s^2) in fp64) / H``,
  ``rstd = 1 / sqrt(var + eps)``, ``y = (s * rstd) * w``; FP8 the wire format's (nsa_cp.geometry.wire):
  ``scale = max(amax, amax_floor) / max`` (floored, a power of two where the format says), ``q = clamp(y / scale, +-max)``.
- The sum of squares is taken in fp64 and rounded once to fp32: ``tl.sum`` adds in the order of the
  register layout the compiler picks, which differs between the plain and FP8 variants, and with an fp32
  sum their rstd differed by an fp32 ulp in some rows at H = 7168. In fp64 every square is exact, so the
  fp32 rounding is the same in any order (the reference's included) but for a sum within ~1e-15 of a
  rounding midpoint (about one row in 10^7). The FP8 path quantizes y after rounding it to x's dtype:
  the gathered ``(q, scale)`` equal ``quant_fp8_g128`` of the rows a norm-then-gather would have sent.
- bf16 and e4m3 rounding is to nearest even, once: compiled, by the casts (``CAST_ROUNDS``; the e4m3 cast
  saturates to +-448 on sm_89 on, ``CAST_SATURATES``, else a clamp first); interpreted, by ``exact_fp32.round_*``.
  bf16 rows divide by the FP8 scale with the group's reciprocal and one remainder FMA (``exact_fp32``: the
  same e4m3 bytes as ``div_rn``), since the FP8 stage is bound by instruction issue rather than by bytes
  (``scripts/norm_rows_sass.py`` counts the instructions; figures: docs/performance.md, "One GPU").
- The row count of the slot is read from a device scalar, so a CUDA graph replays with new counts;
  the grid covers the whole slot and rows ``[n, M)`` are written as padding (zeros; FP8: q = 0,
  scale = 1e-10/448). x and residual may have more rows than n (a bucket); rows from n on are not
  touched. n is clamped to ``[0, rows of x]``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...geometry.wire import FORMATS, FP8_G128, WireFormat
from . import row_checks as checks
from .exact_fp32 import COMPILED, cast_saturates, div_by_group_scale, fma_rounds_once, round_bf16, round_e4m3
from .row_checks import QUANT_MODES

__all__ = ["fused_add_rmsnorm", "fused_add_rmsnorm_into", "quant_into", "quant_fp8_g128_into", "quantize", "quant_fp8_g128",
           "QUANT_MODES"]

_GROUP = 128  # columns of a tile row without quantization (with it: the format's group)


@triton.jit
def _rows_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    scale_ptr,
    count_ptr,
    x_rows,
    eps,
    pad_scale,
    fmax,
    amax_floor,
    scale_floor,
    x_stride,
    res_stride,
    y_stride,
    q_stride,
    scale_stride,
    ROW_LEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
    POW2_SCALES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNKS: tl.constexpr,
    IS_BF16: tl.constexpr,
    CAST_ROUNDS: tl.constexpr,
    CAST_SATURATES: tl.constexpr,
    FMA_ROUNDS_ONCE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = x_rows
    if HAS_COUNT:
        n = tl.minimum(tl.maximum(tl.load(count_ptr), 0), x_rows)
    # NORM: the whole row in one tile (its sum of squares); the quantizer alone: CHUNKS tiles one after another,
    # so that no tile row is a padding group (H = 7168: 7 x 8 groups, not 64 slots for 56 groups)
    tl.static_assert(CHUNKS == 1 or not NORM)
    for c in tl.static_range(CHUNKS):
        g = c * BLOCK_G + tl.arange(0, BLOCK_G)
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        col_ok = cols < ROW_LEN
        groups_ok = g < ROW_LEN // GROUP
        if row < n:
            s = tl.load(x_ptr + row * x_stride + cols, mask=col_ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s += tl.load(res_ptr + row * res_stride + cols, mask=col_ok, other=0.0).to(tl.float32)
                rounded = s
                if IS_BF16 and not CAST_ROUNDS:
                    rounded = round_bf16(s)
                tl.store(res_ptr + row * res_stride + cols, rounded.to(res_ptr.dtype.element_ty), mask=col_ok)
            if NORM:
                # fp64: every square exact, the sum's error ~1e-15, so its fp32 rounding is the same whatever
                # order tl.sum takes (see the design record)
                s64 = s.to(tl.float64)
                total = tl.sum(s64 * s64).to(tl.float32)
                variance = tl.math.div_rn(total, tl.full([], ROW_LEN, tl.float32))
                rstd = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.math.sqrt_rn(variance + eps))
                w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                y = (s * rstd) * w
            else:
                y = s
            # one rounding to x's dtype (exact when y is x itself)
            if IS_BF16 and not CAST_ROUNDS:
                y = round_bf16(y)
            y = y.to(x_ptr.dtype.element_ty)
            if QUANT:
                yf = y.to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(yf), axis=1), amax_floor)
                scale = tl.maximum(tl.math.div_rn(amax, tl.zeros([BLOCK_G], tl.float32) + fmax), scale_floor)
                if POW2_SCALES:  # up to a power of two, exactly (nsa_cp.geometry.wire.pow2_up)
                    bits = scale.to(tl.int32, bitcast=True)
                    up = (bits + 0x7FFFFF) & -8388608
                    scale = tl.where(bits < 0x7F800000, up, bits).to(tl.float32, bitcast=True)
                if IS_BF16 and FMA_ROUNDS_ONCE:
                    q = div_by_group_scale(yf, scale)  # its e4m3 rounding is div_rn's (exact_fp32)
                else:
                    q = tl.math.div_rn(yf, scale[:, None])
                if not CAST_SATURATES:  # a saturating cast (sm_89+) clamps to +-448 itself, and keeps NaN a NaN
                    q = tl.minimum(tl.maximum(q, -fmax), fmax)
                if not CAST_ROUNDS:
                    q = round_e4m3(q)
                tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=col_ok)
                tl.store(scale_ptr + row * scale_stride + g, scale, mask=groups_ok)
            else:
                tl.store(y_ptr + row * y_stride + cols, y, mask=col_ok)
        else:
            if QUANT:
                zeros = tl.zeros([BLOCK_G, GROUP], tl.float32).to(q_ptr.dtype.element_ty)
                tl.store(q_ptr + row * q_stride + cols, zeros, mask=col_ok)
                pads = tl.zeros([BLOCK_G], tl.float32) + pad_scale
                tl.store(scale_ptr + row * scale_stride + g, pads, mask=groups_ok)
            else:
                tl.store(y_ptr + row * y_stride + cols, tl.zeros([BLOCK_G, GROUP], y_ptr.dtype.element_ty), mask=col_ok)


def _geometry(h: int, quant_group: int, norm: bool) -> Tuple[int, int, int, int]:
    """(BLOCK_G, GROUP, CHUNKS, num_warps) for rows of h elements: tiles of ``[BLOCK_G, GROUP]``, CHUNKS of them
    a row; ``quant_group``: the wire format's columns per scale (one tile row each), 0 for none. A norm holds
    its row in one tile (BLOCK_G a power of two, the last groups masked); the quantizer alone takes tiles of
    up to 1024 columns, 8 bf16 (16 bytes) a thread at 4 warps."""
    if quant_group:
        groups = h // quant_group
        if not norm:
            block_g = min(triton.next_power_of_2(groups), max(1024 // quant_group, 1))
            return block_g, quant_group, triton.cdiv(groups, block_g), 4
        block_g, group = triton.next_power_of_2(groups), quant_group
    else:
        group = min(_GROUP, triton.next_power_of_2(max(h, 1)))
        block_g = triton.next_power_of_2(triton.cdiv(max(h, 1), group))
    elements = block_g * group
    warps = 4 if elements <= 2048 else (8 if elements <= 8192 else 16)
    return block_g, group, 1, warps


def _launch(x, residual, weight, eps, y, q, scale, count, rows, fmt: Optional[WireFormat], norm: bool) -> None:
    h = x.shape[1]
    if rows == 0 or h == 0:
        return
    quant = fmt is not None
    block_g, group, chunks, warps = _geometry(h, fmt.group if quant else 0, norm)
    traits = (fmt.pad_scale, fmt.max, fmt.amax_floor, fmt.scale_floor) if quant else (0.0, 0.0, 0.0, 0.0)
    dummy = x  # pointer for absent operands; the constexpr flags keep the kernel from touching it
    if norm:
        weight = weight.detach().contiguous()  # values only: a Parameter that requires grad is read as data
    operands = [t if t is not None else dummy for t in (residual, weight if norm else None, y, q, scale, count)]
    strides = [t.stride(0) if t is not None else 0 for t in (residual, y, q, scale)]
    _rows_kernel[(rows,)](
        x, *operands, x.shape[0], float(eps), *traits, x.stride(0), *strides,
        ROW_LEN=h, HAS_RESIDUAL=residual is not None, HAS_COUNT=count is not None, NORM=norm, QUANT=quant,
        POW2_SCALES=quant and fmt.pow2_scales,
        BLOCK_G=block_g, GROUP=group, CHUNKS=chunks, IS_BF16=x.dtype == torch.bfloat16, CAST_ROUNDS=COMPILED,
        CAST_SATURATES=quant and COMPILED and cast_saturates(x.device), FMA_ROUNDS_ONCE=quant and fma_rounds_once(),
        num_warps=warps,
        enable_fp_fusion=False,  # every step one rounded fp32 operation: no FMA folds a square into a sum
    )


def _input_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def fused_add_rmsnorm_into(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    dst: torch.Tensor,
    count: torch.Tensor,
    *,
    quant: Optional[str] = None,
    dst_scale: Optional[torch.Tensor] = None,
) -> None:
    """Add + RMSNorm the first n rows of x into a slot, zeroing the slot's padding; n read on device.

    Args:
        x: ``[rows, H]`` bf16/fp16/fp32, ``rows >= n`` (rows from n on are not read).
        residual: ``[rows, H]`` like x, or None. Rows ``[0, n)`` are overwritten with ``x + residual``
            (fp32 sum rounded to the dtype); None: y = rmsnorm(x).
        weight: ``[H]`` bf16/fp16/fp32 (read as fp32; values only, autograd is not involved).
        eps: added to the mean of squares.
        dst: ``[M, H]`` slot (e.g. rank r's rows of the padded gather buffer), unit inner stride.
            quant=None: x's dtype, rows ``[0, n)`` = y, rows ``[n, M)`` = 0.
            quant="fp8_e4m3_g128": float8_e4m3fn, rows ``[0, n)`` = q of y (y rounded to x's dtype
            first), rows ``[n, M)`` = 0. y is not written anywhere.
        count: int32 one-element tensor on x's device holding n (``<= M``; clamped to ``[0, rows]``).
        quant: None or "fp8_e4m3_g128" (H a multiple of 128).
        dst_scale: with quant, fp32 ``[M, H/128]``: the group scales, ``1e-10/448`` in padding rows.
    Raises ValueError (naming the tensor and shapes) before writing anything.
    """
    h = checks.check_norm_args(x, residual, weight)
    checks.check_quant(quant, h, x)
    checks.check_count(count, x.device)
    _write_slot(_input_rows(x), residual, weight, eps, dst, dst_scale, count, quant, norm=True)


def quant_into(x: torch.Tensor, dst: torch.Tensor, dst_scale: torch.Tensor, count: torch.Tensor,
               quant: str = FP8_G128) -> None:
    """Quantize the first n rows of ``x [rows, H]`` into ``dst [M, H]`` (float8_e4m3fn) and
    ``dst_scale [M, H/128]`` (fp32); rows ``[n, M)``: q = 0, scale = 1e-10/448. n read from ``count``
    (int32 device scalar) as for ``fused_add_rmsnorm_into``; for ``cp_all_gather(x, quant=...)``."""
    h = checks.check_x(x)
    checks.check_quant(quant, h, x)
    checks.check_count(count, x.device)
    _write_slot(_input_rows(x), None, None, 0.0, dst, dst_scale, count, quant, norm=False)


quant_fp8_g128_into = quant_into  # the FP8 wire's name


def _write_slot(x, residual, weight, eps, dst, dst_scale, count, quant, norm: bool) -> None:
    h = x.shape[1]
    if dst.dim() != 2:
        raise ValueError(f"dst: expected a 2-D [M, {h}] slot, got shape {checks.shape_of(dst)}")
    m = dst.shape[0]
    if quant is None:
        checks.check_like(dst, "dst", (m, h), x.dtype, x.device)
        _launch(x, residual, weight, eps, dst, None, None, count, m, None, norm=norm)
        return
    checks.check_like(dst, "dst", (m, h), FORMATS[quant].dtype, x.device)
    fmt = FORMATS[quant]
    if dst_scale is None:
        raise ValueError(f"dst_scale: {quant} needs an fp32 [{m}, {h // fmt.group}] scale slot, got None")
    checks.check_like(dst_scale, "dst_scale", (m, h // fmt.group), torch.float32, x.device)
    _launch(x, residual, weight, eps, None, dst, dst_scale, count, m, fmt, norm=norm)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Add + RMSNorm of every row of local tensors, in place: returns ``(y, residual)``.

    ``residual [rows, H]`` is overwritten with ``x + residual``; y is written into ``out`` (``[rows, H]``,
    x's dtype) or, when out is None, into x itself (flashinfer's ``fused_add_rmsnorm`` convention: the
    norm after a reduce-scatter overwrites the reduce-scatter's output). ``residual=None``: y = rmsnorm(x)
    and the returned residual is None (the caller keeps x, which out=None overwrites).
    """
    checks.check_norm_args(x, residual, weight)
    if out is None:
        checks.check_dense(x, "x")
        y = x
    else:
        checks.check_like(out, "out", x.shape, x.dtype, x.device)
        y = out
    _launch(_input_rows(x), residual, weight, eps, y, None, None, None, x.shape[0], None, norm=True)
    return y, residual


def quantize(x: torch.Tensor, quant: str = FP8_G128) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, H]`` -> new ``(q float8_e4m3fn [rows, H], scale fp32 [rows, H/group])`` in the wire format
    ``quant`` (nsa_cp.geometry.wire), every row."""
    h = checks.check_x(x)
    checks.check_quant(quant, h, x)
    fmt, rows = FORMATS[quant], x.shape[0]
    q = torch.empty((rows, h), dtype=fmt.dtype, device=x.device)
    scale = torch.empty((rows, h // fmt.group), dtype=torch.float32, device=x.device)
    _launch(_input_rows(x), None, None, 0.0, None, q, scale, None, rows, fmt, norm=False)
    return q, scale


def quant_fp8_g128(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, "fp8_e4m3_g128")``: ``(q float8_e4m3fn [rows, H], scale fp32 [rows, H/128])``."""
    return quantize(x, FP8_G128)
