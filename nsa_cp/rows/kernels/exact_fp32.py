"""Triton helpers that round exactly as torch's CPU ops do (``nsa_cp.rows.reference``), for ``norm_rows``.

- ``round_bf16`` / ``round_e4m3``: fp32 -> the nearest bf16 / float8_e4m3fn value (ties to even), still as
  fp32. Under Triton's interpreter a cast rounds ties away (and drops a rounded-up mantissa's carry); after
  these its cast is exact. A compiled kernel's casts already round to nearest even and skip them.
- ``cast_saturates``: whether a compiled fp32 -> e4m3 cast clamps to +-448 itself on a device;
  ``fma_rounds_once``: whether ``tl.fma`` is one rounding where kernels run (compiled: always; Triton 3.6's
  interpreter multiplies and adds in fp32, two roundings, and a kernel then keeps ``div_rn``).
- ``div_by_group_scale``: ``v / scale`` for bf16 values ``v [G, GROUP]`` and one FP8 group scale per row
  ``scale [G]``, with the group's correctly rounded reciprocal and one remainder correction per element
  instead of a correctly rounded division per element (``div_rn``: a longer sequence, with a check and a
  branch; counts in docs/performance.md). Its fp32 quotient may differ from ``div_rn``'s by an ulp, never
  its e4m3 rounding after the clamp to +-448: checked exhaustively over every finite bf16 value against
  every finite bf16 group amax (``scripts/fp8_division_check.py``; tests/kernels/test_fp8_division.py
  holds the argument and the cases where the uncorrected product ``v * (1/scale)`` rounds differently).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["round_bf16", "round_e4m3", "div_by_group_scale", "cast_saturates", "fma_rounds_once", "COMPILED"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite fp32


@triton.jit
def round_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def round_e4m3(v):
    """fp32 with |v| <= 448 -> the nearest float8_e4m3fn value (ties to even), as fp32.
    Adding ``C = 1.5 * 2^(k + 23)`` rounds v to a multiple of 2^k (IEEE round-to-nearest-even), subtracting C
    is exact; k is v's quantum in e4m3: 2^(e - 3) for normals (e >= -6), 2^-9 below (subnormals)."""
    v_bits = v.to(tl.uint32, bitcast=True)
    mag = (v_bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    e = ((v_bits >> 23) & 0xFF).to(tl.int32) - 127
    k = tl.maximum(e, -6) - 3
    c = (((k + 23 + 127) << 23) | (1 << 22)).to(tl.uint32).to(tl.float32, bitcast=True)
    rounded = (mag + c) - c
    # the sign bit back on (a negative value that rounds to zero stays -0, as in torch's conversion)
    return (rounded.to(tl.uint32, bitcast=True) | (v_bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def div_by_group_scale(v, scale):
    """``v [G, GROUP]`` (fp32 holding bf16 values) / ``scale [G]`` (> 0, or inf, or NaN) -> fp32 ``[G, GROUP]``
    within an ulp of ``v / scale``, whose e4m3 rounding after the clamp to +-448 is ``div_rn``'s.

    ``r = 1/scale`` correctly rounded; ``q0 = v * r``; the negated remainder ``scale * q0 - v`` is exact in
    one FMA (no underflow where the quotient is not far below e4m3's range); ``q0 - nrem * r`` is then
    within an ulp of ``v / scale``. Negated, so that v = -0 gives -0 as a division does (``nrem`` = +0, and
    ``+0 * -r + -0`` is -0), with no instruction for the sign. An infinite scale (an inf in the group) enters
    the remainder as the largest float: finite v -> +-0, as ``v / inf``."""
    # Negations as ``* -1.0``: exact, and ptxas folds it into the FMA. Never ``-x``: Triton 3.6 lowers it to
    # ``0 - x``, an extra instruction that also gives +0 for x = +0; r is +0 where the scale is inf, so ``-r``
    # would turn every negative value's e4m3 byte into +0 instead of -0 (tests/kernels/test_fp8_division.py).
    r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q0 = v * r[:, None]
    nrem = tl.fma(q0, tl.minimum(scale, _FP32_MAX)[:, None], v * -1.0)
    return tl.fma(nrem, (r * -1.0)[:, None], q0)


@functools.lru_cache(maxsize=None)
def cast_saturates(device: torch.device) -> bool:
    """Whether Triton's compiled fp32 -> e4m3 cast on this device saturates to +-448 (PTX
    ``cvt.rn.satfinite``, NVIDIA sm_89 on) and keeps a NaN a NaN; elsewhere a kernel clamps first."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _fma_probe(x_ptr, c_ptr, out_ptr):
    v = tl.load(x_ptr)
    tl.store(out_ptr, tl.fma(v, v, tl.load(c_ptr)))


COMPILED = type(_fma_probe).__name__ != "InterpretedFunction"  # TRITON_INTERPRET=1: kernels run on CPU tensors


@functools.lru_cache(maxsize=None)
def fma_rounds_once() -> bool:
    """``(1 + 2^-12)^2 - (1 + 2^-11)`` is exactly ``2^-24`` in one rounding, 0 in two (the square's fp32
    rounding is a tie to even)."""
    if COMPILED:
        return True
    x, c, out = torch.tensor([1 + 2.0**-12]), torch.tensor([-(1 + 2.0**-11)]), torch.empty(1)
    _fma_probe[(1,)](x, c, out)
    return out.item() == 2.0**-24
