"""The fused add + RMSNorm (+ FP8) row kernels (nsa_cp.rows.kernels.norm_rows) against nsa_cp.rows.reference.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest sets it); with one,
the same tests run on CUDA. Checks, per the house rules:
- the residual rows [0, n) exactly the reference's (fp32 sum rounded once); rows from n on, and x, untouched;
- y within one ulp of its dtype (bf16/fp16; fp32: see Y_ULPS) of the fp64 value of the convention, and equal
  to the reference wherever the arithmetic is order-independent: inputs on a coarse dyadic grid make the sum
  of squares exact, so every step is one correctly rounded fp32 operation in the reference's order;
- FP8: (q, scale) bitwise the reference's quantization of the kernel's own y (and of the reference's y on the
  dyadic grid); padding rows q = 0, scale exactly 1e-10/448; round-to-nearest-even on every e4m3 value,
  midpoint and neighbour; groups with an amax under the 1e-10 floor;
- destinations poisoned with NaN first; count = 0, count = M (even), count < rows of x (a bucket), M = 0,
  residual=None, strided rows; bad arguments raise ValueError naming the tensor and write nothing.
"""

import importlib.util

import pytest
import torch

from nsa_cp.rows import reference

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
from nsa_cp.rows.kernels import norm_rows as K  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8 = torch.float8_e4m3fn
QUANT = "fp8_e4m3_g128"

# Liger-style tolerance tables. y against the fp64 value of the convention, in ulps of y's dtype: bf16/fp16
# round once (0.5 ulp) after fp32 arithmetic worth ~1e-6 relative; fp32 output keeps the fp32 errors of the
# sum of squares (a tree of H terms), the division, the square root and two products.
Y_ULPS = {torch.bfloat16: 1, torch.float16: 1, torch.float32: 8}
# Share of y elements allowed to differ from the reference on random inputs (only the order of the sum of
# squares differs, which moves rstd by an fp32 ulp and y across a rounding boundary of its dtype now and then);
# each such element differs by exactly Y_ULPS at most.
Y_MISMATCH_SHARE = {torch.bfloat16: 0.02, torch.float16: 0.02, torch.float32: 1.0}
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_MIN_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}

# (M slot rows, n real rows, rows of x): uneven, count = 0 (empty x and a bucket), even (n = M), a bucket
# with rows past n, one row, an empty slot
SLOTS = [(8, 5, 5), (8, 0, 0), (6, 0, 3), (6, 6, 6), (8, 3, 7), (1, 1, 1), (0, 0, 2)]
HS = [256, 200, 33]  # a multiple of 128, a partial last group, a single short tile row
EPS = 1e-6


