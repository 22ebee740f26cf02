"""nsa_cp.RMSNorm: docs/design.md's convention on every implementation it picks, against nsa_cp.rows.reference and fp64.

CPU: the torch path (the reference itself) and the Triton kernel forced through the interpreter are not the
same thing, so the module is checked on CPU through its torch path, and the kernels separately in
test_norm_kernels.py. CUDA (skipped without a GPU, saying so): the Triton path, and flashinfer's when it
imports (skipped, saying why, when it does not), each against the reference within one ulp of the dtype.
"""

import importlib.util
import logging
import os

import pytest
import torch

import nsa_cp
from nsa_cp.rows import norm as norm_module
from nsa_cp.rows import reference

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none visible here)")
EPS = 1e-5
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_MIN_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}
# ulps of the output dtype between y and the fp64 value of the convention (see test_norm_kernels.py)
Y_ULPS = {torch.bfloat16: 1, torch.float16: 1, torch.float32: 8}
# share of y allowed to differ from the reference (by at most Y_ULPS): the order of the sum of squares
# differs everywhere; flashinfer's rsqrt is the hardware approximation
Y_MISMATCH_SHARE = {torch.bfloat16: 0.03, torch.float16: 0.03, torch.float32: 1.0}


def ulp(v64, dtype):
    _, e = torch.frexp(v64.abs())
    e = torch.clamp(e.to(torch.float64) - 1, min=_MIN_EXP[dtype])
    return torch.pow(2.0, e - _MANTISSA[dtype])


def randn(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.where(v.abs() < 0.05, torch.copysign(torch.full_like(v, 0.05), v), v)
    return v.to(dtype).to(device)


def make_norm(h, dtype, device, impl="auto", weight_dtype=None, seed=0):
    norm = nsa_cp.RMSNorm(h, eps=EPS, dtype=weight_dtype or dtype, device=device, impl=impl)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5)
    return norm


def y64(x, residual, weight):
    s = (x.float() + (residual.float() if residual is not None else 0)).double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * weight.double()


def check_call(norm, x, residual, exact_reference: bool):
    """One call against the reference: residual (same object, updated in place exactly), x untouched, y."""
    x0 = x.clone()
    r0 = residual.clone() if residual is not None else None
    want_res = residual.clone() if residual is not None else None
    want, _ = reference.fused_add_rmsnorm(x0, want_res, norm.weight, norm.eps)
    if residual is None:
        y = norm(x)
    else:
        y, res = norm(x, residual)
        assert res is residual
        assert torch.equal(residual, want_res)
    assert torch.equal(x, x0), "x must not be modified"
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.isnan(y).any()
    if exact_reference:
        assert torch.equal(y, want)
    exact = y64(x0, r0, norm.weight.detach())
    err = (y.double() - exact).abs()
    assert bool((err <= Y_ULPS[y.dtype] * ulp(exact, y.dtype)).all()), (err / ulp(exact, y.dtype)).max()
    differ = y != want
    assert differ.sum().item() <= Y_MISMATCH_SHARE[y.dtype] * differ.numel()
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 48), (0, 32)])
def test_cpu_follows_the_convention(dtype, with_residual, shape):
    h = shape[-1]
    norm = make_norm(h, dtype, "cpu", seed=1)
    x = randn(shape, dtype, 2)
    residual = randn(shape, dtype, 3) if with_residual else None
    check_call(norm, x, residual, exact_reference=True)


def test_sum_in_fp32_then_one_rounding():
    """The convention normalises the fp32 sum, not the sum rounded to the dtype. Here the
    bf16 sum rounds 1 + 3/512 up to 1 + 1/128, and y differs (0.4492 against 0.4512 for the rounded sum)."""
    h = 8
    norm = nsa_cp.RMSNorm(h, eps=EPS, dtype=torch.float32)
    x = torch.tensor([[1.0, 3.0] * 4], dtype=torch.bfloat16)
    residual = torch.tensor([[3 * 2.0**-9, 0.0] * 4], dtype=torch.bfloat16)
    s32 = x.float() + residual.float()
    y, res = norm(x, residual.clone())
    assert torch.equal(res, s32.to(torch.bfloat16))
    want = (s32 * (1.0 / torch.sqrt((s32.square().sum(-1, keepdim=True) / h + EPS).double()).float())).to(torch.bfloat16)
    assert torch.equal(y, want)
    rounded = (x + residual).float()
    rounded_y = (rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    assert not torch.equal(y, rounded_y)


def test_parameter_requires_grad_and_no_graph():
    norm = make_norm(32, torch.float32, "cpu", seed=4)
    assert norm.weight.requires_grad
    x = randn((3, 32), torch.float32, 5).requires_grad_(True)
    residual = randn((3, 32), torch.float32, 6)
    y, res = norm(x, residual)
    assert not y.requires_grad and res is residual and norm.weight.grad is None
    leaf = randn((3, 32), torch.float32, 7).requires_grad_(True)  # a residual that requires grad: updated in place
    want = leaf.detach() + x.detach()
    norm(x, leaf)
    assert torch.equal(leaf.detach(), want)


def test_attributes_and_bad_input():
    norm = nsa_cp.RMSNorm(16, eps=1e-6)
    assert norm.eps == norm.variance_epsilon == 1e-6 and tuple(norm.weight.shape) == (16,)
    norm.variance_epsilon = 1e-5
    assert norm.eps == 1e-5
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"x: expected last dim 16, got shape \[2, 8\]"):
        norm(torch.randn(2, 8))
    r = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"residual: expected shape \[4, 16\] \(x's\), got \[2, 16\]"):
        norm(x, r)
    r = torch.randn(4, 16, dtype=torch.float64)
    r0 = r.clone()
    with pytest.raises(ValueError, match="residual: expected torch.float32"):
        norm(x, r)
    assert torch.equal(r, r0)
    with pytest.raises(ValueError, match="impl: expected one of"):
        nsa_cp.RMSNorm(16, impl="cuda")
    with pytest.raises(ValueError, match="hidden_size"):
        nsa_cp.RMSNorm(0)


