"""The FP8 quantizer's division (``nsa_cp.rows.kernels.exact_fp32.div_by_group_scale``): a reciprocal per group
and one remainder correction per element instead of ``div_rn`` per element, with the same e4m3 bytes.

Why it holds. ``r = RN(1/scale)`` and ``q0 = RN(v * r)`` put q0 within 1.5 fp32 ulps of ``v / scale``. The
remainder ``v - scale * q0`` is exact in one FMA (Boldo-Daumas) while it does not underflow, and then
``q0 + rem * r`` is within ``1.5 * 2^-24`` ulps of ``v / scale`` before its rounding: the fp32 result is the
correctly rounded quotient or a neighbour next to a midpoint, and the e4m3 rounding (3 mantissa bits) cannot
tell them apart unless ``v / scale`` is within an fp32 ulp of an e4m3 midpoint. bf16 inputs are few enough to
settle that by enumeration (scripts/fp8_division_check.py: every finite bf16 amax and value; here a few
binades, and the kernel on the cases that need the correction). A remainder that underflows needs
``|v| < 2^-102``, where ``|v / scale| < 2^-60`` rounds to e4m3's +-0 whatever the ulp. The remainder is taken
negated (``q0 - fma(q0, scale, -v) * r``), so that -0 stays -0.

Checks: the emulation against exact rationals (FMAs at fp32 midpoints included); the emulated steps against
the reference over whole binades (they agree everywhere, the uncorrected product does not); the kernel
(interpreted on CPU, compiled on a GPU) against ``reference.quant_fp8_g128`` bitwise on rows built from the
pairs where the uncorrected product rounds differently, on signed zeros, subnormals, the 1e-10 amax floor and
groups holding an inf.
"""

import importlib.util
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from nsa_cp.rows import reference

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fp8_division_check", ROOT / "scripts" / "fp8_division_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _fp32_nearest(x: Fraction) -> np.float32:
    """The fp32 nearest to an exact rational (ties to even), by comparing the neighbours of a close guess."""
    guess = np.float32(float(x))
    around = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(around, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array([c]).view(np.uint32)[0]) & 1))


def test_the_emulated_fp32_steps_are_exact():
    rng = np.random.default_rng(7)
    xs = (rng.standard_normal((3, 3000)) * np.exp2(rng.integers(-40, 40, (3, 3000)))).astype(np.float32)
    xs[2, ::2] = (-xs[0, ::2].astype(np.float64) * xs[1, ::2]).astype(np.float32)  # cancellation
    x, y, z = xs
    got = check.fma32(x, y, z)
    for i in range(x.size):
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        assert got[i] == _fp32_nearest(exact), (x[i], y[i], z[i])
    b = np.abs(y) + np.float32(1e-30)
    quo = check.div32(x, b)
    for i in range(0, x.size, 7):
        assert quo[i] == _fp32_nearest(Fraction(float(x[i])) / Fraction(float(b[i])))
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is an fp32 midpoint: the sign of a far smaller addend decides
    one = np.array([1 + 2**-12], np.float32)
    up, down, tie = (check.fma32(one, one, np.array([t], np.float32))[0] for t in (2.0**-80, -(2.0**-80), 0.0))
    assert (float(up), float(down), float(tie)) == (1 + 2**-11 + 2**-23, 1 + 2**-11, 1 + 2**-11)


@pytest.mark.parametrize("exponent", [-100, -34, 0, 127])
def test_the_kernels_steps_round_like_a_division_over_whole_binades(exponent):
    """Every bf16 amax in the binade (below 2^-34 the 1e-10 floor holds the scale) and every bf16 value under
    it, both signs."""
    cases, uncorrected, corrected, first, _ = check.check_binade(exponent)
    assert cases > 10**5
    assert corrected == 0, f"e4m3 byte off from the division at amax, v = {first}"
    if exponent in (-34, 0):
        assert uncorrected > 0  # without the correction the bytes differ: this check can fail