def ulp(v64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at the magnitude of each fp64 value (subnormal spacing below the normal range).
    The power of two is built from its fp64 bits, exactly: torch.pow(2.0, k) on CUDA can return 2^k less one
    fp64 ulp (and torch.ldexp multiplies by such a pow), and with that ulp a y one bf16 ulp from the
    oracle's (both correct roundings of fp32 values either side of a midpoint) would fail ``gap <= ulp``."""
    _, e = torch.frexp(v64.abs())
    k = torch.clamp(e.to(torch.int64) - 1, min=_MIN_EXP[dtype]) - _MANTISSA[dtype]
    return ((k + 1023) << 52).view(torch.float64)  # 2^k, k >= -149: a normal fp64


def randn(shape, dtype, seed, scale=1.0):
    """Random, never zero: |v| >= 0.05 * scale."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.where(v.abs() < 0.05, torch.copysign(torch.full_like(v, 0.05), v), v)
    return (v * scale).to(dtype).to(DEVICE)


def dyadic(shape, dtype, seed):
    """Nonzero multiples of 1/8 in [-4, 4]: exact in every dtype, and sums of up to 2^16 squares of sums of two
    are exact in fp32 in any order."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 33, shape, generator=g) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    return (k.to(torch.float64) / 8).to(dtype).to(DEVICE)


def weight_for(h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(h, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(DEVICE)


def nan(shape, dtype):
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)  # e4m3fn NaN
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def count_of(n):
    return torch.tensor(n, dtype=torch.int32, device=DEVICE)


def y64(x, residual, weight, eps=EPS):
    """The convention in fp64 from the fp32 sum (the sum is defined in fp32)."""
    s = x.float() + (residual.float() if residual is not None else 0)
    s = s.double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * weight.double()


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def assert_y_close(got, x, residual, weight, want_ref):
    dtype = got.dtype
    exact = y64(x, residual, weight)
    err = (got.double() - exact).abs()
    bound = Y_ULPS[dtype] * ulp(exact, dtype)
    assert bool((err <= bound).all()), f"y off the fp64 value by {(err / ulp(exact, dtype)).max().item()} ulps"
    differ = got != want_ref
    if differ.any():
        share = differ.double().mean().item()
        assert share <= Y_MISMATCH_SHARE[dtype], f"{share:.3%} of y differs from the reference"
        gap = (got.double() - want_ref.double()).abs()[differ]
        assert bool((gap <= Y_ULPS[dtype] * ulp(exact[differ], dtype)).all())


# ---- add + norm into a slot


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,rows", SLOTS)
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_into_slot_random(dtype, m, n, rows, h, with_residual):
    seed = m * 1000 + n * 100 + rows * 10 + h
    x = randn((rows, h), dtype, seed)
    residual = randn((rows, h), dtype, seed + 1) if with_residual else None
    weight = weight_for(h, dtype, seed + 2)
    x0 = x.clone()
    res_got = residual.clone() if with_residual else None
    res_want = residual.clone() if with_residual else None
    got, want = nan((m, h), dtype), nan((m, h), dtype)
    K.fused_add_rmsnorm_into(x, res_got, weight, EPS, got, count_of(n))
    reference.fused_add_rmsnorm_into_slot(x, res_want, weight, EPS, want, n)

    assert torch.equal(x, x0)
    if with_residual:
        assert torch.equal(res_got, res_want)  # rows [0, n) updated, the rest untouched (both sides)
        assert torch.equal(res_got[n:], residual[n:])
    assert bool((got[n:] == 0).all()), "padding rows must be exactly zero"
    assert not torch.isnan(got).any()
    assert_y_close(got[:n], x[:n], None if residual is None else residual[:n], weight, want[:n])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [256, 600])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_norm_into_slot_equals_reference_on_exact_inputs(dtype, h, weight_dtype):
    """On the dyadic grid every step is order-independent: the kernel is the reference bit for bit."""
    m, n = 7, 5
    x, residual = dyadic((6, h), dtype, 1), dyadic((6, h), dtype, 2)
    weight = weight_for(h, weight_dtype or dtype, 3)
    res_got, res_want = residual.clone(), residual.clone()
    got, want = nan((m, h), dtype), nan((m, h), dtype)
    K.fused_add_rmsnorm_into(x, res_got, weight, EPS, got, count_of(n))
    reference.fused_add_rmsnorm_into_slot(x, res_want, weight, EPS, want, n)
    assert torch.equal(res_got, res_want)
    assert torch.equal(got, want)
    assert_y_close(got[:n], x[:n], residual[:n], weight, want[:n])


def test_norm_into_slot_strided_rows_and_row_views():
    """x with a row stride wider than H, the slot a view into a larger gather buffer (rank 1's rows)."""
    h, m, n = 128, 4, 3
    x = randn((n, 2, h), torch.bfloat16, 5)[:, 1]
    residual_buf = randn((n, 3 * h), torch.bfloat16, 6)
    residual = residual_buf[:, h : 2 * h]
    weight = weight_for(h, torch.bfloat16, 7)
    want_res = residual.clone()
    want = nan((m, h), torch.bfloat16)
    reference.fused_add_rmsnorm_into_slot(x, want_res, weight, EPS, want, n)
    buffer = nan((3 * m, h), torch.bfloat16)
    before = residual_buf.clone()
    K.fused_add_rmsnorm_into(x, residual, weight, EPS, buffer[m : 2 * m], count_of(n))
    assert torch.isnan(buffer[:m]).all() and torch.isnan(buffer[2 * m :]).all()  # other ranks' slots untouched
    assert torch.equal(residual, want_res)
    assert torch.equal(residual_buf[:, :h], before[:, :h]) and torch.equal(residual_buf[:, 2 * h :], before[:, 2 * h :])
    assert_y_close(buffer[m : m + n], x, before[:, h : 2 * h], weight, want[:n])
    assert bool((buffer[m + n : 2 * m] == 0).all())


def test_count_is_read_on_device_and_clamped():
    """The count tensor, not the host, decides the rows; counts past x's rows stop at x's rows."""
    h = 128
    x, residual = randn((3, h), torch.float16, 8), randn((3, h), torch.float16, 9)
    weight = weight_for(h, torch.float16, 10)
    for n_dev, real in [(2, 2), (7, 3), (-4, 0)]:
        got = nan((5, h), torch.float16)
        res = residual.clone()
        K.fused_add_rmsnorm_into(x, res, weight, EPS, got, torch.tensor([n_dev], dtype=torch.int32, device=DEVICE))
        want_res = residual.clone()
        want = nan((5, h), torch.float16)
        reference.fused_add_rmsnorm_into_slot(x, want_res, weight, EPS, want, real)
        assert torch.equal(res, want_res) and bool((got[real:] == 0).all()), n_dev
        assert_y_close(got[:real], x[:real], residual[:real], weight, want[:real])


# ---- add + norm + FP8 into a slot, and the quant-only kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,rows", [(8, 5, 5), (6, 0, 3), (6, 6, 6), (8, 3, 7), (0, 0, 1)])
@pytest.mark.parametrize("h", [128, 384])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_fp8_into_slot(dtype, m, n, rows, h, with_residual):
    seed = 7 + m * 100 + n * 10 + rows + h
    x = randn((rows, h), dtype, seed)
    residual = randn((rows, h), dtype, seed + 1) if with_residual else None
    weight = weight_for(h, dtype, seed + 2)
    res_q = residual.clone() if with_residual else None
    res_y = residual.clone() if with_residual else None
    q, scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
    K.fused_add_rmsnorm_into(x, res_q, weight, EPS, q, count_of(n), quant=QUANT, dst_scale=scale)
    # the same kernel's y (same tiles, same reduction order): q must be the reference quantization of it
    y = nan((m, h), dtype)
    K.fused_add_rmsnorm_into(x, res_y, weight, EPS, y, count_of(n))
    want_q, want_scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
    reference.quant_fp8_g128_into_slot(y, want_q, want_scale, n)
    assert torch.equal(bits(q), bits(want_q))
    assert torch.equal(scale, want_scale)
    if with_residual:
        assert torch.equal(res_q, res_y)
        assert torch.equal(res_q[n:], residual[n:])
    assert bool((bits(q[n:]) == 0).all())
    assert bool((scale[n:] == reference.FP8_PAD_SCALE).all())
    assert reference.FP8_PAD_SCALE == float(torch.tensor(1e-10, dtype=torch.float32) / 448)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_fp8_equals_reference_on_exact_inputs(dtype):
    h, m, n = 256, 5, 4
    x, residual = dyadic((n, h), dtype, 11), dyadic((n, h), dtype, 12)
    weight = weight_for(h, dtype, 13)
    res_got, res_want = residual.clone(), residual.clone()
    q, scale = nan((m, h), FP8), nan((m, 2), torch.float32)
    want_q, want_scale = nan((m, h), FP8), nan((m, 2), torch.float32)
    K.fused_add_rmsnorm_into(x, res_got, weight, EPS, q, count_of(n), quant=QUANT, dst_scale=scale)
    reference.fused_add_rmsnorm_quant_into_slot(x, res_want, weight, EPS, want_q, want_scale, n)
    assert torch.equal(res_got, res_want)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,rows", [(6, 4, 4), (6, 0, 0), (5, 5, 5), (6, 2, 5)])
@pytest.mark.parametrize("h", [384, 1152])  # 3 groups: one tile; 9: tiles of 8 groups, the second one masked
def test_quant_into_slot(dtype, m, n, rows, h):
    x = randn((rows, h), dtype, 20 + rows)
    if rows >= 3:
        x[1, 128:256] = randn((128,), dtype, 21, scale=1e-12)  # amax under the 1e-10 floor
        x[2, :128] = randn((128,), dtype, 22, scale=1e-6)  # small, above the floor
    x0 = x.clone()
    q, scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
    want_q, want_scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
    K.quant_fp8_g128_into(x, q, scale, count_of(n))
    reference.quant_fp8_g128_into_slot(x, want_q, want_scale, n)
    assert torch.equal(x, x0)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)
    assert bool((scale[n:] == reference.FP8_PAD_SCALE).all()) and bool((bits(q[n:]) == 0).all())
    if n >= 3 and dtype != torch.float16:  # fp16 flushes 1e-12 to zero
        assert scale[1, 1].item() == reference.FP8_PAD_SCALE  # the floored group