@pytest.mark.skipif(CUDA, reason="checks the CPU refusal of the CUDA implementations")
@pytest.mark.parametrize("impl", ["flashinfer", "triton"])
def test_forced_gpu_impl_on_cpu_says_why(impl):
    norm = nsa_cp.RMSNorm(16, impl=impl)
    with pytest.raises(ValueError, match=f"impl: '{impl}' cannot serve this call: x is not on a CUDA device"):
        norm(torch.randn(2, 16))


def test_choice_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(norm_module, "_logged", set())
    norm = nsa_cp.RMSNorm(16)
    with caplog.at_level(logging.INFO, logger="nsa_cp"):
        norm(torch.randn(2, 16))
        norm(torch.randn(3, 16), torch.randn(3, 16))
    records = [r for r in caplog.records if "nsa_cp.RMSNorm: using" in r.getMessage()]
    assert len(records) == 1 and "torch" in records[0].getMessage()


# ---- CUDA: the Triton path and flashinfer's against the reference


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("h", [7168, 4096, 200])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_cuda_triton_path(dtype, with_residual, h, weight_dtype):
    norm = make_norm(h, dtype, "cuda", impl="triton", weight_dtype=weight_dtype, seed=8)
    x = randn((37, h), dtype, 9, "cuda")
    residual = randn((37, h), dtype, 10, "cuda") if with_residual else None
    check_call(norm, x, residual, exact_reference=False)
    # strided rows (a column slice of a wider buffer) take the kernel too
    wide = randn((5, 2 * h), dtype, 11, "cuda")
    check_call(norm, wide[:, :h], None, exact_reference=False)


def _flashinfer_or_skip():
    # NSA_TEST_REQUIRE_FLASHINFER=1 (scripts/gpu_flashinfer.sh): a run meant to test flashinfer fails instead
    skip = pytest.fail if os.environ.get("NSA_TEST_REQUIRE_FLASHINFER") == "1" else pytest.skip
    if importlib.util.find_spec("flashinfer") is None:
        skip("flashinfer is not installed (pip install nsa_cp[flashinfer])")
    if norm_module.flashinfer_norm_module() is None:
        skip("flashinfer is installed but does not import here (see the nsa_cp log)")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows,h", [(37, 7168), (1, 4096), (256, 2048)])
def test_cuda_flashinfer_path(dtype, with_residual, rows, h):
    """flashinfer's rmsnorm / fused_add_rmsnorm against the reference: its fused kernel sums in fp32, stores the
    rounded sum as the residual (exactly the reference's) and normalises the fp32 sum; only its approximate
    rsqrt and its reduction order differ (within one ulp of the dtype)."""
    _flashinfer_or_skip()
    norm = make_norm(h, dtype, "cuda", impl="flashinfer", seed=12)
    x = randn((rows, h), dtype, 13, "cuda")
    residual = randn((rows, h), dtype, 14, "cuda") if with_residual else None
    check_call(norm, x, residual, exact_reference=False)
    empty = randn((0, h), dtype, 13, "cuda")
    assert norm.impl == "flashinfer" and nsa_cp.RMSNorm(h, dtype=dtype, device="cuda")(empty).shape == (0, h)


@needs_cuda
def test_cuda_auto_takes_flashinfer_where_it_fits(caplog, monkeypatch):
    monkeypatch.setattr(norm_module, "_logged", set())
    fi = importlib.util.find_spec("flashinfer") is not None and norm_module.flashinfer_norm_module() is not None
    norm = make_norm(256, torch.bfloat16, "cuda", seed=15)
    fp32_weight = make_norm(256, torch.bfloat16, "cuda", weight_dtype=torch.float32, seed=15)
    x = randn((4, 256), torch.bfloat16, 16, "cuda")
    with caplog.at_level(logging.INFO, logger="nsa_cp"):
        norm(x)
        fp32_weight(x)  # flashinfer would read an fp32 weight as bf16: the Triton kernel takes it
    used = " ".join(r.getMessage() for r in caplog.records if "nsa_cp.RMSNorm: using" in r.getMessage())
    assert ("using flashinfer" in used) == fi and "using triton" in used


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", [(4, 2, 96), (3, 200)])
def test_triton_wiring(with_residual, shape):
    """The module's Triton call (views of N-D tensors, the output it allocates, the residual written through a
    view) on this machine's device: CUDA, or CPU under the interpreter that conftest turns on without a GPU."""
    device = "cuda" if CUDA else "cpu"
    norm = make_norm(shape[-1], torch.bfloat16, device, weight_dtype=torch.float32, seed=17)
    x = randn(shape, torch.bfloat16, 18, device)
    residual = randn(shape, torch.bfloat16, 19, device) if with_residual else None
    want_res = residual.clone() if with_residual else None
    want, _ = reference.fused_add_rmsnorm(x, want_res, norm.weight, norm.eps)
    with torch.no_grad():
        y = norm._triton(x, residual, norm.weight.detach())
    assert y.shape == x.shape
    if with_residual:
        assert torch.equal(residual, want_res)
    assert (y != want).sum().item() <= Y_MISMATCH_SHARE[torch.bfloat16] * y.numel()
    assert bool(((y.double() - want.double()).abs() <= ulp(want.double(), torch.bfloat16)).all())