def _rows_for(pairs):
    """One 128-wide group per (amax, v): amax, v, then random bf16 values below amax."""
    g = torch.Generator().manual_seed(3)
    rows = torch.rand((len(pairs), 128), generator=g, dtype=torch.float64) * 2 - 1
    amax = torch.tensor([p[0] for p in pairs], dtype=torch.float64)[:, None]
    rows = (rows * amax).to(torch.bfloat16).float()
    rows[:, 0] = amax[:, 0]
    rows[:, 1] = torch.tensor([p[1] for p in pairs])
    return rows.to(torch.bfloat16)


def _assert_kernel_is_reference(x):
    from nsa_cp.rows.kernels import norm_rows

    q, scale = norm_rows.quant_fp8_g128(x.to(DEVICE))
    want_q, want_scale = reference.quant_fp8_g128(x)
    assert torch.equal(scale.cpu(), want_scale)
    off = (q.cpu().view(torch.uint8) != want_q.view(torch.uint8)).nonzero()
    assert off.numel() == 0, f"{off.shape[0]} e4m3 bytes off, first at {off[0].tolist()}: x = {x[tuple(off[0])]}"


def test_the_kernel_on_the_pairs_that_need_the_correction():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    pairs = check.check_binade(0)[4] + check.check_binade(-34)[4]
    assert len(pairs) >= 64
    x = _rows_for(pairs[:256])
    assert x.shape[0] >= 64 and torch.equal(x[:, 1].float(), torch.tensor([p[1] for p in pairs[:256]]))
    _assert_kernel_is_reference(x.reshape(-1, 512) if x.shape[0] % 4 == 0 else x)


def test_the_kernel_on_zeros_subnormals_the_floor_and_inf():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(5)
    x = torch.randn((4, 4, 128), generator=g).to(torch.bfloat16)
    tiny = torch.tensor([2.0**-133, 2.0**-127, 2.0**-120], dtype=torch.bfloat16)  # bf16 subnormals, a normal
    x[0, 0, :3], x[0, 0, 3:6], x[0, 0, 6], x[0, 0, 7] = tiny, -tiny, 0.0, -0.0
    x[1, 1] = (torch.randn(128, generator=g) * 1e-12).to(torch.bfloat16)  # amax under 1e-10: the floor
    x[1, 1, :2] = torch.tensor([-0.0, 2.0**-133])
    x[2, 2] = torch.tensor([-0.0, 0.0] * 64)  # an all-zero group: scale 1e-10/448, q = +-0
    x[3, 3, 0] = float("inf")  # scale inf: every finite value -> +-0
    x[3, 3, 1:3] = torch.tensor([-3.0, -0.0])
    x = x.reshape(4, 512)
    from nsa_cp.rows.kernels import norm_rows

    q, scale = norm_rows.quant_fp8_g128(x.to(DEVICE))
    want_q, want_scale = reference.quant_fp8_g128(x)
    assert torch.equal(scale.cpu(), want_scale)
    got, want = q.cpu().view(torch.uint8), want_q.view(torch.uint8)
    finite = torch.isfinite(x)  # an inf element's q is NaN in the reference and clamped in the kernel
    assert torch.equal(got[finite], want[finite])
    assert got[0, 7].item() == 0x80 and got[3, 3 * 128 + 2].item() == 0x80  # -0 stays -0


def test_the_kernel_takes_the_reciprocal_where_fma_rounds_once():
    """The reciprocal runs where ``tl.fma`` is one rounding: compiled always, interpreted from the Triton whose
    interpreter has a true FMA (3.6's multiplies and adds: the kernel keeps ``div_rn`` there). Where it runs,
    dropping the correction fails test_the_kernel_on_the_pairs_that_need_the_correction."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    import triton

    from nsa_cp.rows.kernels import exact_fp32

    if exact_fp32.COMPILED:
        assert exact_fp32.fma_rounds_once()
    elif not exact_fp32.fma_rounds_once():
        pytest.skip(f"Triton {triton.__version__}'s interpreter rounds tl.fma twice: its kernels keep div_rn here")
    x = torch.tensor([1 + 2.0**-12], device=DEVICE)
    c = torch.tensor([-(1 + 2.0**-11)], device=DEVICE)
    out = torch.empty(1, device=DEVICE)
    exact_fp32._fma_probe[(1,)](x, c, out)
    assert out.item() == 2.0**-24