def _e4m3_probe_values() -> torch.Tensor:
    """Every finite positive e4m3fn value, every midpoint between neighbours (ties), the fp32 neighbours of each
    midpoint, values under the smallest subnormal, all with both signs: fp32, multiples of nothing in particular."""
    finite = torch.arange(1, 0x7F, dtype=torch.uint8).view(FP8).to(torch.float32)  # 2^-9 .. 448
    grid = torch.cat([torch.zeros(1), finite])
    mids = (grid[1:] + grid[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    tiny = torch.tensor([2.0**-11, 2.0**-10, 2.0**-10 * 1.5, 2.0**-12])
    values = torch.cat([finite, mids, up, down, tiny])
    return torch.cat([values, -values])


def test_quant_rounds_every_e4m3_value_tie_and_neighbour_like_torch():
    """scale = 1 exactly (each group's amax is 448), so q = round_e4m3(x): the kernel's round-to-nearest-even
    against torch's float8_e4m3fn conversion, on every case the format has."""
    values = _e4m3_probe_values()
    per_group = 127
    groups = -(-values.numel() // per_group)
    padded = torch.cat([values, values[: groups * per_group - values.numel()]]).reshape(groups, per_group)
    x = torch.cat([torch.full((groups, 1), 448.0), padded], dim=1).reshape(1, groups * 128).to(DEVICE)
    q, scale = nan((1, groups * 128), FP8), nan((1, groups), torch.float32)
    K.quant_fp8_g128_into(x, q, scale, count_of(1))
    assert bool((scale == 1.0).all())
    want = x.clamp(-448, 448).to(FP8)
    assert torch.equal(bits(q), bits(want)), (x[bits(q) != bits(want)], q.float()[bits(q) != bits(want)])
    want_q, want_scale = reference.quant_fp8_g128(x)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quant_round_trip_bound(dtype):
    """|x - q * scale| <= 2^-4 |x| (3 mantissa bits, nearest) + 2^-10 scale (subnormal spacing, half of 2^-9)."""
    h = 512
    x = randn((6, h), dtype, 30)
    x[3] = randn((h,), dtype, 31, scale=1e-3)
    q, scale = K.quant_fp8_g128(x)
    deq = reference.dequant_fp8_g128(q, scale, torch.float32).double()
    xs = x.double()
    bound = xs.abs() * 2.0**-4 + scale.double().repeat_interleave(128, dim=1) * 2.0**-10
    assert bool(((deq - xs).abs() <= bound * (1 + 1e-6)).all())
    assert bool((scale.double() * 448 >= xs.abs().reshape(6, 4, 128).amax(-1) * (1 - 1e-6)).all())


# ---- the local, in-place norm (after a reduce-scatter)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,h", [(5, 256), (3, 200), (0, 64), (1, 7)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("into", ["x", "out"])
def test_fused_add_rmsnorm_local(dtype, rows, h, with_residual, into):
    x = randn((rows, h), dtype, 40 + rows + h)
    residual = randn((rows, h), dtype, 41) if with_residual else None
    weight = weight_for(h, dtype, 42)
    x0 = x.clone()
    res_want = residual.clone() if with_residual else None
    want, _ = reference.fused_add_rmsnorm(x0, res_want, weight, EPS)
    res_got = residual.clone() if with_residual else None
    out = nan((rows, h), dtype) if into == "out" else None
    y, r = K.fused_add_rmsnorm(x, res_got, weight, EPS, out=out)
    assert r is res_got
    if into == "x":
        assert y is x
    else:
        assert y is out and torch.equal(x, x0)
    if with_residual:
        assert torch.equal(res_got, res_want)
    assert not torch.isnan(y).any()
    assert_y_close(y, x0, residual, weight, want)


def test_weight_parameter_that_requires_grad():
    h = 128
    weight = torch.nn.Parameter(weight_for(h, torch.float32, 50))
    x, residual = randn((3, h), torch.bfloat16, 51), randn((3, h), torch.bfloat16, 52)
    got = nan((4, h), torch.bfloat16)
    K.fused_add_rmsnorm_into(x, residual, weight, EPS, got, count_of(3))
    assert not torch.isnan(got).any() and weight.grad is None


# ---- bad arguments: ValueError naming the tensor and shapes, nothing written


def _bad_calls():
    h = 200
    x, residual = randn((3, h), torch.bfloat16, 60), randn((3, h), torch.bfloat16, 61)
    w = weight_for(h, torch.bfloat16, 62)
    c = count_of(3)
    x128, r128, w128 = randn((3, 256), torch.bfloat16, 63), randn((3, 256), torch.bfloat16, 64), weight_for(256, torch.bfloat16, 65)
    yield "x: fp8_e4m3_g128 needs H a multiple of 128, got shape \\[3, 200\\]", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x, r, w, EPS, d, c, quant=QUANT, dst_scale=s)
    ), (4, h), True
    yield "x: fp8_e4m3_g128 needs H a multiple of 128, got shape \\[3, 200\\]", (
        lambda d, s, r: K.quant_fp8_g128_into(x, d, s, c)
    ), (4, h), True
    yield "weight: expected shape \\[200\\]", (lambda d, s, r: K.fused_add_rmsnorm_into(x, r, w[:100], EPS, d, c)), (4, h), False
    yield "weight: expected a bf16/fp16/fp32 tensor", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x, r, torch.ones(h, dtype=torch.int32, device=DEVICE), EPS, d, c)
    ), (4, h), False
    yield "residual: expected shape \\[3, 200\\], got \\[2, 200\\]", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x, r[:2], w, EPS, d, c)
    ), (4, h), False
    yield "dst: expected shape \\[4, 200\\], got \\[4, 100\\]", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x, r, w, EPS, d[:, :100], c)
    ), (4, h), False
    yield "dst: expected dtype torch.float8_e4m3fn", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x128, r128, w128, EPS, nan((4, 256), torch.bfloat16), c, quant=QUANT, dst_scale=s)
    ), (4, 256), True
    yield "dst_scale: expected shape \\[4, 2\\], got \\[4, 3\\]", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x128, r128, w128, EPS, d, c, quant=QUANT, dst_scale=nan((4, 3), torch.float32))
    ), (4, 256), True
    yield "dst_scale: fp8_e4m3_g128 needs", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x128, r128, w128, EPS, d, c, quant=QUANT)
    ), (4, 256), True
    yield "count: expected one int32 element", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x, r, w, EPS, d, torch.tensor(3, device=DEVICE))
    ), (4, h), False
    yield "quant: expected None or one of", (
        lambda d, s, r: K.fused_add_rmsnorm_into(x128, r128, w128, EPS, d, c, quant="fp8", dst_scale=s)
    ), (4, 256), True
    yield "x: expected a 2-D", (lambda d, s, r: K.fused_add_rmsnorm_into(x[0], r, w, EPS, d, c)), (4, h), False
    yield "x: expected dtype bfloat16, float16 or float32", (
        lambda d, s, r: K.quant_fp8_g128_into(torch.ones(3, 128, dtype=torch.int32, device=DEVICE), d, s, c)
    ), (4, 128), True
    yield "residual", (lambda d, s, r: K.fused_add_rmsnorm_into(x, r.float(), w, EPS, d, c)), (4, h), False


