"""The FP8 quantizer's division, checked exhaustively over bf16 inputs without a GPU.

``nsa_cp.rows.kernels.exact_fp32.div_by_group_scale`` replaces the correctly rounded ``v / scale`` (``div_rn``,
per element) by the group's correctly rounded reciprocal ``r``, ``q0 = v * r`` and one remainder correction
``q0 - fma(q0, scale, -v) * r``. Its fp32 quotient may be an ulp off; what the wire carries is its
e4m3 rounding after the clamp to +-448, and that must equal the reference's (``torch``: ``v / scale``).

This emulates those fp32 steps exactly in numpy (an fp32 FMA: the product exact in fp64, the sum by an fp64
two-sum, one rounding to fp32 that honours the two-sum's error at fp32 midpoints; a quotient of fp32 values
rounded to fp64 then fp32 is correctly rounded, 53 >= 2 * 24 + 2) and compares, for every finite bf16 group
amax ``A`` (``scale = max(A, 1e-10) / 448``) and every finite bf16 ``v`` with ``|v| <= A``, both signs:

- ``corrected``: the kernel's steps; the e4m3 byte must equal the reference's in every case;
- ``uncorrected``: ``q0`` alone, which differs in a few hundred cases per binade of A (the correction is
  needed, and the check can tell).

    python3 scripts/fp8_division_check.py            # every bf16 exponent of A (minutes, numpy + torch)
    python3 scripts/fp8_division_check.py --exponents -34 0 127
"""

from __future__ import annotations

import argparse

import numpy as np

F32, F64 = np.float32, np.float64
FP32_MAX = F32(np.finfo(F32).max)


def round_to_fp32(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The fp32 nearest to ``hi + lo`` (fp64, ``|lo| <= ulp(hi) / 2``), ties to even."""
    r = hi.astype(F32)
    back = r.astype(F64)
    n = np.nextafter(r, np.where(hi > back, np.inf, -np.inf).astype(F32))
    tie = ((back + n.astype(F64)) / 2 == hi) & (hi != back)  # hi sits on an fp32 midpoint: lo decides
    return np.where(tie & (lo != 0) & (np.sign(lo) == np.sign(hi - back)), n, r)


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """fp32 ``x * y + z`` rounded once."""
    with np.errstate(all="ignore"):
        p = x.astype(F64) * y.astype(F64)  # exact: 24 + 24 bits
        zz = z.astype(F64)
        s = p + zz
        b = s - p
        err = np.where(np.isfinite(s), (p - (s - b)) + (zz - b), 0.0)
    return round_to_fp32(s, err)


def div32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fp32 ``a / b`` correctly rounded (IEEE division, what torch's CPU op and ``div_rn`` give)."""
    with np.errstate(all="ignore"):
        return (a.astype(F64) / b.astype(F64)).astype(F32)


def group_scale(amax: np.ndarray) -> np.ndarray:
    return div32(np.maximum(amax.astype(F32), F32(1e-10)), np.full(np.shape(amax), 448.0, F32))


def quotients(v: np.ndarray, scale: np.ndarray):
    """``(uncorrected, corrected)`` fp32 quotients, the kernel's steps (``div_by_group_scale``)."""
    r = div32(np.ones_like(scale), scale)
    with np.errstate(all="ignore"):
        q0 = (v * r).astype(F32)
    nrem = fma32(q0, np.minimum(scale, FP32_MAX), -v)
    return q0, fma32(nrem, -r, q0)


def e4m3_bytes(q: np.ndarray) -> np.ndarray:
    import torch

    clamped = np.minimum(np.maximum(q, F32(-448.0)), F32(448.0))
    return torch.from_numpy(np.ascontiguousarray(clamped)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def finite_bf16(max_abs=None) -> np.ndarray:
    """Every finite bf16 value v >= 0 (as fp32), or those <= max_abs."""
    v = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(F32)
    return v if max_abs is None else v[v <= max_abs]


def check_binade(exponent: int):
    """Counts over ``A = (1 + m/128) * 2^exponent`` (m = 0..127, finite bf16) and every v: ``(cases,
    uncorrected mismatches, corrected mismatches, first corrected mismatch or None, uncorrected (A, v) pairs)``."""
    cases = bad0 = bad1 = 0
    first, pairs = None, []
    for m in range(128):
        amax = F32(np.ldexp(1.0 + m / 128.0, exponent))
        if not np.isfinite(amax):
            continue
        v = finite_bf16(amax)
        v = np.concatenate([v, -v])
        scale = np.full_like(v, group_scale(np.array([amax]))[0])
        want = e4m3_bytes(div32(v, scale))
        q0, q = quotients(v, scale)
        off0, off1 = e4m3_bytes(q0) != want, e4m3_bytes(q) != want
        cases += v.size
        bad0 += int(off0.sum())
        bad1 += int(off1.sum())
        pairs += [(float(amax), float(x)) for x in v[off0][:4]]
        if off1.any() and first is None:
            first = (float(amax), float(v[off1][0]))
    return cases, bad0, bad1, first, pairs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exponents", type=int, nargs="*", default=None,
                        help="binades of the group amax to check (default: every bf16 exponent, -133..127)")
    args = parser.parse_args(argv)
    exponents = args.exponents if args.exponents is not None else range(-133, 128)
    cases = bad0 = bad1 = 0
    for e in exponents:
        c, b0, b1, first, _ = check_binade(e)
        cases, bad0, bad1 = cases + c, bad0 + b0, bad1 + b1
        if first is not None:
            print(f"corrected quotient off at amax={first[0]!r} v={first[1]!r}")
    print(f"| (amax, v) pairs | uncorrected v*(1/scale) off | corrected (the kernel's) off |\n|---|---|---|\n"
          f"| {cases} | {bad0} | {bad1} |")
    return 1 if bad1 else 0


if __name__ == "__main__":
    raise SystemExit(main())