@pytest.mark.parametrize("words,call,dst_shape,fp8", list(_bad_calls()))
def test_bad_arguments_write_nothing(words, call, dst_shape, fp8):
    dst = nan(dst_shape, FP8 if fp8 else torch.bfloat16)
    scale = nan((dst_shape[0], dst_shape[1] // 128), torch.float32)
    residual = randn((3, dst_shape[1]), torch.bfloat16, 61 if dst_shape[1] == 200 else 64)
    res0 = residual.clone()
    with pytest.raises(ValueError, match=words):
        call(dst, scale, residual)
    assert bool((bits(dst) == 0x7F).all()) if fp8 else bool(torch.isnan(dst).all())
    assert torch.isnan(scale).all()
    assert torch.equal(residual, res0)


# ---- the production shape, and CUDA graphs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_production_row_length(dtype):
    """H = 7168 (DeepSeek-V3): the widest tile (64 x 128) and the most warps; a slot of rank 1 in a padded buffer."""
    h = 7168
    m, n = (300, 257) if DEVICE.type == "cuda" else (6, 5)
    x, residual = randn((n, h), dtype, 80), randn((n, h), dtype, 81)
    weight = weight_for(h, torch.bfloat16, 82)
    res_got, res_want = residual.clone(), residual.clone()
    buffer = nan((2 * m, h), dtype)
    want = nan((m, h), dtype)
    K.fused_add_rmsnorm_into(x, res_got, weight, EPS, buffer[m:], count_of(n))
    reference.fused_add_rmsnorm_into_slot(x, res_want, weight, EPS, want, n)
    assert torch.equal(res_got, res_want) and torch.isnan(buffer[:m]).all()
    assert bool((buffer[m + n :] == 0).all())
    assert_y_close(buffer[m : m + n], x, residual, weight, want[:n])
    q, scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
    res_q = residual.clone()
    K.fused_add_rmsnorm_into(x, res_q, weight, EPS, q, count_of(n), quant=QUANT, dst_scale=scale)
    want_q, want_scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
    reference.quant_fp8_g128_into_slot(buffer[m:], want_q, want_scale, n)  # the quantization of the kernel's y
    assert torch.equal(res_q, res_want)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA GPU (none visible here)")
def test_cuda_graph_replays_follow_the_device_count():
    """Captured once, replayed an odd number of times with counts 5, 0, M (even), 9, 1: every replay writes the
    rows the count says, zeros the rest, and updates only those residual rows."""
    h, m = 1024, 16
    dtype = torch.bfloat16
    x, residual = randn((m, h), dtype, 70), randn((m, h), dtype, 71)
    weight = weight_for(h, torch.float32, 72)
    count = torch.zeros((), dtype=torch.int32, device=DEVICE)
    res_y, res_q = residual.clone(), residual.clone()
    y, q, scale = nan((m, h), dtype), nan((m, h), FP8), nan((m, h // 128), torch.float32)
    q_only, scale_only = nan((m, h), FP8), nan((m, h // 128), torch.float32)

    def calls():
        K.fused_add_rmsnorm_into(x, res_y, weight, EPS, y, count)
        K.fused_add_rmsnorm_into(x, res_q, weight, EPS, q, count, quant=QUANT, dst_scale=scale)
        K.quant_fp8_g128_into(x, q_only, scale_only, count)

    calls()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for n in (5, 0, m, 9, 1):
        res_y.copy_(residual)
        res_q.copy_(residual)
        for t in (y, scale, scale_only):
            t.fill_(float("nan"))
        q.view(torch.uint8).fill_(0x7F)
        q_only.view(torch.uint8).fill_(0x7F)
        count.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        want_res, want_y = residual.clone(), nan((m, h), dtype)
        reference.fused_add_rmsnorm_into_slot(x, want_res, weight, EPS, want_y, n)
        assert torch.equal(res_y, want_res) and torch.equal(res_q, want_res), n
        assert bool((y[n:] == 0).all()), n
        assert_y_close(y[:n], x[:n], residual[:n], weight, want_y[:n])
        want_q, want_scale = nan((m, h), FP8), nan((m, h // 128), torch.float32)
        reference.quant_fp8_g128_into_slot(y, want_q, want_scale, n)
        assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale), n
        reference.quant_fp8_g128_into_slot(x, want_q, want_scale, n)
        assert torch.equal(bits(q_only), bits(want_q)) and torch.equal(scale_only, want_scale), n


@pytest.mark.parametrize("norm", [True, False])
def test_fp8_into_one_wire_buffer(norm):
    """The FP8 slot as views of one uint8 wire row (q bytes, then the scales): what one collective moves."""
    from nsa_cp.rows import quant

    h, m, n = 256, 5, 3
    wire = torch.full((3 * m, quant.fp8_wire_row_bytes(h)), 0xEE, dtype=torch.uint8, device=DEVICE)
    q, scale = quant.fp8_wire_views(wire[m : 2 * m], h)
    x, residual = randn((n, h), torch.bfloat16, 90), randn((n, h), torch.bfloat16, 91)
    weight = weight_for(h, torch.bfloat16, 92)
    want_q, want_scale = nan((m, h), FP8), nan((m, 2), torch.float32)
    if norm:
        res_y, y = residual.clone(), nan((m, h), torch.bfloat16)
        K.fused_add_rmsnorm_into(x, res_y, weight, EPS, y, count_of(n))  # the kernel's y, quantized below
        reference.quant_fp8_g128_into_slot(y, want_q, want_scale, n)
        K.fused_add_rmsnorm_into(x, residual, weight, EPS, q, count_of(n), quant=QUANT, dst_scale=scale)
        assert torch.equal(residual, res_y)
    else:
        reference.quant_fp8_g128_into_slot(x, want_q, want_scale, n)
        K.quant_fp8_g128_into(x, q, scale, count_of(n))
    assert bool((wire[:m] == 0xEE).all()) and bool((wire[2 * m :] == 0xEE).all())
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)
